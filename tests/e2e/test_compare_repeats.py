"""``mpiopt compare --repeats``: each algorithm trained N times with seeds seed, seed+1, ...; medians and ranges in the table."""

from __future__ import annotations

import json

import pytest

from mpiopt.metrics import read_metrics

from .launch import run_mpi

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

# What these tests check does not depend on the MPI library: CI runs them under MPICH only (.ci/run).
pytestmark = pytest.mark.one_mpi

TINY = ["--dataset", "synthetic", "--steps", "6", "--eval-every", "3", "--batch-size", "16"]


def test_compare_repeats_trains_each_seed_and_tables_medians_with_ranges(tmp_path):
    out = tmp_path / "cmp"
    code, output, _ = run_mpi(
        2, ["-m", "mpiopt", "compare", "--algorithms", "sgd,lsgd", *TINY, "--seed", "5", "--repeats", "2", "--out", str(out)], timeout=240
    )
    assert code == 0, output
    table = (out / "results.md").read_text()
    assert "2 repeats per algorithm (seeds 5-6): median (min-max)" in table
    assert "| algorithm | repeats | final accuracy |" in table
    for name in ("sgd", "lsgd"):
        seeds = [read_metrics(out / name / f"run{k}" / "metrics.jsonl").header["config"]["seed"] for k in (1, 2)]
        assert seeds == [5, 6]
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert row.startswith(f"| {name} | 2 | ") and " s (" in row  # wall time's median, then its range
    assert not (out / "sgd" / "metrics.jsonl").exists()
    assert all((out / f).stat().st_size > 1000 for f in ("accuracy.png", "loss.png"))  # median lines, ranges shaded
    redrawn = tmp_path / "redrawn"
    code, output, _ = run_mpi(1, ["-m", "mpiopt", "plot", str(out), "--out", str(redrawn)], timeout=120)
    assert code == 0, output
    assert "| sgd | 2 | " in (redrawn / "results.md").read_text()


def test_compare_repeats_below_one_is_refused(tmp_path):
    code, output, _ = run_mpi(1, ["-m", "mpiopt", "compare", "--algorithms", "sgd", *TINY, "--repeats", "0", "--out", str(tmp_path / "x")], timeout=60)
    assert code != 0 and "--repeats must be an integer >= 1, got 0" in output


def test_compare_sweep_picks_the_lowest_test_loss_and_the_main_runs_use_it(tmp_path):
    out = tmp_path / "swept"
    code, output, _ = run_mpi(
        2,
        ["-m", "mpiopt", "compare", "--algorithms", "sgd,lsgd", *TINY, "--repeats", "2", "--sweep", "lr=0.001,0.1",
         "--sweep", "lsgd.period=2,4", "--sweep-steps", "3", "--out", str(out)],
        timeout=300,
    )
    assert code == 0, output
    record = json.loads((out / "sweep.json").read_text())
    assert record["steps"] == 3
    assert [c["values"] for c in record["candidates"]["sgd"]] == [{"lr": 0.001}, {"lr": 0.1}]
    assert len(record["candidates"]["lsgd"]) == 4  # the grid: 2 rates x 2 periods
    for name in ("sgd", "lsgd"):
        candidates = record["candidates"][name]
        assert all(isinstance(c["score"], float) for c in candidates)
        best = min(candidates, key=lambda c: c["score"])
        assert record["chosen"][name] == best["values"]
        for k in (1, 2):
            hyper = read_metrics(out / name / f"run{k}" / "metrics.jsonl").header["config"]["hyperparameters"]
            for key, value in best["values"].items():
                assert hyper[key] == value  # the resolved hyperparameters the run used
    results = (out / "results.md").read_text()
    assert "## sweep: 3 steps per candidate" in results and "- sgd: chose lr=" in results


def test_a_sweeps_candidate_is_evaluated_once_and_scores_what_the_same_run_evaluated_every_few_steps_ends_at(tmp_path):
    """Evaluating changes no bit of a synchronous run: a candidate evaluated only at its end (the sweep's) has the same
    step losses and last test loss as the main run at its point, which is evaluated every 3 steps."""
    out = tmp_path / "once"
    code, output, _ = run_mpi(
        2, ["-m", "mpiopt", "compare", "--algorithms", "sgd,diloco", *TINY, "--sweep", "lr=0.05", "--sweep", "diloco.period=2",
            "--sweep-steps", "6", "--out", str(out)], timeout=300,
    )
    assert code == 0, output
    record = json.loads((out / "sweep.json").read_text())
    for name in ("sgd", "diloco"):
        (candidate,) = record["candidates"][name]
        tuned, main = read_metrics(candidate["metrics"]), read_metrics(out / name / "metrics.jsonl")
        assert [e["step"] for e in tuned.evals] == [6] and [e["step"] for e in main.evals] == [3, 6]
        assert [r["loss"] for r in tuned.steps] == [r["loss"] for r in main.steps] and len(main.steps) == 6
        assert candidate["score"] == main.evals[-1]["test_loss"], name


@pytest.mark.parametrize(
    "sweep, message",
    [
        ("momentum=0.5,1.5", "--sweep momentum=1.5: sgd: momentum must be in [0.0, 1.0), got 1.5"),
        ("lsgd.pull_locl=0.1", "--sweep pull_locl=0.1: lsgd has no hyperparameter 'pull_locl'"),
        ("signum.momentum=0.5", "'signum' is not one of --algorithms"),
        ("lr", "--sweep takes KEY=V1,V2,..."),
        ("lr=0.1 --sweep-steps 0", "--sweep needs --sweep-steps N >= 1"),
    ],
)
def test_compare_bad_sweep_fails_before_any_training(tmp_path, sweep, message):
    code, output, _ = run_mpi(
        1, ["-m", "mpiopt", "compare", "--algorithms", "sgd,lsgd", *TINY, "--sweep", *sweep.split(" "), "--out", str(tmp_path / "x")], timeout=60
    )
    assert code != 0 and message in output, output
    assert "step" not in output.split(message)[0].lower().replace("steps", "") and not (tmp_path / "x").exists()


@pytest.mark.parametrize("algorithm", ["async_msgd", "async_lsgd"])
def test_asynchronous_runs_are_evaluated_every_eval_every_steps(tmp_path, algorithm):
    out = tmp_path / algorithm
    code, output, _ = run_mpi(
        3, ["-m", "mpiopt", "train", "--algorithm", algorithm, "--dataset", "synthetic", "--steps", "12", "--eval-every", "4",
            "--batch-size", "16", "--out", str(out)], timeout=180,
    )
    assert code == 0, output
    run = read_metrics(out / "metrics.jsonl")
    assert [e["step"] for e in run.evals] == [4, 8, 12]
    assert all(0 <= e["test_accuracy"] <= 1 for e in run.evals)
    walls = [e["wall_seconds"] for e in run.evals]
    assert walls == sorted(walls)
