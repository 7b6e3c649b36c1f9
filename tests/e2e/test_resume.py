"""``mpiopt train`` checkpoints end to end: exact resume, refusals, ``--resume auto``, and stop signals (2 ranks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mpiopt.checkpoint import first_difference
from mpiopt.metrics import read_metrics

from .launch import CLI_DRIVER as DRIVER, ROOT, mpiexec, run_mpi

h5py = pytest.importorskip("h5py")
pytest.importorskip("torch")

from mpiopt.checkpoint.layout import read_group  # noqa: E402  (needs h5py)

# The first test to use the ``runs`` fixture waits for its four jobs: 10.5 to 18 minutes on 2 cores shared at a load of 14 to 26.
pytestmark = pytest.mark.timeout(1200)

TINY = ["-m", "mpiopt", "train", "--dataset", "synthetic", "--batch-size", "16"]


def _read(path) -> dict:
    """A checkpoint's model and every rank's state, read in this one process."""
    with h5py.File(path, "r") as f:
        return {"model": read_group(f["model"]), "ranks": read_group(f["ranks"])}


def _train(out, *args, timeout=180):
    code, output, _ = run_mpi(2, [*TINY, "--out", str(out), *args], timeout=timeout)
    return code, output


# Every synchronous algorithm and variant at 2 and 4 ranks, 6 steps with a checkpoint after step 3.  Each world
# size runs all its cases through ``mpiopt train`` inside one mpiexec job (the CLI's main() once per case), and all
# the resumed runs in a second: two process start-ups per world size instead of two per case.
SIZES = (2, 4)
STEPS, MIDDLE = 6, 3
SMALL = ["--batch-size", "8", "--width", "8", "--dropout", "0.2", "--eval-every", str(STEPS), "--keep-checkpoints", "5"]


ADAMW = ["--optimizer", "adamw", "--hp", "adamw.betas=0.9,0.95", "--hp", "adamw.weight_decay=0.05", "--no-decay-on", "bias",
         "--clip-grad-norm", "0.5", "--warmup-steps", "2"]


def variants(size: int) -> dict:
    """Case name -> the flags of ``mpiopt train`` that make it (dropout, data order and the sizes are common)."""
    groups, half = ["--group-size", str(size)], ["--group-size", str(size // 2)]
    lsgd = ["--algorithm", "lsgd", "--hp", "period=1", "--hp", "global_period=2", "--hp", "proximal=0.1"]
    streaming = ["--algorithm", "streaming_diloco", "--hp", "period=4", "--hp", "fragments=2", "--hp", "overlap_steps=2"]
    return {
        "sgd": ["--algorithm", "sgd"],
        "easgd": ["--algorithm", "easgd", "--hp", "period=2"],
        "lsgd-single-leader": [*lsgd, *groups],
        "lsgd-multi-leader": [*lsgd, *half],
        # averages start after steps 3 and 6 (period 3) and merge one step later: one is in flight at the checkpoint
        "dasgd": ["--algorithm", "dasgd", "--hp", "period=3", "--hp", "delay_steps=1"],
        "signum-allgather": ["--algorithm", "signum", "--hp", "exchange=allgather"],
        "signum-twophase": ["--algorithm", "signum", "--hp", "exchange=twophase"],
        "signum-prevote": ["--algorithm", "signum", "--hp", "exchange=prevote", *half],
        "topk": ["--algorithm", "topk"],
        "regtopk": ["--algorithm", "regtopk"],
        # outer steps after steps 2, 4, 6: the checkpoint at step 3 falls between two, with theta_start and outer momentum set
        "diloco": ["--algorithm", "diloco", "--hp", "period=2"],
        # fragment 1 (offset 2) starts after step 2 and merges after step 4: in flight at the checkpoint after step 3
        "streaming_diloco": streaming,
        # every algorithm that takes one, over AdamW with two groups, clipping and a warm-up schedule
        **{f"{name}-adamw": [*flags, *ADAMW] for name, flags in (
            ("sgd", ["--algorithm", "sgd"]), ("easgd", ["--algorithm", "easgd", "--hp", "period=2"]), ("lsgd", [*lsgd, *half]),
            ("dasgd", ["--algorithm", "dasgd", "--hp", "period=3"]), ("topk", ["--algorithm", "topk"]),
            ("regtopk", ["--algorithm", "regtopk"]), ("diloco", ["--algorithm", "diloco", "--hp", "period=2"]),
            ("streaming_diloco", streaming),
        )},
    }


CASES = [(size, name) for size in SIZES for name in variants(size)] + [(2, "cnn-cifar10-augment")]



def _write_cifar10(directory, train=64, test=16) -> None:
    """A tiny CIFAR-10 in the binary format: records of a label byte and 3072 pixel bytes."""
    rng = np.random.default_rng(5)
    directory.mkdir(parents=True)
    files = [(f"data_batch_{i}.bin", train // 5 + (i <= train % 5)) for i in range(1, 6)] + [("test_batch.bin", test)]
    for name, count in files:
        labels = rng.integers(0, 10, size=(count, 1), dtype=np.uint8)
        (directory / name).write_bytes(np.hstack([labels, rng.integers(0, 256, size=(count, 3072), dtype=np.uint8)]).tobytes())


def _drive(size: int, runs: list, logs) -> dict:
    """Run ``[(name, argv)]`` in one ``size``-rank job; each name's exit code and rank 0's output."""
    logs.mkdir(parents=True, exist_ok=True)
    code, output, _ = run_mpi(size, ["-c", DRIVER, json.dumps(runs), str(logs)], timeout=900)
    assert code == 0, output
    codes = json.loads((logs / "codes.json").read_text())
    return {name: (codes[name], (logs / f"{name}.0.log").read_text()) for name, _ in runs}


# What the tests of this fixture check, mpiopt's checkpoint and its resize rules, is the same whichever MPI wrote and
# read it: they are marked one_mpi, and CI's second MPI skips the fixture's four jobs.  A resume under both MPIs stays
# checked by the stop signal's below, tests/e2e/test_islands_resume.py and the survival tests' (Open MPI).
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case whole and resumed; resumes on another world size; refusals.  {(size, name, part): (code, output)}."""
    root = tmp_path_factory.mktemp("resume")
    _write_cifar10(root / "cifar10")
    cifar = ["--dataset", "cifar10", "--data-dir", str(root / "cifar10"), "--model", "cnn", "--width", "4", "--augment"]

    def flags(size, name):
        every = [*SMALL, "--checkpoint-every", str(MIDDLE)]
        if name == "cnn-cifar10-augment":
            return [*every, *cifar, *variants(2)["lsgd-multi-leader"]]
        return ["--dataset", "synthetic", *every, *variants(size)[name]]

    def train(size, name, part, *more):
        return ["train", "--out", str(root / str(size) / name / part), "--steps", str(STEPS), *flags(size, name), *more]

    def middle(size, name):
        return str(root / str(size) / name / "whole" / "checkpoints" / f"ckpt-{MIDDLE:09d}.h5")

    results = {}
    for size in SIZES:
        whole = [(name, train(size, name, "whole")) for s, name in CASES if s == size]
        results.update({(size, n, "whole"): r for n, r in _drive(size, whole, root / "logs" / str(size) / "whole").items()})
    for size in SIZES:
        other = SIZES[1 - SIZES.index(size)]
        resumed = [(name, train(size, name, "resumed", "--resume", middle(size, name))) for s, name in CASES if s == size]
        resumed += [
            # another world size: sgd and signum (per-rank momentum) by their rules, easgd with neither alpha nor beta kept;
            # diloco over AdamW, whose ranks' inner states differ, moves each one with its rank's parameters
            (f"from-{other}-{name}", train(size, name, f"from-{other}", "--resume", middle(other, name)))
            for name in ("sgd", "signum-allgather", "sgd-adamw", "diloco", "diloco-adamw")
        ]
        if size == 2:
            resumed += [
                ("refuse-algorithm", train(size, "signum-allgather", "refused", "--resume", middle(size, "sgd"))),
                ("refuse-easgd-rates", train(size, "easgd", "refused", "--hp", "alpha=0.2", "--resume", middle(4, "easgd"))),
                ("refuse-model", train(size, "sgd", "refused-model", "--width", "16", "--resume", middle(size, "sgd"))),
                ("refuse-lr", train(size, "sgd", "refused-lr", "--lr", "0.01", "--resume", middle(size, "sgd"))),
                ("override-lr", train(size, "sgd", "override-lr", "--lr", "0.01", "--override-hyperparameters",
                                      "--resume", middle(size, "sgd"))),
                ("refuse-groups", train(size, "lsgd-single-leader", "refused-groups", "--group-size", "1",
                                        "--resume", middle(size, "lsgd-single-leader"))),
                # the inner optimizer's settings are checked like the algorithm's hyperparameters
                ("refuse-clip", train(size, "sgd-adamw", "refused-clip", "--clip-grad-norm", "1.0", "--resume", middle(size, "sgd-adamw"))),
                ("refuse-optimizer", train(size, "sgd", "refused-optimizer", "--optimizer", "adamw", "--resume", middle(size, "sgd"))),
                # a requeued job resuming in its own folder with changed settings: refused, the folder as it was
                ("refuse-in-place", train(size, "sgd-adamw", "whole", "--clip-grad-norm", "1.0", "--resume", "auto")),
            ]
        results.update({(size, n, "resumed"): r for n, r in _drive(size, resumed, root / "logs" / str(size) / "resumed").items()})
    return root, results


def _out(root, size, name, part):
    return root / str(size) / name / part


@pytest.mark.one_mpi  # see the fixture
@pytest.mark.parametrize("size,name", CASES)
def test_resumed_run_ends_bitwise_equal_to_the_uninterrupted_one(runs, size, name):
    root, results = runs
    for part in ("whole", "resumed"):
        code, output = results[(size, name, part)]
        assert code == 0, output
    assert "resuming from" in output and f"after step {MIDDLE}" in output
    whole, resumed = _out(root, size, name, "whole") / "checkpoints", _out(root, size, name, "resumed")
    assert sorted(os.listdir(whole)) == [f"ckpt-{s:09d}.h5" for s in (MIDDLE, STEPS)]
    middle = _read(whole / f"ckpt-{MIDDLE:09d}.h5")
    ranks = [str(r) for r in range(size)]
    if name == "dasgd":
        assert all(middle["ranks"][r]["algorithm"]["scalars"]["merge_step"] == MIDDLE + 1 for r in ranks), "no averaging in flight"
    if name.startswith("streaming_diloco"):
        assert all(list(middle["ranks"][r]["algorithm"]["arrays"]["merge_steps"]) == [0, MIDDLE + 1] for r in ranks), "none in flight"
    if name.startswith("lsgd"):
        assert all(middle["ranks"][r]["algorithm"]["arrays"]["leader_copy"] is not None for r in ranks)
    if name.endswith("adamw"):  # the inner optimizer's state is in the checkpoint, so the equality below covers it
        assert all(int(middle["ranks"][r]["inner"]["p0"]["step"]) == MIDDLE for r in ranks)
    # Only steps 4..6 ran in the second job: equality below needs every piece of state restored.
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl").steps] == list(range(MIDDLE + 1, STEPS + 1))
    last = f"ckpt-{STEPS:09d}.h5"
    a, b = _read(whole / last), _read(resumed / "checkpoints" / last)
    assert first_difference(a, b) is None
    # ...and the state did move after the checkpoint (the comparison is not of two copies of step 3).
    assert first_difference(middle["ranks"], a["ranks"]) is not None
    attrs = {}
    for key, path in [("whole", whole / last), ("resumed", resumed / "checkpoints" / last), ("middle", whole / f"ckpt-{MIDDLE:09d}.h5")]:
        with h5py.File(path, "r") as f:
            attrs[key] = dict(f.attrs)
    assert attrs["whole"]["step"] == STEPS and attrs["whole"]["world_size"] == size
    # The metrics' running totals continue: the resumed job's are the first job's up to step 3 plus its own.
    assert attrs["resumed"]["bytes_sent_total"] == attrs["whole"]["bytes_sent_total"] > 0
    assert attrs["resumed"]["wall_seconds"] > attrs["middle"]["wall_seconds"] > 0
    assert read_metrics(resumed / "metrics.jsonl").end["bytes_sent_total"] == attrs["whole"]["bytes_sent_total"]


@pytest.mark.one_mpi  # see the fixture
def test_dropout_and_augmentation_are_on_in_the_cases(runs):
    """The bitwise equalities above cover dropout's and augmentation's randomness only if they were in use."""
    root, _ = runs
    config = read_metrics(_out(root, 2, "cnn-cifar10-augment", "whole") / "metrics.jsonl").header["config"]
    assert config["augment"] is True and config["dropout"] == 0.2 and config["dataset"] == "cifar10"
    a = _read(_out(root, 2, "sgd", "whole") / "checkpoints" / f"ckpt-{STEPS:09d}.h5")
    # Dropout draws from each rank's torch generator: the ranks' generator states differ.
    assert first_difference(a["ranks"]["0"]["rng"], a["ranks"]["1"]["rng"]) is not None


def _adamw_continues_from(inner: dict, start: dict, steps: int, beta2: float = 0.95) -> bool:
    """Whether AdamW's state ``inner`` can be ``start`` after ``steps`` more steps (``beta2``: ADAMW's second beta).

    Each step multiplies exp_avg_sq by ``beta2`` and adds a square, so it ends at least ``beta2 ** steps`` times the
    start's, elementwise (float32 rounding allowed for).  A state that started from another rank's fails this wherever
    that rank's exp_avg_sq was the larger by more than the squares added since.
    """
    floor = beta2 ** steps * (1 - 1e-5)
    return set(inner) == set(start) and all(np.all(inner[p]["exp_avg_sq"] >= floor * start[p]["exp_avg_sq"]) for p in start)


@pytest.mark.one_mpi  # see the fixture
@pytest.mark.parametrize("size,name", [(4, "sgd"), (2, "sgd"), (4, "signum-allgather"), (2, "signum-allgather"), (4, "sgd-adamw"), (2, "sgd-adamw"),
                                       (4, "diloco"), (2, "diloco"), (4, "diloco-adamw"), (2, "diloco-adamw")])
def test_resume_on_another_world_size_moves_the_state_by_the_rule(runs, size, name):
    root, results = runs
    old = SIZES[1 - SIZES.index(size)]
    code, output = results[(size, f"from-{old}-{name}", "resumed")]
    assert code == 0, output
    assert f"written by {old} ranks, resuming on {size}" in output and f"new rank r takes old rank r % {old}'s" in output
    if name.startswith("signum"):
        assert "momentum_buffer: redistributed" in output
    resumed = _out(root, size, name, f"from-{old}")
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl").steps] == list(range(MIDDLE + 1, STEPS + 1))
    saved = _read(_out(root, old, name, "whole") / "checkpoints" / f"ckpt-{MIDDLE:09d}.h5")
    final = _read(resumed / "checkpoints" / f"ckpt-{STEPS:09d}.h5")
    assert sorted(final["ranks"], key=int) == [str(r) for r in range(size)]
    for r in range(size):
        state = final["ranks"][str(r)]
        assert state["step"] == STEPS and state["algorithm"]["world_size"] == size and state["algorithm"]["steps"] == STEPS
        # Training continued from the saved parameters: moved from them, and every rank identical (sgd, signum; diloco's
        # last step is an outer step).
        assert not np.array_equal(state["params"], saved["ranks"][str(r % old)]["params"])
        assert np.array_equal(state["params"], final["ranks"]["0"]["params"])
        if name.endswith("adamw"):  # AdamW's state came along: its step count continued
            assert int(state["inner"]["p0"]["step"]) == STEPS and int(saved["ranks"]["0"]["inner"]["p0"]["step"]) == MIDDLE
        if name == "sgd-adamw":  # it steps on the exchanged gradient: every rank's alike
            assert first_difference(state["inner"], final["ranks"]["0"]["inner"]) is None
        elif name.endswith("adamw"):  # each rank's own, from old rank r % old's
            assert _adamw_continues_from(state["inner"], saved["ranks"][str(r % old)]["inner"], STEPS - MIDDLE)
            # ...and from no other old rank's: the check tells the saved states apart
            assert not any(_adamw_continues_from(state["inner"], saved["ranks"][str(s)]["inner"], STEPS - MIDDLE)
                           for s in range(old) if s != r % old)
    if name == "diloco-adamw":  # the ranks' inner states differ, so the rule above is not met by copies of one state
        assert first_difference(final["ranks"]["1"]["inner"], final["ranks"]["0"]["inner"]) is not None


@pytest.mark.one_mpi  # see the fixture
def test_resume_with_another_algorithm_is_refused_naming_both(runs):
    root, results = runs
    code, output = results[(2, "refuse-algorithm", "resumed")]
    assert code == 2
    message = [line for line in output.splitlines() if "error:" in line]
    assert len(message) == 1, output
    assert "algorithm is 'sgd', this run's 'signum'" in message[0]
    assert not (_out(root, 2, "signum-allgather", "refused") / "checkpoints").exists()


@pytest.mark.parametrize("case,out,message", [
    ("refuse-model", "sgd/refused-model", "the checkpoint's model signature is"),
    ("refuse-lr", "sgd/refused-lr",
     "hyperparameters differ from this run's (--override-hyperparameters keeps this run's): lr: saved 0.05, here 0.01"),
    ("refuse-groups", "lsgd-single-leader/refused-groups", "the checkpoint's number of groups (--group-size) is 1, this run's 2"),
    # one setting of the inner optimizer's is named alone, not the saved and this run's whole tables
    ("refuse-clip", "sgd-adamw/refused-clip",
     "hyperparameters differ from this run's (--override-hyperparameters keeps this run's): optimizer.clip_grad_norm: saved 0.5, here 1.0"),
    # a checkpoint without an inner optimizer: its settings are missing, this run's are named
    ("refuse-optimizer", "sgd/refused-optimizer", "inner: saved nothing, here 'AdamW'; lr: saved 0.05, here 0.001; "),
])
@pytest.mark.one_mpi  # see the fixture
def test_a_resume_that_does_not_fit_is_refused_once_naming_both_values(runs, case, out, message):
    root, results = runs
    code, output = results[(2, case, "resumed")]
    assert code == 2, output
    assert [line for line in output.splitlines() if "error:" in line] == [line for line in output.splitlines() if message in line], output
    assert output.count(message) == 1, output
    if case == "refuse-clip":  # the one difference: nothing else in the line
        assert next(line for line in output.splitlines() if "error:" in line).endswith(message), output
    if case == "refuse-optimizer":
        assert "optimizer: saved nothing, here {'name': 'adamw'," in output, output
    # the settings are saved once a resume is accepted: a refused one writes nothing
    assert not (root / "2" / out / "config.toml").exists() and not (root / "2" / out / "checkpoints").exists()


@pytest.mark.one_mpi  # see the fixture
def test_a_refused_resume_in_the_runs_own_folder_leaves_its_settings_and_files_as_they_were(runs):
    root, results = runs
    code, output = results[(2, "refuse-in-place", "resumed")]
    assert code == 2, output
    assert "optimizer.clip_grad_norm: saved 0.5, here 1.0" in output, output
    whole = _out(root, 2, "sgd-adamw", "whole")
    saved = (whole / "config.toml").read_text()
    assert "clip_grad_norm = 0.5" in saved and "clip_grad_norm = 1.0" not in saved
    assert [r["step"] for r in read_metrics(whole / "metrics.jsonl").steps] == list(range(1, STEPS + 1))


@pytest.mark.one_mpi  # see the fixture
def test_override_hyperparameters_resumes_with_this_runs_values(runs):
    root, results = runs
    code, output = results[(2, "override-lr", "resumed")]
    assert code == 0, output
    lrs = {r["lr"] for r in read_metrics(_out(root, 2, "sgd", "override-lr") / "metrics.jsonl").steps}
    assert lrs == {0.01}


@pytest.mark.one_mpi  # see the fixture
def test_easgd_on_another_world_size_keeping_neither_alpha_nor_beta_is_refused(runs):
    root, results = runs
    code, output = results[(2, "refuse-easgd-rates", "resumed")]
    assert code == 2, output
    assert "hyperparameters differ from this run's" in output and "alpha: saved" in output and "beta: saved" in output
    assert not (_out(root, 2, "easgd", "refused") / "checkpoints").exists()


def test_resume_auto_skips_a_truncated_newest_checkpoint_and_says_so(tmp_path):
    out = tmp_path / "run"
    code, output = _train(out, "--algorithm", "sgd", "--steps", "4", "--checkpoint-every", "2")
    assert code == 0, output
    newest = out / "checkpoints" / "ckpt-000000004.h5"
    with open(newest, "r+b") as handle:
        handle.truncate(os.path.getsize(newest) // 2)
    code, output = _train(out, "--algorithm", "sgd", "--steps", "6", "--checkpoint-every", "2", "--resume", "auto")
    assert code == 0, output
    assert "ckpt-000000004.h5" in output  # the warning names the file skipped
    assert "ckpt-000000002.h5 after step 2" in output
    run = read_metrics(out / "metrics.jsonl")
    # Appended: a second header, and steps 3 and 4 of the first job superseded by the resumed ones.
    assert [r["step"] for r in run.steps] == [1, 2, 3, 4, 5, 6]
    assert [h["resumed_after_step"] for h in run.resumes] == [2]


def _rank_pids(marker: str) -> list:
    """Pids of this Python running ``mpiopt train`` with ``marker`` in its arguments (the ranks, not mpiexec)."""
    found = subprocess.run(["pgrep", "-f", marker], stdout=subprocess.PIPE, text=True).stdout.split()
    pids = []
    for pid in found:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if os.path.realpath(argv[0].decode()) == os.path.realpath(sys.executable) and b"mpiopt" in argv:
            pids.append(int(pid))
    return sorted(pids)


def _signalled_run(ranks: int, out, args) -> "tuple[int, str]":
    """Start ``mpiopt train`` on ``ranks`` ranks, send SIGUSR1 to the last rank's process once a step is recorded,
    and return (exit code, output)."""
    proc = subprocess.Popen(
        [mpiexec(), "-n", str(ranks), sys.executable, *TINY, "--out", str(out), "--steps", "1000000", "--eval-every", "1000000", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        metrics = out / "metrics.jsonl"
        for _ in range(1200):  # training has started once a step is recorded (for async algorithms: a segment ended)
            if metrics.exists() and '"kind": "step"' in metrics.read_text():
                break
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.1)
        pids = _rank_pids(str(out))
        assert len(pids) == ranks, pids
        os.kill(pids[-1], signal.SIGUSR1)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, output


def test_sigusr1_on_one_rank_checkpoints_every_rank_and_exits_75_then_resume_continues_bitwise(tmp_path):
    out = tmp_path / "signalled"
    common = ["--algorithm", "lsgd", "--eval-every", "1000000", "--checkpoint-every", "100000"]
    code, output = _signalled_run(2, out, ["--algorithm", "lsgd", "--checkpoint-every", "100000"])
    assert code == 75, output
    saved = os.listdir(out / "checkpoints")
    assert len(saved) == 1, saved
    step = int(saved[0][len("ckpt-"):-len(".h5")])
    assert step >= 1 and "SIGUSR1" in output
    # Resume for two more steps; a run that never stopped ends bitwise the same.
    code, resumed = _train(out, *common, "--steps", str(step + 2), "--resume", "auto")
    assert code == 0, resumed
    code, whole = _train(tmp_path / "whole", *common, "--steps", str(step + 2))
    assert code == 0, whole
    last = f"ckpt-{step + 2:09d}.h5"
    assert first_difference(_read(out / "checkpoints" / last), _read(tmp_path / "whole" / "checkpoints" / last)) is None
