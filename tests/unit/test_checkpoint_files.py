"""HDF5 checkpoints in one process: exact round trips, the documented layout, atomic writes, pruning,
refusing bad files, find_latest, describe and ``mpiopt inspect``."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import mpiopt.checkpoint.summary as summary_module
import mpiopt.checkpoint.files as files_module
import mpiopt.checkpoint.writers as writers_module
from mpiopt import Comm
from mpiopt.checkpoint import (
    CheckpointError,
    checkpoint_path,
    describe,
    find_latest,
    first_difference,
    format_description,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    validate_checkpoint,
)
from mpiopt.cli import inspect as inspect_cli


@pytest.fixture(scope="module")
def comm():
    c = Comm(MPI.COMM_SELF, name="self")
    yield c
    c.Free()


def every_kind() -> dict:
    """A nested state with every kind of value the format promises to keep."""
    rng = np.random.default_rng(4)
    return {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f64": rng.standard_normal(5),
        "i32": np.arange(-3, 3, dtype=np.int32),
        "u8": np.frombuffer(b"\x00\xffab", dtype=np.uint8).copy(),
        "bools": np.array([True, False, True]),
        "zero_d": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 7), dtype=np.float64),
        "empty_int": np.zeros(0, dtype=np.int32),
        "big_endian": np.arange(4, dtype=">i4"),
        "strided": np.arange(20, dtype=np.float64)[::3],
        "np_float32": np.float32(1.25),
        "np_int64": np.int64(-7),
        "np_bool": np.bool_(True),
        "none": None,
        "true": True,
        "false": False,
        "int": 42,
        "negative": -(2**40),
        "huge": 2**127 + 3,
        "huge_negative": -(2**90),
        "float": 0.1,
        "nan": float("nan"),
        "negative_zero": -0.0,
        "str": "résumé ✓",
        "empty_str": "",
        "bytes": b"\x00pickled\x00state",
        "empty_bytes": b"",
        "nested": {"deeper": {"x": np.ones(2, np.float16), "n": None, "flag": False}, "empty": {}},
        "rng": {"numpy": rng.bit_generator.state, "torch": np.arange(16, dtype=np.uint8)},
    }


def save_one(path, comm, state=None, *, model=None, attrs=None, keep=None):
    return save_checkpoint(path, comm, model=model, rank_state={"x": np.arange(3.0)} if state is None else state, attrs=attrs or {}, keep=keep)


# -- round trips ----------------------------------------------------------------------------
def test_every_kind_of_value_round_trips_exactly(tmp_path, comm):
    state = every_kind()
    path = save_one(tmp_path / "c.h5", comm, state)
    loaded = load_checkpoint(path, comm).rank_state
    assert first_difference(state, loaded) is None
    # Spelled out for the cases a loose comparison would let through.
    assert type(loaded["int"]) is int and type(loaded["true"]) is bool and type(loaded["float"]) is float
    assert loaded["huge"] == 2**127 + 3 and loaded["huge_negative"] == -(2**90)
    assert type(loaded["np_float32"]) is np.float32 and type(loaded["np_bool"]) is np.bool_
    assert isinstance(loaded["zero_d"], np.ndarray) and loaded["zero_d"].shape == () and loaded["zero_d"].dtype == np.float32
    assert loaded["empty"].shape == (0, 7) and loaded["big_endian"].dtype == np.dtype(">i4")
    assert np.array_equal(loaded["strided"], np.arange(0, 20, 3.0))
    assert loaded["none"] is None and loaded["nested"]["deeper"]["n"] is None and loaded["nested"]["empty"] == {}
    assert loaded["bytes"] == b"\x00pickled\x00state" and loaded["empty_bytes"] == b""
    assert np.isnan(loaded["nan"]) and np.signbit(loaded["negative_zero"]) and loaded["str"] == "résumé ✓"
    # The numpy generator state comes back usable: the same stream continues.
    restored = np.random.default_rng()
    restored.bit_generator.state = loaded["rng"]["numpy"]
    reference = np.random.default_rng(4)
    reference.standard_normal((3, 4)), reference.standard_normal(5)
    assert np.array_equal(restored.random(5), reference.random(5))


def test_first_difference_sees_what_equality_would_miss():
    assert first_difference({"a": 1}, {"a": True}) == "state['a']: int vs bool"
    assert "float32" in first_difference({"a": np.zeros(2, np.float32)}, {"a": np.zeros(2, np.float64)})
    assert "values differ" in first_difference([np.array([0.0])][0], np.array([-0.0]), "x")
    assert "keys ['b']" in first_difference({"a": 1}, {"a": 1, "b": 2})
    assert first_difference({"a": float("nan")}, {"a": float("nan")}) is None


def test_model_names_with_dots_are_flat_datasets(tmp_path, comm):
    model = {
        "layer1.0.conv1.weight": np.ones((4, 3, 3, 3), np.float32),
        "layer1.0.bn1.running_mean": np.zeros(4, np.float32),
        "layer1.0.bn1.num_batches_tracked": np.array(7, np.int64),
        "fc": np.arange(6, dtype=np.float64).reshape(2, 3),
    }
    path = save_one(tmp_path / "m.h5", comm, model=model)
    with h5py.File(path, "r") as f:
        assert sorted(f["model"]) == sorted(model)
        assert all(isinstance(f["model"][name], h5py.Dataset) for name in model)
        assert f["model/layer1.0.conv1.weight"].shape == (4, 3, 3, 3)
    loaded = load_checkpoint(path, comm).model
    assert first_difference(model, loaded, "model") is None


def test_without_a_model_there_is_no_model_group(tmp_path, comm):
    path = save_one(tmp_path / "n.h5", comm)
    assert load_checkpoint(path, comm).model is None
    with h5py.File(path, "r") as f:
        assert "model" not in f


def test_json_attrs_survive_a_library_version_with_a_nul(tmp_path, comm, monkeypatch):
    # Open MPI 4.1's version string ends in a NUL character; it once made the library's own
    # attributes a second JSON list that replaced the caller's, so JSON attrs read back as text.
    monkeypatch.setattr(MPI, "Get_library_version", lambda: "Open MPI v4.1.6, package: Debian OpenMPI\0")
    attrs = {"hyperparameters": {"period": 4}, "shapes": [[3, 4]]}
    got = load_checkpoint(save_one(tmp_path / "v.h5", comm, attrs=attrs), comm).attrs
    assert got["hyperparameters"] == {"period": 4} and got["shapes"] == [[3, 4]]
    assert got["mpi_library_version"] == "Open MPI v4.1.6, package: Debian OpenMPI"


def test_attrs_round_trip_and_the_added_attributes(tmp_path, comm):
    attrs = {
        "step": 1200,
        "epoch": 3,
        "algorithm": "lsgd",
        "lr": np.float32(0.5),
        "finite": True,
        "hyperparameters": {"pull_local": 0.1, "period": 4, "nesterov": True},
        "config": {"data": {"batch": 128, "augment": ["crop", "flip"]}, "note": None},
        "shapes": [[3, 4], [5]],
        "nothing": None,
        "torch_version": "2.13.0+cpu",
        "huge": 2**70,
    }
    path = save_one(tmp_path / "a.h5", comm, attrs=attrs)
    got = load_checkpoint(path, comm).attrs
    for name in ("step", "epoch", "algorithm", "finite", "hyperparameters", "config", "shapes", "nothing", "torch_version", "huge"):
        assert got[name] == attrs[name] and type(got[name]) is type(attrs[name]), name
    assert got["lr"] == 0.5 and type(got["lr"]) is float  # numpy scalars become Python numbers
    assert got["format"] == "mpiopt-checkpoint" and got["format_version"] == 1 and got["world_size"] == 1
    assert got["complete"] is True and got["numpy_version"] == np.__version__ and got["h5py_version"] == h5py.__version__
    import mpiopt

    assert got["mpiopt_version"] == mpiopt.__version__ and got["mpi_library_version"].startswith(MPI.Get_library_version()[:5])
    assert got["created"].endswith("+00:00") and len(got["id"]) == 32
    with h5py.File(path, "r") as f:  # scalars stay readable HDF5 attributes; nested ones are JSON text
        assert f.attrs["step"] == 1200 and json.loads(f.attrs["config"]) == attrs["config"]


@pytest.mark.parametrize(
    "state, attrs, match",
    [
        ({"t": (1, 2)}, {}, r"cannot save checkpoint .*bad.h5: rank_state\['t'\]: cannot store a tuple"),
        ({"a": {"b": [1.0]}}, {}, r"rank_state\['a'\]\['b'\]: cannot store a list"),
        ({"o": np.array(["x"], dtype=object)}, {}, r"rank_state\['o'\]: cannot store an array of dtype object"),
        ({"u": np.array(["x"])}, {}, r"rank_state\['u'\]: cannot store an array of dtype <U1"),
        ({3: 1}, {}, r"rank_state: keys must be str, got 3"),
        ({"a/b": 1}, {}, r"key 'a/b' cannot name an HDF5 object"),
        ({"s": "a\0b"}, {}, r"rank_state\['s'\]: a str with a NUL"),
        ({}, {"world_size": 2}, r"attrs may not set \['world_size'\]"),
        ({}, {"bad": object()}, r"attrs\['bad'\] is not JSON-serialisable"),
    ],
)
def test_what_cannot_be_stored_is_refused_naming_it(tmp_path, comm, state, attrs, match):
    path = tmp_path / "bad.h5"
    with pytest.raises(CheckpointError, match=match):
        save_checkpoint(path, comm, model=None, rank_state=state, attrs=attrs)
    assert os.listdir(tmp_path) == []


def test_model_values_must_be_arrays(tmp_path, comm):
    with pytest.raises(CheckpointError, match=r"model\['w'\] must be a numpy array, got list"):
        save_one(tmp_path / "m.h5", comm, model={"w": [1.0]})


# -- atomic writes ---------------------------------------------------------------------------
def _fail_on_dataset(monkeypatch, nth):
    """Make the ``nth`` dataset write raise ENOSPC, as a full disk would."""
    real, count = writers_module.write_entry, [0]

    def failing(root, entry, array):
        if entry.kind == "dataset":
            count[0] += 1
            if count[0] == nth:
                raise OSError(28, "No space left on device")
        real(root, entry, array)

    monkeypatch.setattr(writers_module, "write_entry", failing)


@pytest.mark.parametrize("how", ["mid-write", "rename"])
def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path, comm, monkeypatch, how):
    path = checkpoint_path(tmp_path, 7)
    good = {"x": np.arange(5.0), "tag": "old"}
    save_one(path, comm, good)
    before = open(path, "rb").read()
    if how == "mid-write":
        _fail_on_dataset(monkeypatch, 2)
        expected = "No space left on device"
    else:

        def refuse(src, dst):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(files_module.os, "replace", refuse)
        expected = "Permission denied"
    with pytest.raises(CheckpointError, match=f"cannot save checkpoint {path}: writing on rank 0 failed: .*{expected}"):
        save_one(path, comm, {"x": np.zeros(5), "y": np.ones(3), "z": np.ones(2), "tag": "new"})
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == [os.path.basename(path)]
    assert load_checkpoint(path, comm).rank_state["tag"] == "old"


def test_the_temporary_file_is_hidden_in_the_same_directory(tmp_path, comm, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((src, dst, validate_checkpoint(src)))
        real_replace(src, dst)

    monkeypatch.setattr(files_module.os, "replace", spy)
    path = save_one(checkpoint_path(tmp_path / "new" / "dir", 3), comm)  # the directory is created
    (src, dst, problem), = seen
    assert dst == path and os.path.dirname(src) == os.path.dirname(os.path.abspath(path))
    assert os.path.basename(src) == f".ckpt-000000003.h5.tmp-{os.getpid()}" and problem is None


def test_a_directory_that_cannot_be_made_is_a_checkpoint_error(tmp_path, comm):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot save checkpoint .*file/ckpt-000000001.h5: writing on rank 0 failed"):
        save_one(checkpoint_path(tmp_path / "file", 1), comm)


def test_keep_prunes_all_but_the_newest_k(tmp_path, comm):
    (tmp_path / "notes.txt").write_text("kept")
    (tmp_path / "ckpt-final.h5").write_text("not our name scheme: kept")
    for step in (1, 2, 3, 4, 5):
        save_one(checkpoint_path(tmp_path, step), comm, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    # The file just written is never deleted, even when older than the newest K.
    save_one(checkpoint_path(tmp_path, 3), comm, keep=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 5]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000003.h5", "ckpt-000000005.h5", "ckpt-final.h5", "notes.txt"]


def test_a_publish_removes_the_temporaries_a_lost_writer_left_of_its_step_or_older(tmp_path, comm):
    """A rank lost in the middle of a save leaves its temporary file; the next save deletes it, never a newer one."""
    left = [".ckpt-000000002.h5.tmp-4242", ".ckpt-000000004.h5.tmp-17", ".ckpt-000000009.h5.tmp-5", ".ckpt-notes.tmp-1"]
    for name in left:
        (tmp_path / name).write_text("half a checkpoint")
    save_one(checkpoint_path(tmp_path, 4), comm)
    assert sorted(os.listdir(tmp_path)) == [".ckpt-000000009.h5.tmp-5", ".ckpt-notes.tmp-1", "ckpt-000000004.h5"]
    save_one(tmp_path / "elsewhere.h5", comm)  # a name without a step removes nothing
    assert ".ckpt-000000009.h5.tmp-5" in os.listdir(tmp_path)


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_must_be_a_positive_integer(tmp_path, comm, keep):
    with pytest.raises(CheckpointError, match=f"keep must be a positive integer or None, got {keep!r}"):
        save_one(tmp_path / "k.h5", comm, keep=keep)


def test_checkpoint_path_names_and_checks_the_step(tmp_path):
    assert checkpoint_path("/ck", 42) == "/ck/ckpt-000000042.h5"
    assert checkpoint_path(tmp_path, 10**10).endswith("ckpt-10000000000.h5")
    for bad in (-1, 1.0, True, "3"):
        with pytest.raises(ValueError, match="step must be an integer >= 0"):
            checkpoint_path(tmp_path, bad)


# -- refusing bad files ----------------------------------------------------------------------
def _truncated(path):
    data = open(path, "rb").read()
    with open(path, "wb") as out:
        out.write(data[: len(data) // 2])


def _random_bytes(path):
    with open(path, "wb") as out:
        out.write(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def _foreign(path):
    os.remove(path)
    with h5py.File(path, "w") as f:
        f["data"] = np.arange(3)


def _incomplete(path):
    with h5py.File(path, "a") as f:
        del f.attrs["complete"]


def _newer_format(path):
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = 2


def _missing_rank(path):
    with h5py.File(path, "a") as f:
        f.attrs["world_size"] = 2


BAD_FILES = [
    (_truncated, "not a readable HDF5 file"),
    (_random_bytes, "not a readable HDF5 file"),
    (_foreign, r"not an mpiopt checkpoint \(root attribute 'format' is None"),
    (_incomplete, "incomplete: no completeness marker"),
    (_newer_format, "format version 2 is not supported"),
    (_missing_rank, "/ranks does not hold one group per rank of the world size 2"),
    (os.remove, "no such file"),
]


@pytest.mark.parametrize("spoil, problem", BAD_FILES, ids=[b[0].__name__.strip("_") for b in BAD_FILES])
def test_bad_files_are_refused_naming_the_file_and_the_problem(tmp_path, comm, spoil, problem):
    path = save_one(checkpoint_path(tmp_path, 1), comm, model={"w": np.ones(1000, np.float32)})
    spoil(path)
    with pytest.raises(CheckpointError, match=f"cannot load checkpoint {path}: {problem}"):
        load_checkpoint(path, comm)
    assert re.match(problem, validate_checkpoint(path))


def test_another_world_size_is_refused_naming_both_sizes_unless_allowed(tmp_path, comm):
    path = save_one(tmp_path / "w.h5", comm, {"mine": np.arange(4)})
    with h5py.File(path, "a") as f:  # as if two ranks had written it
        f["ranks"].copy("0", "1")
        f.attrs["world_size"] = 2
    with pytest.raises(CheckpointError, match=f"cannot load checkpoint {path}: written by 2 ranks; this job has 1"):
        load_checkpoint(path, comm)
    loaded = load_checkpoint(path, comm, allow_world_size_change=True)
    assert loaded.world_size == 2 and np.array_equal(loaded.rank_state["mine"], np.arange(4))


def test_find_latest_skips_invalid_files_and_names_them(tmp_path, comm):
    for step in (1, 2, 3, 10):
        save_one(checkpoint_path(tmp_path, step), comm)
    _truncated(checkpoint_path(tmp_path, 10))
    _incomplete(checkpoint_path(tmp_path, 3))
    (tmp_path / ".ckpt-000000011.h5.tmp-99").write_bytes(b"a crashed write")
    with pytest.warns(UserWarning) as caught:
        assert find_latest(tmp_path) == checkpoint_path(tmp_path, 2)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert messages[0].startswith(f"skipping checkpoint {checkpoint_path(tmp_path, 10)}: not a readable HDF5 file")
    assert messages[1].startswith(f"skipping checkpoint {checkpoint_path(tmp_path, 3)}: incomplete")


def test_find_latest_without_valid_checkpoints(tmp_path, recwarn):
    assert find_latest(tmp_path / "missing") is None
    _random_bytes(checkpoint_path(tmp_path, 1))
    assert find_latest(tmp_path, warn=False) is None and len(recwarn) == 0


# -- describe, h5ls, inspect -----------------------------------------------------------------------
def _described_state():
    rng = np.random.default_rng(7)
    return (
        {"conv.weight": rng.standard_normal((8, 3, 3)).astype(np.float32), "bn.num_batches_tracked": np.array(5, np.int64)},
        {
            "algorithm": {"algorithm": "sgd", "steps": 3, "arrays": {"momentum_buffer": rng.standard_normal(1000), "none": None}},
            "params": rng.standard_normal(1000).astype(np.float32),
            "z": np.array([3 + 4j, 1j]),
            "flags": np.array([True, True, False]),
            "blob": b"\x03\x04",
        },
    )


def _norm(x):
    return float(np.linalg.norm(np.abs(np.asarray(x)).astype(np.float64).ravel()))


def test_describe_lists_layout_shapes_dtypes_and_norms(tmp_path, comm, monkeypatch):
    model, state = _described_state()
    path = save_one(tmp_path / "d.h5", comm, state, model=model, attrs={"step": 3})
    monkeypatch.setattr(summary_module, "_BLOCK", 50)  # norms accumulate over several reads
    desc = describe(path)
    assert desc["problem"] is None and desc["attrs"]["step"] == 3 and desc["path"] == path
    datasets = {e["path"]: e for e in desc["layout"] if e["kind"] == "dataset"}
    expected = {
        "/model/conv.weight": model["conv.weight"],
        "/model/bn.num_batches_tracked": model["bn.num_batches_tracked"],
        "/ranks/0/algorithm/arrays/momentum_buffer": state["algorithm"]["arrays"]["momentum_buffer"],
        "/ranks/0/params": state["params"],
        "/ranks/0/z": state["z"],
        "/ranks/0/flags": state["flags"],
        "/ranks/0/blob": np.frombuffer(state["blob"], np.uint8),
    }
    assert set(datasets) == set(expected)
    for name, array in expected.items():
        entry = datasets[name]
        assert entry["shape"] == list(array.shape) and entry["dtype"] == str(array.dtype), name
        assert entry["norm"] == pytest.approx(_norm(array), rel=1e-12), name
    assert datasets["/ranks/0/z"]["norm"] == pytest.approx(np.sqrt(26.0))
    assert datasets["/ranks/0/blob"]["type"] == "bytes" and datasets["/ranks/0/params"]["type"] is None
    groups = {e["path"]: e["attrs"] for e in desc["layout"] if e["kind"] == "group"}
    assert groups["/ranks/0/algorithm"] == {"algorithm": "sgd", "steps": 3}
    assert groups["/ranks/0/algorithm/arrays"] == {"none": None}

    text = format_description(desc)
    assert "status: valid" in text and "step = 3" in text and "@algorithm = \"sgd\"" in text
    line = next(l for l in text.splitlines() if l.strip().startswith("conv.weight"))
    assert "float32" in line and "(8, 3, 3)" in line and f"norm {_norm(model['conv.weight']):.6e}" in line
    assert text.index("model/") < text.index("conv.weight") < text.index("ranks/")


def test_describe_reports_non_finite_norms_in_json_friendly_words(tmp_path, comm):
    path = save_one(tmp_path / "nan.h5", comm, {"bad": np.array([1.0, np.nan]), "big": np.array([np.inf])})
    datasets = {e["path"]: e for e in describe(path)["layout"] if e["kind"] == "dataset"}
    assert datasets["/ranks/0/bad"]["norm"] == "nan" and datasets["/ranks/0/big"]["norm"] == "inf"


def _layout_by_walking(path):
    found = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: found.append(("/" + name, "group" if isinstance(item, h5py.Group) else "dataset")))
    return sorted(found)


def test_the_file_has_the_documented_layout(tmp_path, comm):
    model, state = _described_state()
    path = save_one(tmp_path / "l.h5", comm, state, model=model)
    assert _layout_by_walking(path) == sorted(
        [
            ("/model", "group"),
            ("/model/bn.num_batches_tracked", "dataset"),
            ("/model/conv.weight", "dataset"),
            ("/ranks", "group"),
            ("/ranks/0", "group"),
            ("/ranks/0/algorithm", "group"),
            ("/ranks/0/algorithm/arrays", "group"),
            ("/ranks/0/algorithm/arrays/momentum_buffer", "dataset"),
            ("/ranks/0/blob", "dataset"),
            ("/ranks/0/flags", "dataset"),
            ("/ranks/0/params", "dataset"),
            ("/ranks/0/z", "dataset"),
        ]
    )
    with h5py.File(path, "r") as f:  # scalars and None are attributes of their group
        assert f["ranks/0/algorithm"].attrs["steps"] == 3 and isinstance(f["ranks/0/algorithm/arrays"].attrs["none"], h5py.Empty)
        assert f["ranks/0/blob"].attrs["mpiopt_type"] == "bytes"


def test_h5ls_lists_the_documented_layout(tmp_path, comm):
    h5ls = shutil.which("h5ls")
    if h5ls is None:
        pytest.skip("no h5ls binary (h5py's wheels do not ship the HDF5 tools); the layout is checked by walking the file in test_the_file_has_the_documented_layout")
    model, state = _described_state()
    path = save_one(tmp_path / "l.h5", comm, state, model=model)
    out = subprocess.run([h5ls, "-r", path], capture_output=True, text=True, check=True).stdout
    listed = sorted((line.split()[0], line.split()[1].lower()) for line in out.splitlines() if line.strip() and line.split()[0] != "/")
    assert listed == _layout_by_walking(path)


def _inspect(*argv):
    parser = argparse.ArgumentParser()
    inspect_cli.add_arguments(parser)
    return inspect_cli.run(parser.parse_args(list(argv)))


def test_inspect_prints_text_and_json(tmp_path, comm, capsys):
    model, state = _described_state()
    path = save_one(tmp_path / "i.h5", comm, state, model=model, attrs={"step": 3})
    assert _inspect(path) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"checkpoint {path}\nstatus: valid") and "conv.weight" in text
    assert _inspect(path, "--json") == 0
    parsed = json.loads(capsys.readouterr().out)
    assert parsed == json.loads(json.dumps(describe(path)))
    assert {e["path"] for e in parsed["layout"]} >= {"/model/conv.weight", "/ranks/0/params"}


def test_inspect_says_what_is_wrong(tmp_path, comm, capsys):
    path = save_one(tmp_path / "i.h5", comm)
    _incomplete(path)
    assert _inspect(path) == 1
    assert "status: INVALID: incomplete" in capsys.readouterr().out
    _random_bytes(path)
    assert _inspect(path, "--json") == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"mpiopt inspect: cannot read checkpoint {path}: not a readable HDF5 file")
