"""``mpiopt train --dataset text --model gpt`` end to end: bits per byte and perplexity recorded and shown; the ddp baseline takes the task too."""

from __future__ import annotations

import math

import pytest

from mpiopt.metrics import read_metrics

from .launch import run_mpi

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

# What these tests check does not depend on the MPI library: CI runs them under MPICH only (.ci/run).
pytestmark = pytest.mark.one_mpi

TEXT = ["-m", "mpiopt", "train", "--dataset", "text", "--model", "gpt", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
        "--block-size", "32", "--batch-size", "8", "--steps", "5", "--eval-every", "5", "--progress", "lines"]


@pytest.mark.parametrize("ranks, algorithm", [(1, "sgd"), (2, "ddp")])
def test_text_training_records_bits_per_byte(tmp_path, ranks, algorithm):
    out = tmp_path / "run"
    code, output, _ = run_mpi(ranks, [*TEXT, "--algorithm", algorithm, "--out", str(out)], timeout=180)
    assert code == 0, output
    run = read_metrics(out / "metrics.jsonl")
    assert run.header["task"] == "text/gpt" and [r["step"] for r in run.steps] == [1, 2, 3, 4, 5]
    (final,) = run.evals
    assert final["bits_per_byte"] == pytest.approx(final["test_loss"] / math.log(2))
    assert 0 < final["bits_per_byte"] < 8.5 and 0 <= final["test_accuracy"] <= 1
    # A language model's lines and table: its loss, in bits per byte and as a perplexity, to a target loss (default 2.5).
    assert f"bits/byte, perplexity {math.exp(final['test_loss']):7.2f})" in output, output
    header = (out / "results.md").read_text().splitlines()[2]
    assert header.startswith("| algorithm | final loss | best loss | bits per byte | perplexity |") and "time to loss 2.5" in header
    assert "accuracy" not in header


def test_a_resumed_text_run_ends_where_an_uninterrupted_one_does(tmp_path):
    """The windows are a function of (seed, rank, step): resuming at step 3 of 6 gives the same final test loss, bitwise."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = [*TEXT, "--steps", "6", "--eval-every", "6", "--checkpoint-every", "3"]
    code, output, _ = run_mpi(1, [*args, "--out", str(full)], timeout=180)
    assert code == 0, output
    checkpoint = full / "checkpoints" / "ckpt-000000003.h5"
    code, output, _ = run_mpi(1, [*args, "--resume", str(checkpoint), "--out", str(resumed)], timeout=180)
    assert code == 0, output
    assert read_metrics(resumed / "metrics.jsonl").evals[-1]["test_loss"] == read_metrics(full / "metrics.jsonl").evals[-1]["test_loss"]
