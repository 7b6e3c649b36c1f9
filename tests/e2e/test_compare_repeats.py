"""``mpiopt compare --repeats``: each algorithm trained N times with seeds seed, seed+1, ...; medians and ranges in the table."""

from __future__ import annotations

import pytest

from mpiopt.metrics import read_metrics

from .launch import run_mpi

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

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
    redrawn = tmp_path / "redrawn"
    code, output, _ = run_mpi(1, ["-m", "mpiopt", "plot", str(out), "--out", str(redrawn)], timeout=120)
    assert code == 0, output
    assert "| sgd | 2 | " in (redrawn / "results.md").read_text()


def test_compare_repeats_below_one_is_refused(tmp_path):
    code, output, _ = run_mpi(1, ["-m", "mpiopt", "compare", "--algorithms", "sgd", *TINY, "--repeats", "0", "--out", str(tmp_path / "x")], timeout=60)
    assert code != 0 and "--repeats must be an integer >= 1, got 0" in output
