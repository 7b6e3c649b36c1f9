"""Checkpoints written with parallel HDF5 (h5py's ``mpio`` driver): exact round trip, the same file as the
serial hand-over writes, and a failure on one rank that leaves nothing behind.

Most tests need h5py built with MPI; the project's own environment has none (they are skipped there), so
``tools/parallel_hdf5.sh`` builds one and runs this file at 2 and 4 ranks.  The writer choice checks run
everywhere."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from test_checkpoint import raised_alike, rank_state

from mpiopt.checkpoint import checkpoint_path, first_difference, load_checkpoint, save_checkpoint, validate_checkpoint
from mpiopt.checkpoint.writers import DRIVER_ENV

pytestmark = pytest.mark.mpi

PARALLEL = bool(h5py.get_config().mpi)
needs_parallel = pytest.mark.skipif(not PARALLEL, reason="h5py is built without parallel HDF5 (tools/parallel_hdf5.sh builds one)")
# Root attributes that differ between any two saves.
PER_FILE = {"id", "created"}


def model() -> dict:
    return {"layer.0.weight": np.arange(12, dtype=np.float32).reshape(4, 3) / 7, "layer.0.bias": np.array([-0.0, np.nan, 1e-30])}


def save(monkeypatch, driver: str, path: str, world, rank: int, **kwargs):
    monkeypatch.setenv(DRIVER_ENV, driver)
    kwargs.setdefault("model", model())
    kwargs.setdefault("rank_state", rank_state(rank))
    kwargs.setdefault("attrs", {"step": 3, "config": {"lr": 0.1, "layers": [4, 3]}})
    return save_checkpoint(path, world, **kwargs)


def contents(path: str) -> dict:
    """Every object in the file (``"/"`` and names like ``"ranks/0/params"``), opened without MPI: kind, dtype, shape, raw bytes, attributes."""
    found = {}

    def attrs(obj):
        return {k: repr(v) for k, v in obj.attrs.items() if not (obj.name == "/" and k in PER_FILE)}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            found[name] = ("dataset", obj.dtype.str, obj.shape, np.asarray(obj[()]).tobytes(), attrs(obj))
        else:
            found[name] = ("group", attrs(obj))

    with h5py.File(path, "r") as f:
        found["/"] = ("group", attrs(f))
        f.visititems(visit)
    return found


@needs_parallel
def test_round_trip_with_mpio_is_exact_and_sends_no_state(topology, shared_dir, monkeypatch):
    world, rank = topology.world, topology.rank
    path = checkpoint_path(shared_dir, 3)
    before = world.ledger.snapshot()
    # The model given on other ranks is ignored, as with the serial writer.
    save(monkeypatch, "mpio", path, world, rank, model=model() if rank == 0 else {"wrong": np.zeros(2)})
    # Each rank wrote its own arrays: no point-to-point hand-over to rank 0.
    assert not any(op.endswith(("Send", "Recv")) for op in world.ledger.since(before))
    assert validate_checkpoint(path) is None
    loaded = load_checkpoint(path, world)
    assert first_difference(rank_state(rank), loaded.rank_state) is None
    assert first_difference(model(), loaded.model, "model") is None
    assert loaded.world_size == topology.size and loaded.attrs["step"] == 3 and loaded.attrs["config"] == {"lr": 0.1, "layers": [4, 3]}
    assert sorted(os.listdir(shared_dir)) == [os.path.basename(path)]  # no temporary file left


@needs_parallel
def test_mpio_and_serial_write_the_same_file(topology, shared_dir, monkeypatch):
    world, rank = topology.world, topology.rank
    parallel, serial = os.path.join(shared_dir, "mpio.h5"), os.path.join(shared_dir, "serial.h5")
    save(monkeypatch, "mpio", parallel, world, rank)
    save(monkeypatch, "serial", serial, world, rank)
    same = None
    if rank == 0:
        a, b = contents(parallel), contents(serial)
        same = a == b and f"ranks/{topology.size - 1}/params" in a and "model/layer.0.bias" in a
    assert world.bcast_obj(same) is True
    # Without a model, no /model group in either.
    save(monkeypatch, "mpio", parallel, world, rank, model=None)
    assert load_checkpoint(parallel, world).model is None


@needs_parallel
def test_a_write_failing_on_the_last_rank_leaves_no_file(topology, shared_dir, monkeypatch):
    world, rank, last = topology.world, topology.rank, topology.size - 1
    path = checkpoint_path(shared_dir, 5)
    save(monkeypatch, "mpio", path, world, rank, model=None, rank_state={"v": np.full(10, rank)}, attrs={"step": 5})
    before = open(path, "rb").read() if rank == 0 else None
    if rank == last:  # the disk fills up while this rank writes its arrays
        def full_disk(dataset, key, value):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(h5py.Dataset, "__setitem__", full_disk)
    message = raised_alike(save, monkeypatch, "mpio", path, world, rank, model=None, rank_state={"v": np.zeros(10)}, attrs={"step": 6})
    which = "" if topology.size == 1 else f"\n  rank {last}:"
    assert message == f"cannot save checkpoint {path}:{which} OSError: [Errno 28] No space left on device"
    monkeypatch.undo()
    if rank == 0:  # the old checkpoint untouched, no temporary file left
        assert open(path, "rb").read() == before and os.listdir(shared_dir) == [os.path.basename(path)]
    loaded = load_checkpoint(path, world)
    assert loaded.attrs["step"] == 5 and np.array_equal(loaded.rank_state["v"], np.full(10, rank))


@needs_parallel
def test_bad_state_on_the_last_rank_stops_mpio_before_a_file_exists(topology, shared_dir, monkeypatch):
    last = topology.size - 1
    state = {"ok": np.ones(3), "bad": {1, 2}} if topology.rank == last else {"ok": np.ones(3)}
    path = checkpoint_path(shared_dir, 1)
    message = raised_alike(save, monkeypatch, "mpio", path, topology.world, topology.rank, rank_state=state)
    assert "rank_state['bad']: cannot store a set" in message
    assert os.listdir(shared_dir) == []


@needs_parallel
@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_on_the_writer_are_refused(topology, shared_dir, monkeypatch):
    driver = "serial" if topology.rank == 0 else "mpio"
    message = raised_alike(save, monkeypatch, driver, checkpoint_path(shared_dir, 1), topology.world, topology.rank)
    assert f"ranks disagree on the writer ({DRIVER_ENV}): rank 0: serial, rank 1: mpio" in message
    assert os.listdir(shared_dir) == []


@pytest.mark.skipif(PARALLEL, reason="h5py here has parallel HDF5")
def test_mpio_is_refused_without_parallel_hdf5(topology, shared_dir, monkeypatch):
    message = raised_alike(save, monkeypatch, "mpio", checkpoint_path(shared_dir, 1), topology.world, topology.rank)
    assert message.endswith(f"{DRIVER_ENV}=mpio needs h5py built with parallel HDF5 (h5py.get_config().mpi is False)")
    assert os.listdir(shared_dir) == []


def test_an_unknown_writer_is_refused(topology, shared_dir, monkeypatch):
    message = raised_alike(save, monkeypatch, "posix", checkpoint_path(shared_dir, 1), topology.world, topology.rank)
    assert message.endswith(f"{DRIVER_ENV} must be 'mpio' or 'serial', got 'posix'")
