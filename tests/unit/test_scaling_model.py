"""The alpha-beta scaling model (mpiopt.bench.model): cost forms, calibration, bytes, step times, the command."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from mpiopt.bench import model as M
from mpiopt.bench.algorithms import expected_bytes, synchronous
from mpiopt.bench.model.calibration import _message
from mpiopt.comm.ledger import plan_bytes
from mpiopt.training.config import TrainConfig

ALPHA, BETA = 50e-6, 8e-9


def _model(medium="switched", alpha=ALPHA, beta=BETA, rate=1e9):
    return {"medium": medium, "link_bits_per_second": rate,
            "collectives": {op: {"alpha": alpha, "beta": beta} for op in M.COLLECTIVES}}


@pytest.mark.parametrize("op, P, n, L, switched, shared", [
    ("allreduce", 8, 1000, 6, 1750, 14000),          # 2 log2 P; 2 (P-1)/P n; 2 (P-1) n
    ("allreduce", 5, 1000, 6, 1600, 8000),           # ceil(log2 5) = 3
    ("iallreduce", 2, 1000, 2, 1000, 2000),
    ("allreduce-gloo", 8, 1000, 6, 1750, 14000),     # DDP's Allreduce: the same form, its own fit
    ("allgather", 8, 1000, 7, 7000, 56000),          # P-1; (P-1) n; P (P-1) n
    ("allgatherv", 3, 10, 2, 20, 60),
    ("bcast", 4, 1000, 2, 2000, 3000),               # binomial below 8 ranks
    ("bcast", 8, 1000, 10, 1750, 8500),              # scatter + ring allgather: 3 + 7; (1.5 + 7) n
    ("twophase", 4, 10, 6, 60, 240),                 # 2 (P-1); 2 (P-1) w; 2 P (P-1) w
])
def test_cost_forms_against_hand_computed_values(op, P, n, L, switched, shared):
    assert M.latency_terms(op, P) == L
    assert M.wire_bytes(op, P, n, "switched") == pytest.approx(switched)
    assert M.wire_bytes(op, P, n, "shared") == pytest.approx(shared)
    assert M.collective_seconds(op, P, n, 1e-5, 1e-9, "shared") == pytest.approx(L * 1e-5 + shared * 1e-9)
    assert M.latency_terms(op, 1) == 0 and M.wire_bytes(op, 1, n) == 0


def test_cost_forms_reject_unknown_op_and_medium():
    with pytest.raises(ValueError, match="'reduce'"):
        M.latency_terms("reduce", 4)
    with pytest.raises(ValueError, match="'bus'"):
        M.wire_bytes("allreduce", 4, 10, "bus")


def _collectives_doc(P, alpha, beta, medium, emulated=True, sizes=(1000, 64000, 1_000_000, 4_000_000)):
    """A bench collectives document whose medians follow the model exactly."""
    results = []
    for d in sizes:
        for op in ("allreduce", "iallreduce", "allreduce-gloo", "bcast", "allgather-bits", "allgatherv-sparse", "vote-twophase"):
            kind, n = _message({"op": op, "d": d}, P, 0.01)
            results.append({"op": op, "d": d, "median_seconds": M.collective_seconds(kind, P, n, alpha, beta, medium)})
    return {"benchmark": "collectives", "world_size": P, "link_bits_per_second": 1e9, "emulated_link": emulated,
            "density": 0.01, "results": results}


@pytest.mark.parametrize("medium", M.MEDIA)
def test_calibration_recovers_known_alpha_and_beta(medium):
    docs = [_collectives_doc(P, 3e-4, 9e-9, medium, emulated=medium == "shared") for P in (2, 4, 8)]
    model = M.calibrate(docs)
    assert model["medium"] == medium  # the emulated link's documents default to the shared medium
    assert set(model["collectives"]) == {"allreduce", "iallreduce", "allreduce-gloo", "bcast", "allgather", "allgatherv", "twophase"}
    for op, entry in model["collectives"].items():
        assert entry["alpha"] == pytest.approx(3e-4, rel=1e-6), op
        assert entry["beta"] == pytest.approx(9e-9, rel=1e-6), op
        assert max(abs(p["error"]) for p in entry["points"]) < 1e-6


def test_fit_keeps_parameters_non_negative():
    # Times that fall with size: the free fit has beta < 0; the constrained one is latency only.
    points = [(4, 1000.0, 2e-3), (4, 1e6, 1e-3)]
    alpha, beta = M.fit(points, "allreduce", "switched")
    assert beta == 0 and alpha > 0


def test_calibration_rejects_mixed_links_and_other_benchmarks():
    a, b = _collectives_doc(2, ALPHA, BETA, "shared"), _collectives_doc(4, ALPHA, BETA, "shared")
    b["link_bits_per_second"] = 1e10
    with pytest.raises(ValueError, match="different links"):
        M.calibrate([a, b])
    with pytest.raises(ValueError, match="benchmark='algorithms'"):
        M.calibrate([{**a, "benchmark": "algorithms"}])


CASES = [(name, P, None) for name in synchronous() for P in (2, 3, 4, 8, 16)] + [
    ("lsgd", 8, [4, 4]), ("lsgd", 8, [3, 5]), ("lsgd", 7, [1, 6]), ("lsgd", 4, [1, 1, 1, 1]),
]


@pytest.mark.parametrize("name, P, groups", CASES)
@pytest.mark.parametrize("d", [1000, 1_000_003])
def test_plan_bytes_equal_expected_bytes(name, P, groups, d):
    hyper = TrainConfig().algorithm_hyperparameters(name)
    got = plan_bytes(M.plan(name, d, P, hyper, groups), P)
    want = expected_bytes(name, d, P, hyper, groups=groups, steps=48)  # 48: a whole number of every default period
    assert got["sent"] == pytest.approx(want["sent"], rel=1e-12)
    assert got["recv"] == pytest.approx(want["recv"], rel=1e-12)


@pytest.mark.parametrize("hyper", [{"exchange": "allgather"}, {"exchange": "twophase"}])
def test_plan_bytes_signum_modes(hyper):
    for P in (2, 5, 8):
        got = plan_bytes(M.plan("signum", 100_000, P, hyper), P)
        assert got == pytest.approx(expected_bytes("signum", 100_000, P, hyper))


def test_plan_rejects_async_and_models_prevote():
    with pytest.raises(ValueError, match="async_msgd"):
        M.plan("async_msgd", 10, 4)
    # signum's prevote: an Allgather and a Bcast in each group, then the leaders' Allgather, each group in parallel.
    calls = M.plan("signum", 1000, 4, {"exchange": "prevote"}, [2, 2])
    assert [(c.op, c.ranks, c.phase) for c in calls] == [
        ("allgather", 2, 0), ("bcast", 2, 1), ("allgather", 2, 0), ("bcast", 2, 1), ("allgather", 2, 2)]
    got = plan_bytes(calls, 4)
    assert got == pytest.approx(expected_bytes("signum", 1000, 4, {"exchange": "prevote"}, groups=[2, 2]))


def test_step_seconds_by_hand():
    model, d, P, c = _model(), 1000, 4, 0.01
    allreduce = 4 * ALPHA + 2 * 3 / 4 * 4000 * BETA  # 2 log2 4 hops, 2 (P-1)/P 4d bytes
    assert M.step_seconds("sgd", d, P, c, model) == pytest.approx({"compute": c, "comm": allreduce, "total": c + allreduce})
    assert M.step_seconds("easgd", d, P, c, model, {"period": 4})["comm"] == pytest.approx(allreduce / 4)
    # DaSGD: only what outlasts delay_steps steps of computation is exposed, once per period.
    slow = _model(alpha=1e-2)
    whole = 4 * 1e-2 + 6000 * BETA
    got = M.step_seconds("dasgd", d, P, c, slow, {"period": 4, "delay_steps": 2})["comm"]
    assert got == pytest.approx((whole - 2 * c) / 4)
    assert M.step_seconds("dasgd", d, P, c, model, {"period": 4, "delay_steps": 1, "progress": "thread"})["comm"] == 0
    # Poked once a step (the default, progress="test"), MPI completes one of the Allreduce's 4 rounds a step: a
    # short one hides a round per step of delay, a long one at most a step's computation per round.
    fast = 4 * ALPHA + 6000 * BETA
    for delay in (1, 2, 3, 5):
        got = M.step_seconds("dasgd", d, P, c, model, {"period": 8, "delay_steps": delay})["comm"]
        assert got == pytest.approx(fast * (1 - min(delay, 4) / 4) / 8)
    assert M.step_seconds("dasgd", d, P, c, slow, {"period": 4, "delay_steps": 3, "progress": "none"})["comm"] == pytest.approx((whole - c) / 4)
    # LSGD, one group of 4, defaults (period 4, global 16 suppressed): election + bcast every 4 steps.
    election = 4 * ALPHA + 1.5 * 16 * BETA
    bcast = 2 * ALPHA + 2 * 4000 * BETA
    assert M.step_seconds("lsgd", d, P, c, model)["comm"] == pytest.approx((election + bcast) / 4)


def test_lsgd_groups_parallel_when_switched_serial_when_shared():
    d, P = 1000, 8
    calls = M.plan("lsgd", d, P, {"period": 4, "global_period": 16}, [4, 4])
    local = (4 * ALPHA + 1.5 * 16 * BETA) + (2 * ALPHA + 2 * 4000 * BETA)
    world = (6 * ALPHA + 1.75 * 16 * BETA) + (10 * ALPHA + 1.75 * 4000 * BETA)
    assert M.comm_seconds(calls, _model()) == pytest.approx(local * 4 / 16 + world / 16)
    shared_local = 2 * ((4 * ALPHA + 6 * 16 * BETA) + (2 * ALPHA + 3 * 4000 * BETA))
    shared_world = (6 * ALPHA + 14 * 16 * BETA) + (10 * ALPHA + 8.5 * 4000 * BETA)
    assert M.comm_seconds(calls, _model("shared")) == pytest.approx(shared_local * 4 / 16 + shared_world / 16)


def test_async_server_bound():
    model, d, c = _model(), 1_000_000, 0.05
    server = 2 * (ALPHA + 4e6 * BETA)  # 64.1 ms per update
    few = M.async_seconds(d, 2, c, model)  # one worker: its own compute + the round trip
    assert few["total"] == pytest.approx(2 * (c + server)) and not few["server_bound"]
    many = M.async_seconds(d, 64, c, model)  # 63 workers could send 63/(c + server) per second: the server caps it
    assert many["total"] == pytest.approx(64 * server) and many["server_bound"]


def test_at_rate_scales_beta_only():
    moved = M.at_rate(_model("shared"), 1e11)
    assert moved["medium"] == "switched" and moved["link_bits_per_second"] == 1e11
    assert moved["collectives"]["allreduce"] == {"alpha": ALPHA, "beta": pytest.approx(BETA / 100)}
    assert M.at_rate(_model(), 1e10, alpha=1e-6)["collectives"]["bcast"]["alpha"] == 1e-6


def test_projection_speedups():
    rows = M.project(_model(), [("m", 1_000_000, 0.1)], ranks=[64], rates=["10gbit"], algorithms=["sgd", "easgd"])
    by = {r["algorithm"]: r for r in rows}
    allreduce = 12 * ALPHA + 2 * 63 / 64 * 4e6 * BETA / 10
    assert by["sgd"]["seconds"] == pytest.approx(0.1 + allreduce) and by["sgd"]["speedup"] == 1
    assert by["easgd"]["speedup"] == pytest.approx((0.1 + allreduce) / (0.1 + allreduce / 4))


def _algorithms_doc(P, d, model):
    """A bench algorithms document whose step times are the model's (compute 20 ms + 1 ms of the algorithm's own)."""
    results = []
    for name in ("sgd", "topk"):
        hyper = TrainConfig().algorithm_hyperparameters(name)
        comm = M.step_seconds(name, d, P, 0.021, model, hyper)["comm"]
        results.append({"algorithm": name, "hyperparameters": hyper, "mode": None, "groups": [P],
                        "seconds_per_step": {"compute": 0.02, "algorithm": 0.001, "communication": comm, "waiting": 0.0}})
    return {"benchmark": "algorithms", "world_size": P, "d": d, "results": results}


def test_command_calibrate_validate_project(tmp_path):
    paths = []
    for P in (2, 4):
        paths.append(str(tmp_path / f"coll-{P}.json"))
        with open(paths[-1], "w") as handle:
            json.dump(_collectives_doc(P, ALPHA, BETA, "shared"), handle)
    model_path = str(tmp_path / "model.json")
    assert M.main(["calibrate", *paths, "--out", model_path]) == 0
    with open(model_path) as handle:
        model = json.load(handle)
    assert model["collectives"]["allreduce"]["beta"] == pytest.approx(BETA)
    alg = str(tmp_path / "alg-4.json")
    with open(alg, "w") as handle:
        json.dump(_algorithms_doc(4, 100_000, model), handle)
    out = str(tmp_path / "val.json")
    assert M.main(["validate", model_path, alg, "--json", out, "--plot", str(tmp_path / "val.png")]) == 0
    with open(out) as handle:
        rows = json.load(handle)["rows"]
    assert [r["algorithm"] for r in rows] == ["sgd", "topk"]
    assert all(abs(r["error"]) < 1e-9 for r in rows)
    assert os.path.getsize(tmp_path / "val.png") > 0
    # The projection as a separate process: the command as a user runs it, no MPI launcher.
    png = tmp_path / "scaling.png"
    done = subprocess.run(
        [sys.executable, "-m", "mpiopt.bench.model", "project", model_path, "--models", "tiny=1M@50",
         "--ranks", "64,1024", "--rates", "10gbit", "--algorithms", "sgd,signum,async_msgd", "--plot", str(png)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("| tiny")]
    assert [line.split("|")[3].strip() for line in lines] == ["sgd", "signum", "async_msgd"]
    assert "(1.00x)" in lines[0] and png.stat().st_size > 0


def test_command_rejects_bad_models_spec(tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_model()))
    with pytest.raises(SystemExit) as exit_:
        M.main(["project", str(path), "--models", "resnet50"])
    assert exit_.value.code == 2 and "resnet50" in capsys.readouterr().err
    assert math.isfinite(M.project(_model(), [("m", 10, 0.0)], [2], ["1gbit"], ["sgd"])[0]["speedup"])


def test_as_mpiopt_bench_subcommand(tmp_path, capsys):
    """Under ``mpiopt bench``, project's --ranks (world sizes) must not read as bench's --ranks (start a job)."""
    import argparse

    from mpiopt.cli import bench

    path = tmp_path / "m.json"
    path.write_text(json.dumps(_model()))
    parser = argparse.ArgumentParser(prog="mpiopt bench")
    bench.add_arguments(parser)
    args = parser.parse_args(["model", "project", str(path), "--models", "x=1M@10", "--ranks", "64,128", "--rates", "10gbit",
                              "--algorithms", "sgd"])
    assert args.ranks is None and args.world_sizes == [64, 128]
    assert bench.run(args) == 0
    assert "| x | 10gbit | sgd | " in capsys.readouterr().out


@pytest.mark.parametrize("name, steps", [("dasgd", "delay_steps"), ("streaming_diloco", "overlap_steps")])
def test_an_exchange_in_flight_names_how_far_mpi_moves_it(name, steps):
    hyper = {"period": 8, steps: 2}
    assert {c.progress_rounds for c in M.plan(name, 1000, 4, hyper)} == {2}  # progress="test": a round a step
    assert {c.progress_rounds for c in M.plan(name, 1000, 4, {**hyper, "progress": "none"})} == {1}  # the start's
    assert {c.progress_rounds for c in M.plan(name, 1000, 4, {**hyper, "progress": "thread"})} == {None}  # throughout
    assert {c.overlap_steps for c in M.plan(name, 1000, 4, hyper)} == {2}


# -- islands: the plan level by level, and the node's model for the calls within the islands ------------------------
def test_island_plans_by_hand():
    """d = 1000 float32 on 4 ranks in 2 islands of 2 (the ledger's convention, per rank and step)."""
    d, P, island = 1000, 4, dict(ranks_per_island=2)
    # sgd: the island's mean (4d) and the reassembly of the reduced half (2d) within; half the vector across.
    assert expected_bytes("sgd", d, P, level="link", **island) == {"sent": 2000, "recv": 2000}
    assert expected_bytes("sgd", d, P, level="node", **island) == {"sent": 6000, "recv": 6000}
    # diloco every 4 steps: the mean every step, the exchange and its reassembly every fourth.
    assert expected_bytes("diloco", d, P, {"period": 4}, steps=4, level="link", **island) == {"sent": 500, "recv": 500}
    assert expected_bytes("diloco", d, P, {"period": 4}, steps=4, level="node", **island) == {"sent": 4500, "recv": 4500}
    # signum: 125 packed bytes, slices of 63 along the rails; the island gathers both islands' slices (2 x 63).
    assert expected_bytes("signum", d, P, {"exchange": "allgather"}, level="link", **island) == {"sent": 63, "recv": 63}
    assert expected_bytes("signum", d, P, {"exchange": "allgather"}, level="node", **island) == {"sent": 4000 + 126, "recv": 4000 + 126}
    # One island: only its mean; islands of one rank: the per-rank plan itself.
    assert expected_bytes("diloco", d, 2, {"period": 4}, steps=4, ranks_per_island=2) == {"sent": 4000, "recv": 4000}
    assert expected_bytes("diloco", d, P, {"period": 4}, steps=4, ranks_per_island=1) == expected_bytes("diloco", d, P, {"period": 4}, steps=4)
    with pytest.raises(ValueError, match="6 ranks make no islands of 4"):
        expected_bytes("sgd", d, 6, ranks_per_island=4)


def test_island_step_seconds_by_hand():
    """sgd in 2 islands of 2: the island's Allreduce and its reassembly at the node's cost, the rails' at the link's."""
    link, node, d, c = _model("switched"), _model("switched", alpha=1e-6, beta=1e-10), 1000, 0.01
    mean = 2 * 1e-6 + 4000 * 1e-10  # 2 log2 2 hops, 2 (1/2) 4d
    gather = 1 * 1e-6 + 2000 * 1e-10  # Allgatherv of 2d bytes a rank: P - 1 hops, (P - 1) n
    rail = 2 * ALPHA + 2000 * BETA  # each rail reduces its half: 2 (1/2) 2d bytes
    got = M.step_seconds("sgd", d, 4, c, link, ranks_per_island=2, node=node)
    assert got["comm"] == pytest.approx(mean + gather + rail)
    # On a shared medium the two rails' slices travel one after the other.
    shared = _model("shared")
    assert M.comm_seconds(M.plan("sgd", d, 4, ranks_per_island=2), shared, c, node) == pytest.approx(
        mean + gather + 2 * ALPHA + 2 * 4000 * BETA)
    with pytest.raises(ValueError, match="need the node's model"):
        M.step_seconds("sgd", d, 4, c, link, ranks_per_island=2)


def test_projection_adds_island_runs():
    rows = M.project(_model(), [("m", 1_000_000, 0.1)], ranks=[64], rates=["10gbit"], algorithms=["sgd", "diloco", "lsgd"],
                     ranks_per_island=8, node=_model(alpha=1e-6, beta=1e-11))
    names = {r["algorithm"] for r in rows}
    assert names == {"sgd", "diloco", "lsgd", "sgd@islands", "diloco@islands"}  # lsgd takes no islands
    by = {r["algorithm"]: r for r in rows}
    assert by["diloco@islands"]["seconds"] < by["diloco"]["seconds"]  # an eighth of the bytes across, at 8 workers


def test_an_ideal_link_moves_every_collectives_wire_bytes_at_its_rate_after_its_hops():
    link = M.ideal_link(8e9, 1e-5)  # 1 GB/s
    # an Allreduce of 8000 bytes over 8 ranks: 2 log2 8 hops, 2 (7/8) of it on the wire at 1 ns a byte
    assert M.comm_seconds([M.plan("sgd", 2000, 8)[0]], link) == pytest.approx(6e-5 + 14000e-9)
    assert set(link["collectives"]) == set(M.COLLECTIVES)
    with pytest.raises(ValueError, match="rate > 0.*got 0 bit/s"):
        M.ideal_link(0, 1e-5)


def test_project_prices_the_islands_mean_at_a_node_rate_instead_of_a_node_calibration(tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_model()))
    common = ["project", str(path), "--models", "x=1M@10", "--ranks", "64", "--rates", "10gbit", "--algorithms", "diloco",
              "--ranks-per-island", "8"]
    assert M.main([*common, "--node-rate", "450gbps", "--json", str(tmp_path / "fast.json")]) == 0
    assert M.main([*common, "--node-rate", "2gbps", "--json", str(tmp_path / "slow.json")]) == 0
    fast, slow = ({r["algorithm"]: r["seconds"] for r in json.loads((tmp_path / f"{n}.json").read_text())["rows"]}
                  for n in ("fast", "slow"))
    assert fast["diloco"] == slow["diloco"]  # a worker a rank: nothing inside a node
    # inside the node, at 2 GB/s against 450 GB/s: the island's mean of 4 MB over 8 ranks every step (2 x 7/8 of it on
    # the wire), and every period of 8 steps the Allgatherv of the 8 rails' reduced slices (7/8 of it); the hops alike
    wire = 2 * 7 / 8 * 4e6 + 7 / 8 * 4e6 / 8
    assert slow["diloco@islands"] - fast["diloco@islands"] == pytest.approx(wire / 2e9 - wire / 450e9)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        M.main([*common, "--node-rate", "fast"])
    assert exit_.value.code == 2 and "'fast'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        M.main([*common, "--node-rate", "1gbit", "--node", str(path)])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
