"""``mpiopt train --islands`` checkpoints: a bitwise resume at the same islands, and resizes to other islands.

4 ranks in 2 islands of 2 write a checkpoint after step 3 of 6; the same layout resumes it bitwise; 2 ranks in 1
island of 2 and 4 ranks in 4 islands of 1 resume it by the algorithm's rules over workers (one state per island).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpiopt.checkpoint import first_difference

from .launch import CLI_DRIVER as DRIVER, run_mpi

h5py = pytest.importorskip("h5py")
pytest.importorskip("torch")

from mpiopt.checkpoint.layout import read_group  # noqa: E402  (needs h5py)

pytestmark = pytest.mark.timeout(900)

STEPS, MIDDLE = 6, 3
ALGORITHMS = {
    # outer steps after steps 2, 4, 6: the checkpoint falls between two, the accumulators (MEAN rule) full
    "sparseloco": ["--algorithm", "sparseloco", "--hp", "period=2"],
    # per-worker momentum (FOLLOW rule)
    "signum": ["--algorithm", "signum", "--hp", "exchange=allgather"],
    # an averaging in flight at the checkpoint (started after step 3, merged after step 4)
    "dasgd": ["--algorithm", "dasgd", "--hp", "period=3", "--hp", "delay_steps=1"],
}
COMMON = ["--dataset", "synthetic", "--batch-size", "8", "--width", "8", "--steps", str(STEPS), "--eval-every", str(STEPS),
          "--checkpoint-every", str(MIDDLE), "--islands"]


def _read(path) -> dict:
    with h5py.File(path, "r") as f:
        return {"ranks": read_group(f["ranks"]), "attrs": dict(f.attrs)}


def _drive(size, runs, logs):
    logs.mkdir(parents=True, exist_ok=True)
    code, output, _ = run_mpi(size, ["-c", DRIVER, json.dumps(runs), str(logs)], timeout=600)
    assert code == 0, output
    codes = json.loads((logs / "codes.json").read_text())
    return {name: (codes[name], (logs / f"{name}.0.log").read_text()) for name, _ in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("islands")

    def train(name, part, group, *more):
        return ["train", "--out", str(root / name / part), "--group-size", str(group), *COMMON, *ALGORITHMS[name], *more]

    def middle(name):
        return str(root / name / "whole" / "checkpoints" / f"ckpt-{MIDDLE:09d}.h5")

    results = {}
    whole = [(f"{name}-whole", train(name, "whole", 2)) for name in ALGORITHMS]
    results.update(_drive(4, whole, root / "logs" / "whole"))
    four = [(f"{name}-resumed", train(name, "resumed", 2, "--resume", middle(name))) for name in ALGORITHMS]
    four += [(f"{name}-per-rank", train(name, "per-rank", 1, "--resume", middle(name))) for name in ALGORITHMS]
    results.update(_drive(4, four, root / "logs" / "four"))
    two = [(f"{name}-one-island", train(name, "one-island", 2, "--resume", middle(name))) for name in ALGORITHMS]
    results.update(_drive(2, two, root / "logs" / "two"))
    return root, results


def _final(root, name, part):
    return _read(root / name / part / "checkpoints" / f"ckpt-{STEPS:09d}.h5")


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_an_island_run_resumes_bitwise(runs, name):
    root, results = runs
    for part in ("whole", "resumed"):
        code, output = results[f"{name}-{part}"]
        assert code == 0, output
    middle = _read(root / name / "whole" / "checkpoints" / f"ckpt-{MIDDLE:09d}.h5")
    assert middle["attrs"]["workers"] == 2 and middle["attrs"]["ranks_per_worker"] == 2
    states = [middle["ranks"][str(r)]["algorithm"] for r in range(4)]
    assert [int(s["worker_layout"]["worker"]) for s in states] == [0, 0, 1, 1]
    # One state per island: its two ranks hold the same, the two islands differ.
    assert first_difference(states[0]["arrays"], states[1]["arrays"]) is None
    assert first_difference(states[2]["arrays"], states[3]["arrays"]) is None
    if name != "signum":  # between two averagings the islands' models differ (signum's workers all apply one vote)
        assert first_difference(middle["ranks"]["0"]["params"], middle["ranks"]["2"]["params"]) is not None
    if name == "dasgd":
        assert all(int(s["scalars"]["merge_step"]) == MIDDLE + 1 for s in states), "no averaging in flight"
    whole, resumed = _final(root, name, "whole"), _final(root, name, "resumed")
    assert first_difference(whole["ranks"], resumed["ranks"]) is None


@pytest.mark.parametrize("part, size, words", [("one-island", 2, "1 island of 2 ranks"), ("per-rank", 4, "4 ranks")])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_an_island_checkpoint_resumes_on_other_islands_by_the_rules_over_workers(runs, name, part, size, words):
    root, results = runs
    code, output = results[f"{name}-{part}"]
    assert code == 0, output
    assert f"written by 4 ranks as 2 islands of 2 ranks, resuming on {size} as {words}" in output
    assert "new worker w takes old worker w % 2's" in output
    saved = _read(root / name / "whole" / "checkpoints" / f"ckpt-{MIDDLE:09d}.h5")["ranks"]
    if name == "sparseloco":
        # the accumulators are owed to the mean: every new worker starts from the old islands' mean (float64 rounding)
        assert "codec_residual: redistributed, the mean over the old workers on every new worker" in output
    if name == "signum":
        assert "momentum_buffer: redistributed, new worker r takes old worker r % 2's" in output
    final = _final(root, name, part)
    layout = [final["ranks"][str(r)]["algorithm"]["worker_layout"] for r in range(size)]
    assert [int(x["workers"]) for x in layout] == [size // (2 if part == "one-island" else 1)] * size
    for r in range(size):
        state = final["ranks"][str(r)]
        assert int(state["step"]) == STEPS and int(state["algorithm"]["world_size"]) == size
    if part == "one-island":  # both ranks are one worker: the same parameters, moved on from old island 0's
        assert np.array_equal(final["ranks"]["0"]["params"], final["ranks"]["1"]["params"])
        assert not np.array_equal(final["ranks"]["0"]["params"], saved["0"]["params"])
