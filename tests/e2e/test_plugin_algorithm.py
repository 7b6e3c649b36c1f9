"""A new algorithm is one module: a toy one under tests/plugins, registered from outside mpiopt, through every layer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mpiopt.metrics import read_metrics

from .launch import ROOT, run_mpi

# What these tests check does not depend on the MPI library: CI runs them under MPICH only (.ci/run).
pytestmark = pytest.mark.one_mpi

PLUGINS = os.path.join(ROOT, "tests", "plugins")
ENV = {"MPIOPT_ALGORITHMS": "toy_averaging", "PYTHONPATH": os.pathsep.join(filter(None, [PLUGINS, os.environ.get("PYTHONPATH")]))}
TINY = ["--dataset", "synthetic", "--steps", "8", "--eval-every", "4", "--batch-size", "16"]


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)
    import toy_averaging

    return toy_averaging.ToyAveraging


def test_setup_step_and_state_round_trip_in_process(toy):
    import mpiopt

    assert mpiopt.algorithms.algorithm_class("toy_averaging") is toy and "toy_averaging" in mpiopt.available()
    topology = mpiopt.Topology()
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((6, 10)).astype(np.float32)
    params = np.ones(10, np.float32)
    alg = mpiopt.create("toy_averaging", topology, lr=0.1, period=2)
    alg.setup(params)
    for g in grads[:3]:
        alg.step(params, g)
    state, saved = alg.state_dict(), params.copy()
    for g in grads[3:]:
        alg.step(params, g)
    again = mpiopt.create("toy_averaging", topology, lr=0.1, period=2)
    again.setup(saved)
    again.load_state_dict(state)
    for g in grads[3:]:
        again.step(saved, g)
    assert np.array_equal(saved, params) and again.averages == alg.averages == 3
    expected = np.ones(10, np.float64) - 0.1 * grads.astype(np.float64).sum(axis=0)  # one rank: averaging is the identity
    np.testing.assert_allclose(params, expected, rtol=1e-5)
    topology.Free()


def test_train_with_checkpoint_and_resume(tmp_path):
    out = tmp_path / "run"
    args = ["-m", "mpiopt", "train", "--algorithm", "toy_averaging", *TINY, "--checkpoint-every", "4", "--out", str(out)]
    code, output, _ = run_mpi(2, args, timeout=180, env=ENV)
    assert code == 0, output
    run = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in run.steps] == list(range(1, 9)) and run.header["config"]["hyperparameters"]["period"] == 2
    assert all(e["evaluated"] == "average" for e in run.evals)
    # An averaging every 2 steps: 4d bytes each way on steps 2, 4, 6, 8 (the ledger's convention at 2 ranks).
    parameters = run.header["parameters"]
    assert [r["bytes_sent"] for r in run.steps] == [0, 4 * parameters] * 4
    checkpoint = sorted((out / "checkpoints").glob("*.h5"))[-1]
    again = tmp_path / "again"
    code, output, _ = run_mpi(2, [*args[:-1], str(again), "--resume", str(checkpoint), "--steps", "10"], timeout=180, env=ENV)
    assert code == 0, output
    assert [r["step"] for r in read_metrics(again / "metrics.jsonl").steps] == [9, 10]


def test_compare_and_bench_algorithms(tmp_path):
    out = tmp_path / "cmp"
    code, output, _ = run_mpi(2, ["-m", "mpiopt", "compare", "--algorithms", "sgd,toy_averaging", *TINY, "--out", str(out)],
                              timeout=240, env=ENV)
    assert code == 0, output
    assert "| toy_averaging |" in (out / "results.md").read_text()
    bench = tmp_path / "alg.json"
    code, output, _ = run_mpi(2, ["-m", "mpiopt", "bench", "algorithms", "--algorithms", "toy_averaging", "--d", "1000",
                                  "--steps", "4", "--json", str(bench)], timeout=180, env=ENV)
    assert code == 0, output
    (result,) = json.loads(bench.read_text())["results"]
    assert result["bytes_sent_per_rank_step"] == result["expected_sent_per_rank_step"] == 4 * 1000 / 2
    assert result["formula"] == "4d every `period` steps"
