"""The ``ddp`` baseline (torch DistributedDataParallel on gloo) trained by ``mpiopt compare`` and ``train``."""

from __future__ import annotations

import argparse
import math

import pytest

from mpiopt.metrics import read_metrics
from mpiopt.training.config import UsageError
from mpiopt.training.flags import add_config_arguments, config_from_args

from .launch import run_mpi

pytest.importorskip("torch")
pytest.importorskip("matplotlib")


def test_ddp_and_sgd_compute_the_same_training_in_one_compare_job(tmp_path):
    out = tmp_path / "cmp"
    args = ["-m", "mpiopt", "compare", "--algorithms", "ddp,sgd", "--dataset", "synthetic", "--steps", "8", "--eval-every", "4",
            "--batch-size", "16", "--out", str(out)]
    code, output, _ = run_mpi(2, args, timeout=300)
    assert code == 0, output
    assert "| ddp |" in (out / "results.md").read_text() and "| sgd |" in output
    ddp, sgd = read_metrics(out / "ddp" / "metrics.jsonl"), read_metrics(out / "sgd" / "metrics.jsonl")
    # Same hyperparameters (sgd's defaults), same seed, same batches: mean-gradient SGD with momentum on both sides,
    # so the losses agree to float32 rounding (the gradient sums differ only in summation order).
    assert ddp.header["config"]["hyperparameters"] == sgd.header["config"]["hyperparameters"] == {"lr": 0.05, "momentum": 0.9}
    assert [s["step"] for s in ddp.steps] == list(range(1, 9))
    for a, b in zip(ddp.steps[:3], sgd.steps[:3]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a["loss"], b["loss"])
    assert [e["step"] for e in ddp.evals] == [4, 8] and ddp.evals[-1]["evaluated"] == "rank0"
    assert abs(ddp.evals[-1]["test_accuracy"] - sgd.evals[-1]["test_accuracy"]) <= 0.01
    assert math.isclose(ddp.evals[-1]["test_loss"], sgd.evals[-1]["test_loss"], rel_tol=1e-3)
    # Bytes: the Allreduce of the float32 gradient, 4 d each way per step, marked as an estimate; time: all in compute.
    d = ddp.header["parameters"]
    assert all(s["bytes_sent"] == s["bytes_recv"] == 4 * d and s["comm_seconds"] == 0 for s in ddp.steps)
    assert ddp.end["bytes_sent_total"] == sgd.end["bytes_sent_total"] == 8 * 4 * d
    assert ddp.header["notes"]["bytes"].startswith("estimated")
    assert "notes" not in sgd.header


def test_train_ddp_refuses_checkpoints(tmp_path):
    args = ["-m", "mpiopt", "train", "--algorithm", "ddp", "--dataset", "synthetic", "--steps", "4", "--checkpoint-every", "2",
            "--out", str(tmp_path / "run")]
    code, output, _ = run_mpi(1, args, timeout=120)
    assert code != 0
    assert "--checkpoint-every and --resume are not supported for the ddp baseline" in output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_ddp_is_opt_in_takes_sgds_defaults_and_torch_sgds_keywords():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, "compare")
    _, algorithms = config_from_args(parser.parse_args([]), "compare")
    assert "ddp" not in algorithms and "sgd" in algorithms
    config, algorithms = config_from_args(parser.parse_args(["--algorithms", "ddp,sgd", "--hp", "ddp.nesterov=true"]), "compare")
    assert algorithms == ["ddp", "sgd"]
    assert config.algorithm_hyperparameters("ddp") == {"lr": 0.05, "momentum": 0.9, "nesterov": True}
    with pytest.raises(UsageError, match="ddp has no hyperparameter 'density'"):
        config_from_args(parser.parse_args(["--algorithms", "ddp", "--hp", "ddp.density=0.01"]), "compare")
