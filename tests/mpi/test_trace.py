"""Tracer: one trace with every rank's events, in-flight averaging seen behind compute, results unchanged."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import mpiopt
from mpiopt.metrics import Tracer, overlap_fraction

pytestmark = pytest.mark.mpi


def traced_work(topology, tracer):
    """Blocking and nonblocking calls; the Iallreduce is in flight across a compute phase."""
    world = topology.world
    P, r = world.size, world.rank
    data = np.full(8, r + 1.0)
    world.Allreduce(data)
    request = world.Iallreduce(data)
    with tracer.phase("forward/backward"):
        time.sleep(0.005)
    request.Wait()
    with tracer.phase("algorithm"):
        world.Allreduce(data)
    # (1 + ... + P) summed over P ranks, twice more.
    np.testing.assert_array_equal(data, np.full(8, P * P * P * (P + 1) / 2))


def test_trace_has_every_rank_and_sees_the_overlap(topology, tmp_path):
    world = topology.world
    with Tracer(topology) as tracer:
        traced_work(topology, tracer)
        trace = tracer.write(tmp_path / "trace.json")
    assert topology.ledger.listener is None
    if world.rank != 0:
        assert trace is None
        return
    assert json.loads((tmp_path / "trace.json").read_text()) == trace
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(world.size))
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in range(world.size)}
    for rank in range(world.size):
        mine = {(e["name"], e["cat"], e["tid"]) for e in spans if e["pid"] == rank}
        assert {
            ("world.Allreduce", "blocking", 1),
            ("world.Iallreduce", "inflight", 2),
            ("forward/backward", "phase", 0),
            ("algorithm", "phase", 0),
        } <= mine
        assert sum(e["name"] == "world.Allreduce" and e["pid"] == rank for e in spans) == 2
        assert 0 < overlap_fraction(events, rank) <= 1
        # Only the compute phase ran while the Iallreduce was in flight.
        assert overlap_fraction(events, rank, phases=["algorithm"]) == 0
    assert trace["otherData"]["dropped_events"] == [0] * world.size


def test_tracing_leaves_results_unchanged(topology, tmp_path):
    rng = np.random.default_rng(7 + topology.rank)
    grads = rng.standard_normal((4, 50)).astype(np.float32)

    def train():
        params = np.linspace(-1, 1, 50, dtype=np.float32)
        alg = mpiopt.create("dasgd", topology, lr=0.1, period=2, delay_steps=1)
        alg.setup(params)
        for grad in grads:
            alg.step(params, grad)
        alg.finish(params)
        return params

    plain = train()
    with Tracer(topology) as tracer:
        traced = train()
        trace = tracer.write(tmp_path / "trace.json")
    np.testing.assert_array_equal(plain, traced)
    if trace is not None:
        averages = [e for e in trace["traceEvents"] if e.get("cat") == "inflight" and e["name"] == "world.Iallreduce"]
        assert {e["pid"] for e in averages} == set(range(topology.size))
