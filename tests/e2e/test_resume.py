"""``mpiopt train`` checkpoints end to end: exact resume, refusals, ``--resume auto``, and stop signals (2 ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mpiopt.checkpoint import first_difference
from mpiopt.metrics import read_metrics

from .launch import ROOT, mpiexec, run_mpi

h5py = pytest.importorskip("h5py")
pytest.importorskip("torch")

from mpiopt.checkpoint.layout import read_group  # noqa: E402  (needs h5py)

TINY = ["-m", "mpiopt", "train", "--dataset", "synthetic", "--batch-size", "16"]


def _read(path) -> dict:
    """A checkpoint's model and every rank's state, read in this one process."""
    with h5py.File(path, "r") as f:
        return {"model": read_group(f["model"]), "ranks": read_group(f["ranks"])}


def _train(out, *args, timeout=180):
    code, output, _ = run_mpi(2, [*TINY, "--out", str(out), *args], timeout=timeout)
    return code, output


# dasgd: averages start at steps 3 and 6 (period 3) and merge one step later: one is in flight at step 3.
CASES = {
    "sgd": [],
    "lsgd": ["--group-size", "1"],
    "dasgd": ["--hp", "period=3", "--hp", "delay_steps=1"],
    "topk": [],
    "signum": [],
}


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_resumed_run_ends_bitwise_equal_to_the_uninterrupted_one(tmp_path, algorithm):
    common = ["--algorithm", algorithm, *CASES[algorithm], "--steps", "7", "--checkpoint-every", "3", "--keep-checkpoints", "5"]
    code, output = _train(tmp_path / "whole", *common)
    assert code == 0, output
    whole = tmp_path / "whole" / "checkpoints"
    assert sorted(os.listdir(whole)) == [f"ckpt-00000000{s}.h5" for s in (3, 6, 7)]
    middle = _read(whole / "ckpt-000000003.h5")
    if algorithm == "dasgd":
        assert all(middle["ranks"][r]["algorithm"]["scalars"]["merge_step"] == 4 for r in "01"), "no averaging in flight at step 3"
    code, output = _train(tmp_path / "resumed", *common, "--resume", str(whole / "ckpt-000000003.h5"))
    assert code == 0, output
    assert "resuming from" in output and "after step 3" in output
    # Only steps 4..7 ran in the second job: equality below needs every piece of state restored.
    assert [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl").steps] == [4, 5, 6, 7]
    a, b = _read(whole / "ckpt-000000007.h5"), _read(tmp_path / "resumed" / "checkpoints" / "ckpt-000000007.h5")
    assert first_difference(a, b) is None
    # ...and the state did move after the checkpoint (the comparison is not of two copies of step 3).
    assert first_difference(middle["ranks"], a["ranks"]) is not None
    with h5py.File(whole / "ckpt-000000007.h5", "r") as f:
        assert f.attrs["step"] == 7 and f.attrs["algorithm"] == algorithm and f.attrs["world_size"] == 2


def test_resume_with_another_algorithm_is_refused_naming_both(tmp_path):
    code, output = _train(tmp_path / "a", "--algorithm", "sgd", "--steps", "2", "--checkpoint-every", "2")
    assert code == 0, output
    ckpt = tmp_path / "a" / "checkpoints" / "ckpt-000000002.h5"
    code, output = _train(tmp_path / "b", "--algorithm", "signum", "--steps", "4", "--resume", str(ckpt))
    assert code != 0
    message = [line for line in output.splitlines() if "error:" in line]
    assert len(message) == 1, output
    assert "algorithm is 'sgd', this run's 'signum'" in message[0]
    assert not (tmp_path / "b" / "checkpoints").exists()


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


def test_async_algorithms_refuse_checkpoints_for_now(tmp_path):
    code, output = _train(tmp_path / "a", "--algorithm", "async_msgd", "--steps", "2", "--checkpoint-every", "1")
    assert code != 0 and "not supported yet" in output and "async_msgd" in output


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


def test_sigusr1_on_one_rank_checkpoints_every_rank_and_exits_75_then_resume_continues_bitwise(tmp_path):
    out = tmp_path / "signalled"
    common = ["--algorithm", "lsgd", "--eval-every", "1000000", "--checkpoint-every", "100000"]
    proc = subprocess.Popen(
        [mpiexec(), "-n", "2", sys.executable, *TINY, "--out", str(out), "--steps", "1000000", *common],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        metrics = out / "metrics.jsonl"
        for _ in range(1200):  # training has started once a step is recorded
            if metrics.exists() and '"kind": "step"' in metrics.read_text():
                break
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.1)
        pids = _rank_pids(str(out))
        assert len(pids) == 2, pids
        os.kill(pids[-1], signal.SIGUSR1)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, output
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
