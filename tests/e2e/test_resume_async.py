"""``mpiopt train`` checkpoints and resume for the asynchronous algorithms (``async_msgd``, ``async_lsgd``).

A run goes in quiescent segments of ``--checkpoint-every`` steps per worker,
with a checkpoint between them.  At 3 ranks (a server, two workers) the order
of arrivals is timing's, so a resumed run is not bitwise the uninterrupted
one; it must start from exactly the saved parameters and run the counters on.
At world size 1 the runtime is deterministic, and the resume is bitwise.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mpiopt.checkpoint import first_difference
from mpiopt.metrics import read_metrics

from .test_resume import _drive, _read, _signalled_run

h5py = pytest.importorskip("h5py")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(1200)

STEPS, MIDDLE = 8, 4
ALGORITHMS = ("async_msgd", "async_lsgd")
COMMON = ["--dataset", "synthetic", "--batch-size", "16", "--steps", str(STEPS), "--eval-every", str(STEPS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each case whole (checkpoints at 4 and 8) and resumed from 4: ``{(size, algorithm): folder}``, with the outputs."""
    root = tmp_path_factory.mktemp("resume-async")
    cases = [(3, name) for name in ALGORITHMS] + [(1, "async_msgd")]

    def train(size, name, part, *more):
        return ["train", "--out", str(root / str(size) / name / part), "--algorithm", name, *COMMON, *more]

    outputs = {}
    for part in ("whole", "resumed"):
        for size in sorted({s for s, _ in cases}):
            jobs = [
                (name, train(size, name, "whole", "--checkpoint-every", str(MIDDLE)) if part == "whole" else
                 train(size, name, "resumed", "--resume", str(root / str(size) / name / "whole" / "checkpoints" / f"ckpt-{MIDDLE:09d}.h5")))
                for s, name in cases if s == size
            ]
            for name, (code, output) in _drive(size, jobs, root / "logs" / part / str(size)).items():
                assert code == 0, output
                outputs[(size, name, part)] = output
    return root, outputs


def _checkpoint(root, size, name, part, step):
    return root / str(size) / name / part / "checkpoints" / f"ckpt-{step:09d}.h5"


def _server(state) -> dict:
    return state["ranks"]["0"]["algorithm"]["server"]


def _loss_at(checkpoint, rank: int, step: int, workers: int) -> float:
    """float64 recomputation of the training loss of ``rank``'s batch ``step`` at that rank's parameters in ``checkpoint``."""
    from mpiopt.tasks.images import ShardSampler, load_dataset
    from mpiopt.tasks.models import build_model

    data = load_dataset("synthetic", seed=0)
    model = build_model("mlp", input_shape=data.input_shape, num_classes=data.num_classes, width=None, dropout=0.0).double()
    params = _read(checkpoint)["ranks"][str(rank)]["params"]
    torch.nn.utils.vector_to_parameters(torch.from_numpy(params.astype(np.float64)), model.parameters())
    sampler = ShardSampler(len(data.y_train), rank=rank - 1, world_size=workers, batch_size=16, seed=0)
    index = sampler.indices(step)
    with torch.no_grad():
        logits = model(torch.from_numpy(data.x_train[index]).double())
        return float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(data.y_train[index])))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_resumed_run_starts_from_the_saved_parameters_and_continues_the_counters(runs, name):
    root, outputs = runs
    size, workers = 3, 2
    whole = root / str(size) / name / "whole"
    assert sorted(os.listdir(whole / "checkpoints")) == [f"ckpt-{s:09d}.h5" for s in (MIDDLE, STEPS)]
    middle = _read(_checkpoint(root, size, name, "whole", MIDDLE))
    end = _read(_checkpoint(root, size, name, "whole", STEPS))
    resumed = _read(_checkpoint(root, size, name, "resumed", STEPS))
    assert f"after step {MIDDLE}" in outputs[(size, name, "resumed")]
    counter = "version" if name == "async_msgd" else "total_steps"  # updates applied / local steps of all workers
    assert _server(middle)[counter] == MIDDLE * workers
    assert _server(end)[counter] == _server(resumed)[counter] == STEPS * workers
    for state in (middle, end, resumed):  # every rank saved after the same number of steps per worker
        step = MIDDLE if state is middle else STEPS
        assert [state["ranks"][str(r)]["step"] for r in range(size)] == [step] * size
    if name == "async_msgd":
        assert list(_server(resumed)["applied"]) == [0, STEPS, STEPS] and _server(resumed)["staleness"].sum() == STEPS * workers
    else:  # every worker's own step count runs on
        assert [resumed["ranks"][str(r)]["algorithm"]["steps"] for r in (1, 2)] == [STEPS, STEPS]
    assert first_difference(middle["ranks"]["1"]["params"], resumed["ranks"]["1"]["params"]) is not None  # it trained on

    # Only steps 5..8 ran in the resumed job, and the first of them from exactly the saved parameters: rank 1's loss
    # of step 5 (its batch 4, the step numbers running on) is the loss at the checkpoint's parameters, as in the
    # uninterrupted job, whose second segment also started there.
    steps = read_metrics(root / str(size) / name / "resumed" / "metrics.jsonl").steps
    assert [r["step"] for r in steps] == list(range(MIDDLE + 1, STEPS + 1))
    expect = _loss_at(_checkpoint(root, size, name, "whole", MIDDLE), 1, MIDDLE, workers)
    first = steps[0]["loss"]
    whole_first = next(r["loss"] for r in read_metrics(whole / "metrics.jsonl").steps if r["step"] == MIDDLE + 1)
    assert abs(first - expect) < 1e-5 * abs(expect) and abs(whole_first - expect) < 1e-5 * abs(expect)
    assert abs(_loss_at(_checkpoint(root, size, name, "whole", MIDDLE), 1, 0, workers) - expect) > 1e-4  # batch 4, not 0


def test_whole_job_records_every_step_and_the_totals_of_both_segments(runs):
    root, _ = runs
    run = read_metrics(root / "3" / "async_msgd" / "whole" / "metrics.jsonl")
    assert [r["step"] for r in run.steps] == list(range(1, STEPS + 1))
    assert run.end["bytes_sent_total"] == sum(r["bytes_sent"] for r in run.steps)
    assert run.end["result"]["start_version"] == 0 and run.end["result"]["version"] == STEPS * 2
    walls = [r["wall_seconds"] for r in run.steps]
    assert walls == sorted(walls) and run.end["wall_seconds"] == walls[-1]


def test_at_world_size_1_the_resumed_run_ends_bitwise_equal_to_the_uninterrupted_one(runs):
    root, _ = runs
    whole = _read(_checkpoint(root, 1, "async_msgd", "whole", STEPS))
    resumed = _read(_checkpoint(root, 1, "async_msgd", "resumed", STEPS))
    assert first_difference(whole, resumed) is None
    assert _server(whole)["version"] == STEPS
    middle = _read(_checkpoint(root, 1, "async_msgd", "whole", MIDDLE))
    assert first_difference(middle["ranks"], whole["ranks"]) is not None  # not two copies of step 4
    losses = [[r["loss"] for r in read_metrics(root / "1" / "async_msgd" / part / "metrics.jsonl").steps] for part in ("whole", "resumed")]
    assert losses[0][MIDDLE:] == losses[1]


def test_sigusr1_on_a_worker_checkpoints_at_the_segment_boundary_and_exits_75(tmp_path):
    out = tmp_path / "signalled"
    code, output = _signalled_run(3, out, ["--algorithm", "async_msgd", "--checkpoint-every", "2"])
    assert code == 75, output
    assert "SIGUSR1" in output
    newest = max(os.listdir(out / "checkpoints"))
    step = int(newest[len("ckpt-"):-len(".h5")])
    assert step % 2 == 0 and step < 1000000  # at a segment boundary
    state = _read(out / "checkpoints" / newest)
    assert _server(state)["version"] == 2 * step
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl").steps] == list(range(1, step + 1))
