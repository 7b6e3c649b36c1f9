"""``mpiopt bench``: every subcommand end to end at a tiny size (under mpiexec where it needs ranks), its JSON checked."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from .launch import ROOT, run_mpi

BENCH = ["-m", "mpiopt", "bench"]


def run_cli(args, timeout=120, env=None):
    """``python -m mpiopt bench ARGS`` without mpiexec (one process, or one that starts its own job)."""
    proc = subprocess.run(
        [sys.executable, *BENCH, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
    )
    return proc.returncode, proc.stdout


def load(path):
    with open(path) as handle:
        return json.load(handle)


@pytest.mark.one_mpi  # its text, whichever MPI ran it
def test_help_lists_every_benchmark_and_every_default():
    code, output = run_cli(["--help"])
    assert code == 0, output
    for name in ("collectives", "algorithms", "ddp", "compressed", "averaging", "kernels", "torch-overhead", "regtopk", "tradeoff"):
        assert name in output, output
    code, output = run_cli(["algorithms", "--help"])
    assert code == 0, output
    assert "(default: 16)" in output and "(default: 1000000)" in output and "(default: 0.0)" in output, output


def test_collectives_times_ddps_gloo_allreduce_beside_mpis_when_asked(tmp_path):
    out = tmp_path / "coll.json"
    code, output, _ = run_mpi(2, [*BENCH, "collectives", "--sizes", "64k", "--repeats", "2", "--ops", "allreduce,allreduce-gloo",
                                  "--json", str(out)])
    assert code == 0, output
    assert "| allreduce-gloo | 64,000 | — | — |" in output, output  # gloo's bytes bypass the ledger: none claimed
    rows = {r["op"]: r for r in load(out)["results"]}
    assert rows["allreduce-gloo"]["bytes_sent_per_rank"] is None and rows["allreduce"]["bytes_sent_per_rank"] == 4 * 64_000
    assert 0 < rows["allreduce-gloo"]["min_seconds"] <= rows["allreduce-gloo"]["median_seconds"]


def test_collectives_bytes_at_two_ranks(tmp_path):
    out = tmp_path / "coll.json"
    code, output, _ = run_mpi(2, [*BENCH, "collectives", "--sizes", "1000,64k", "--repeats", "2", "--density", "0.01", "--json", str(out)])
    assert code == 0, output
    assert "| allreduce | 1,000 |" in output, output
    data = load(out)
    assert data["world_size"] == 2 and data["link_rate"] is None
    rows = {(r["op"], r["d"]): r for r in data["results"]}
    assert len(rows) == 2 * 6
    for d in (1000, 64_000):
        # The ledger's convention at P = 2, per rank: what one other rank sends.
        assert rows["allreduce", d]["bytes_recv_per_rank"] == 4 * d
        assert rows["iallreduce", d]["bytes_sent_per_rank"] == 4 * d
        assert rows["allgather-bits", d]["bytes_recv_per_rank"] == -(-d // 8)
        assert rows["allgatherv-sparse", d]["bytes_recv_per_rank"] == 8 * round(0.01 * d)
        assert rows["bcast", d]["bytes_sent_per_rank"] == 4 * d / 2  # the root sends, the other receives
        for r in (rows[op, d] for op in ("allreduce", "vote-twophase", "bcast")):
            assert len(r["seconds"]) == 2 and 0 < r["min_seconds"] <= r["median_seconds"]


def test_collectives_after_work_times_each_call_behind_the_same_work_on_every_rank(tmp_path):
    """``--after-work``: each call follows a fixed stretch of work with no barrier (as a step's exchange follows its
    backward pass); the bytes are the same calls', and the JSON names the work."""
    out = tmp_path / "coll.json"
    code, output, _ = run_mpi(2, [*BENCH, "collectives", "--sizes", "1000", "--repeats", "3", "--ops", "allreduce",
                                  "--after-work", "0.01", "--json", str(out)])
    assert code == 0, output
    assert "median of 3 repetitions, each after 0.01 s of work" in output, output
    data = load(out)
    (row,) = data["results"]
    assert data["after_work_seconds"] == 0.01 and row["bytes_recv_per_rank"] == 4 * 1000
    assert len(row["seconds"]) == 3 and 0 < row["min_seconds"] <= row["median_seconds"]


@pytest.mark.one_mpi  # mpiopt's ledger against its formulas, whichever MPI ran it
def test_algorithms_ledger_matches_formula(tmp_path):
    out = tmp_path / "alg.json"
    code, output, _ = run_mpi(2, [*BENCH, "algorithms", "--d", "5000", "--steps", "8", "--compute-ms", "1", "--json", str(out)], timeout=180)
    assert code == 0, output
    data = load(out)
    assert [r["algorithm"] for r in data["results"]] == ["sgd", "easgd", "lsgd", "dasgd", "diloco", "streaming_diloco", "sparseloco", "signum", "topk", "regtopk"]
    for r in data["results"]:
        assert r["bytes_sent_per_rank_step"] == pytest.approx(r["expected_sent_per_rank_step"], rel=1e-12), r
        assert r["bytes_recv_per_rank_step"] == pytest.approx(r["expected_recv_per_rank_step"], rel=1e-12), r
        assert r["seconds_per_step"]["compute"] >= 0.9e-3, r  # the busy wait holds at least what was asked
    sgd = data["results"][0]
    assert sgd["bytes_sent_per_rank_step"] == 4 * 5000


def test_ddp_trains_the_same_model_as_sgd(tmp_path):
    out = tmp_path / "ddp.json"
    args = [*BENCH, "ddp", "--algorithms", "sgd,signum", "--width", "16", "--batch-size", "8", "--steps", "2", "--rounds", "2", "--json", str(out)]
    code, output, _ = run_mpi(2, args, timeout=240)
    assert code == 0, output
    data = load(out)
    assert set(data["results"]) == {"ddp", "sgd", "signum"}
    assert data["world_size"] == 2 and data["setting"] == "shared memory"
    for r in data["results"].values():
        assert len(r["seconds"]) == 2 and r["samples_per_second"] > 0 and r["median_ratio_to_ddp"] > 0
    # Same weights, batches and averaged gradient: DDP and mpiopt's sgd differ by float32 rounding only.
    assert data["sgd_parameter_difference"] < 1e-5
    assert "goal, sgd step time <= 0.95 x DDP's (shared memory)" in output, output


@pytest.mark.one_mpi  # their output's form, whichever MPI ran it
def test_existing_benchmarks_run_as_subcommands(tmp_path):
    code, output, _ = run_mpi(2, [*BENCH, "compressed", "--d", "4096", "--steps", "1", "--reps", "2"], timeout=120)
    assert code == 0 and "| vote/auto |" in output, output
    code, output = run_cli(["update", "--d", "1000", "--rounds", "1", "--steps", "1", "--algorithms", "sgd", "--threads", "2"])
    assert code == 0 and "2 thread(s) for torch and the C kernels" in output and "| sgd |" in output, output
    code, output = run_cli(["kernels", "--d", "4096", "--repeat", "1"])
    assert code == 0 and "majority_vote" in output, output
    code, output = run_cli(["tradeoff", "--delays", "0,2", "--momenta", "0,0.5", "--seeds", "1", "--max-steps", "50", "--out", str(tmp_path / "t.png")])
    assert code == 0 and (tmp_path / "t.png").exists(), output
    code, output = run_cli(["regtopk", "--densities", "0.5", "--mus", "4", "--steps", "20", "--workers", "3", "--dim", "10", "--samples", "20"])
    assert code == 0 and "Top-k" in output, output


def test_averaging_times_diloco_and_streaming_diloco():
    args = [
        *BENCH, "averaging", "--params", "20000", "--matrix", "32", "--reps", "2",
        "--modes", "compute,dasgd,diloco,streaming_diloco,streaming_diloco+probe", "--outer-period", "8", "--fragments", "4", "--overlap-steps", "1",
    ]
    code, output, _ = run_mpi(2, args, timeout=120, env={"OMP_NUM_THREADS": "1"})
    assert code == 0, output
    assert "H = 8, F = 4, overlap_steps = 1" in output and "8 timed steps per mode" in output, output
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in output.splitlines() if line.startswith("| ")}
    for mode in ("compute", "dasgd", "diloco", "streaming_diloco", "streaming_diloco+probe"):
        assert math.isfinite(float(rows[mode])), output  # the ratio to compute-only
    assert "goal, per-step time <= 1.05 x compute-only: streaming_diloco" in output, output
    # Every fragment's exchange overlapping 2 steps needs a gap of 3 steps between starts: H = 8, F = 4 has 2.
    code, output = run_cli(["averaging", "--modes", "streaming_diloco", "--fragments", "4", "--overlap-steps", "2"])
    assert code == 2 and "--outer-period of at least 12" in output, output


@pytest.mark.one_mpi  # refused before MPI starts, whichever MPI ran it
def test_bad_input_is_a_usage_error():
    code, output = run_cli(["collectives", "--ops", "allreduce,nope"])
    assert code == 2 and "nope" in output, output
    code, output = run_cli(["--link", "fast", "collectives"])
    assert code == 2 and "tc's units" in output, output
    code, output = run_cli(["collectives", "--after-work", "-1"])
    assert code == 2 and "--after-work must be from 0 to 10 seconds, got -1.0" in output, output
    code, output = run_cli(["--link", "2gbit", "collectives", "--sizes", "10", "--repeats", "1"], env={"EMULATED_LINK_RATE": "1gbit"})
    assert code == 2 and "RATE=1gbit" in output, output


def test_ranks_starts_the_job(tmp_path):
    out = tmp_path / "coll.json"
    code, output = run_cli(["--ranks", "2", "collectives", "--sizes", "100", "--repeats", "1", "--ops", "allreduce", "--json", str(out)])
    assert code == 0, output
    assert load(out)["world_size"] == 2


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="the emulated link needs root and tc")
def test_link_runs_inside_the_emulated_link(tmp_path):
    if subprocess.run(["unshare", "-n", "true"]).returncode != 0:
        pytest.skip("unshare -n is not allowed here")
    out = tmp_path / "coll.json"
    code, output = run_cli(["--link", "1gbit", "--ranks", "2", "collectives", "--sizes", "1000", "--repeats", "1", "--json", str(out)], timeout=180)
    assert code == 0, output
    data = load(out)
    assert data["emulated_link"] is True and data["link_rate"] == "1gbit" and data["link_bits_per_second"] == 1e9
    assert "% of link" in output, output
