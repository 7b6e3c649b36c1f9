"""Islands: every algorithm that takes them, run with each island one worker, against float64 re-computations.

At each world size every layout of equal islands runs (4 ranks: 2 islands of 2, 1 of 4, 4 of 1; 6 ranks, through
tools/test.sh: 3 of 2 and 2 of 3).  The re-computation is one process in which each island is one worker whose
gradient is the mean of its ranks' gradients; the same run at one rank per worker, fed those means, must agree with
it; the ranks of an island must hold bitwise the same parameters and state after every step.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np
import pytest

import mpiopt
from mpiopt import Topology
from mpiopt.codecs import create as create_codec
from mpiopt.sim.streaming_diloco import simulate as streaming_simulation

pytestmark = pytest.mark.mpi

D, STEPS = 96, 12
SPARSELOCO = dict(lr=0.05, momentum=0.9, period=3, outer_lr=0.8, codec_chunk=32, codec_k=8, codec_bits=2, codec_beta=0.95)
CASES: Dict[str, Dict[str, Any]] = {
    "sgd": dict(lr=0.1, momentum=0.9),
    "sgd+int8": dict(lr=0.1, momentum=0.9, codec="int8", codec_chunk=16),
    "easgd": dict(lr=0.05, momentum=0.9, period=2),
    "dasgd": dict(lr=0.05, period=3, delay_steps=1),
    "diloco": dict(lr=0.05, momentum=0.9, period=3, outer_lr=0.7, outer_momentum=0.9),
    "diloco+int8": dict(lr=0.05, momentum=0.9, period=3, outer_lr=0.7, outer_momentum=0.9, codec="int8", codec_chunk=16),
    "streaming_diloco": dict(lr=0.05, momentum=0.9, period=4, fragments=2, overlap_steps=1, alpha=0.5, outer_lr=0.7,
                             outer_momentum=0.9),
    "sparseloco": SPARSELOCO,
    "signum": dict(lr=0.01, momentum=0.9, weight_decay=1e-3, exchange="allgather"),
    "signum/twophase": dict(lr=0.01, momentum=0.9, weight_decay=1e-3, exchange="twophase"),
    "topk": dict(lr=0.1, density=0.1),
    "regtopk": dict(lr=0.1, density=0.1, mu=2.0),
}


def algorithm(case: str) -> str:
    return case.split("+")[0].split("/")[0]


def _grad(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([7, rank, step]).standard_normal(D) + 0.3 * (rank % 3)


def _start(rank: int) -> np.ndarray:
    return np.random.default_rng([8, rank]).standard_normal(D)


def layouts(world_size: int) -> List[int]:
    """The island sizes that split ``world_size`` ranks into equal islands."""
    return [g for g in range(1, world_size + 1) if world_size % g == 0]


# -- the float64 re-computations: W workers, worker w's gradient grad(w, t), worker w starting at start(w) --------------
def _sgd_step(x, b, g, lr, momentum, wd=0.0):
    g = g + wd * x
    b = g if b is None else momentum * b + g
    return x - lr * (b if momentum else g), b


def _codec_mean(codec, residuals, vectors):
    """Each worker's vector through its error-feedback residual and the codec; the mean of what the payloads carry."""
    d = vectors[0].shape[0]
    carried = []
    for w, v in enumerate(vectors):
        residuals[w] = residuals[w] + v
        carried.append(codec.decode(codec.encode(residuals[w]), d, out=np.empty(d)))
        residuals[w] = residuals[w] - carried[-1]
    return np.mean(carried, axis=0)


def _outer(theta, mean_delta, ob, lr, momentum):
    ob = mean_delta if ob is None else momentum * ob + mean_delta
    return theta - lr * (mean_delta + momentum * ob), ob


def reference(case: str, W: int, start: Callable[[int], np.ndarray], grad: Callable[[int, int], np.ndarray]) -> List[List[np.ndarray]]:
    """Every worker's parameters after each of :data:`STEPS` steps (streaming_diloco: after the last and its merges)."""
    h, name = CASES[case], algorithm(case)
    x = [start(w) for w in range(W)]
    b: List[Any] = [None] * W
    history = []
    codec = create_codec("int8", chunk=h["codec_chunk"]) if "codec" in h else None
    residuals = [np.zeros(D) for _ in range(W)]
    if name in ("diloco", "sparseloco"):
        x = [np.mean(x, axis=0)] * W
    theta, ob = x[0].copy(), None
    center = np.mean(x, axis=0)
    snapshot, pending = None, 0
    momenta = [np.zeros(D) for _ in range(W)]
    sent_prev: List[Any] = [None] * W
    aggregate = np.zeros(D)
    if name == "streaming_diloco":
        return [streaming_simulation([start(w) for w in range(W)], lambda w, t, _: grad(w, t), STEPS, **h)]
    for t in range(1, STEPS + 1):
        g = [grad(w, t) for w in range(W)]
        if name == "sgd":
            mean = np.mean(g, axis=0) if codec is None else _codec_mean(codec, residuals, g)
            _, b[0] = _sgd_step(x[0], b[0], mean, h["lr"], h["momentum"])
            x = [xw - h["lr"] * b[0] for xw in x]
        elif name in ("easgd", "dasgd", "diloco", "sparseloco"):
            wd = 0.01 if name == "dasgd" else 0.0
            for w in range(W):
                x[w], b[w] = _sgd_step(x[w], b[w], g[w], h["lr"], h.get("momentum", 0.9), wd)
            if name == "easgd" and t % h["period"] == 0:
                alpha = 0.9 / W
                mean = np.mean(x, axis=0)
                x = [xw - alpha * (xw - center) for xw in x]
                center = center + 0.9 * (mean - center)
            if name == "dasgd" and t == pending:
                x = [np.mean(snapshot, axis=0) + (xw - s) for xw, s in zip(x, snapshot)]
            if name == "dasgd" and t % h["period"] == 0:
                snapshot, pending = [xw.copy() for xw in x], t + h["delay_steps"]
            if name == "diloco" and t % h["period"] == 0:
                deltas = [theta - xw for xw in x]
                mean = np.mean(deltas, axis=0) if codec is None else _codec_mean(codec, residuals, deltas)
                theta, ob = _outer(theta, mean, ob, h["outer_lr"], h["outer_momentum"])
                x = [theta.copy() for _ in range(W)]
            if name == "sparseloco" and t % h["period"] == 0:
                topk = create_codec("topk", chunk=h["codec_chunk"], k=h["codec_k"], bits=h["codec_bits"])
                sent, picked = [], np.zeros(D)
                for w in range(W):
                    residuals[w] = h["codec_beta"] * residuals[w] + (theta - x[w])
                    sent.append(topk.decode(topk.encode(residuals[w]), D, out=np.empty(D)))
                    picked[topk.select(np, residuals[w])] += 1
                    residuals[w] = residuals[w] - sent[-1]
                theta = theta - h["outer_lr"] * np.sum(sent, axis=0) / np.maximum(picked, 1)
                x = [theta.copy() for _ in range(W)]
        elif name == "signum":
            momenta = [h["momentum"] * m + (1 - h["momentum"]) * gw for m, gw in zip(momenta, g)]
            votes = np.sum([np.where(m >= 0, 1, -1) for m in momenta], axis=0)
            vote = np.where(votes >= 0, 1.0, -1.0)
            x = [xw * (1 - h["lr"] * h["weight_decay"]) - h["lr"] * vote for xw in x]
        else:  # topk, regtopk: a = g + e; the top k of |a| (RegTop-k: of its scores) sent; G their mean
            k = int(round(h["density"] * D))
            sends = []
            for w in range(W):
                a = g[w] + residuals[w]
                scores = np.abs(a)
                if name == "regtopk" and sent_prev[w] is not None:
                    indices, values = sent_prev[w]
                    delta = (aggregate[indices] - values / W) / (values / W)
                    scores[indices] *= np.tanh(np.abs(1 + delta) / h["mu"])
                chosen = np.sort(np.argsort(-scores, kind="stable")[:k])
                sent = np.zeros(D)
                sent[chosen] = a[chosen]
                residuals[w] = a - sent
                sent_prev[w] = (chosen, a[chosen])
                sends.append(sent)
            aggregate = np.mean(sends, axis=0)
            x = [xw - h["lr"] * aggregate for xw in x]
        history.append([xw.copy() for xw in x])
    return history


# -- the runs --------------------------------------------------------------------------------------------------------
def island_run(topo: Topology, case: str, G: int) -> tuple:
    """The run with islands of ``G`` ranks; returns the algorithm, each step's parameters and each step's state bytes."""
    alg = mpiopt.create(algorithm(case), topo, islands=True, **CASES[case])
    params = _start(topo.rank)  # each rank its own: the island starts from its first rank's
    alg.setup(params)
    seen, states = [], []
    for t in range(1, STEPS + 1):
        alg.step(params, _grad(topo.rank, t))
        seen.append(params.copy())
        states.append(b"".join(np.ascontiguousarray(v).tobytes() for v in alg.state_dict()["arrays"].values() if v is not None))
    alg.finish(params)  # an exchange in flight completes before its buffers go
    if algorithm(case) == "streaming_diloco":
        seen = [params.copy()]
    return alg, seen, states


def island_mean(w: int, G: int, t: int) -> np.ndarray:
    return np.mean([_grad(r, t) for r in range(w * G, (w + 1) * G)], axis=0)


@pytest.mark.parametrize("G", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_an_island_is_one_worker_stepping_on_its_ranks_mean_gradient(world_size, case, G):
    if world_size % G:
        pytest.skip(f"{world_size} ranks make no islands of {G}")
    topo = Topology(group_size=G)
    W = world_size // G
    alg, seen, states = island_run(topo, case, G)
    expected = reference(case, W, lambda w: _start(w * G), lambda w, t: island_mean(w, G, t))
    mine = [step[topo.group_index] for step in expected]
    for t, (got, want) in enumerate(zip(seen, mine), start=1):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{case}: step {t}")
    # The island's ranks hold bitwise the same parameters and state after every step.
    for what, values in (("parameters", [p.tobytes() for p in seen]), ("state", states)):
        island = topo.group.allgather_obj(values)
        assert all(v == island[0] for v in island), f"{case}: the island's ranks differ in their {what}"
    assert alg.workers.size == W
    topo.Free()


@pytest.mark.parametrize("case", [c for c in CASES if algorithm(c) != "streaming_diloco"])
def test_islands_of_g_at_p_ranks_are_the_run_at_p_over_g_ranks_fed_the_islands_batches(world_size, case):
    """The per-rank run on W = P / G ranks, each fed its island's mean gradient, is the island run."""
    G = max(g for g in layouts(world_size) if g < world_size or world_size == 1)
    W = world_size // G
    topo = Topology(group_size=G)
    _, seen, _ = island_run(topo, case, G)
    islands = topo.world.allgather_obj(seen)[::G]  # each island's parameters after each step
    few = topo.first(W)
    if few is not None:
        alg = mpiopt.create(algorithm(case), few, **CASES[case])
        params = _start(few.rank * G)
        alg.setup(params)
        for t in range(1, STEPS + 1):
            alg.step(params, island_mean(few.rank, G, t))
            np.testing.assert_allclose(params, islands[few.rank][t - 1], rtol=1e-12, atol=1e-12, err_msg=f"step {t}")
        alg.finish(params)
        few.Free()
    topo.Free()


# -- what crosses between islands: one worker's bytes, shared by the island's ranks ----------------------------------
LEDGER_CASES = [
    ("sgd", {"momentum": 0.9}), ("sgd", {"codec": "int8", "codec_chunk": 64}), ("easgd", {"period": 3}),
    ("dasgd", {"period": 5, "delay_steps": 2}), ("diloco", {"period": 3}), ("diloco", {"period": 2, "codec": "int4"}),
    ("streaming_diloco", {"period": 6, "fragments": 3, "overlap_steps": 2}),
    ("sparseloco", {"period": 3, "codec_chunk": 128, "codec_k": 9}),
    ("signum", {"exchange": "allgather"}), ("signum", {"exchange": "twophase"}), ("signum", {"exchange": "auto"}),
    ("topk", {"k": 7}), ("topk", {"density": 0.6}), ("regtopk", {"density": 0.05, "mu": 4.0}),
]


@pytest.mark.parametrize("G", [1, 2, 3])
@pytest.mark.parametrize("name, hyper", LEDGER_CASES, ids=lambda v: str(v))
def test_the_islands_ranks_together_send_one_workers_bytes_between_islands(world_size, name, hyper, G):
    from mpiopt.bench.algorithms import expected_bytes

    if world_size % G:
        pytest.skip(f"{world_size} ranks make no islands of {G}")
    d, start, steps = 1001, 1, 13  # from the first step to the last's Wait: every exchange starts and ends inside
    topo = Topology(group_size=G)
    W = world_size // G
    rng = np.random.default_rng([3, topo.group_index])  # the same gradients on an island's ranks: their mean is them
    params = rng.standard_normal(d).astype(np.float32)
    alg = mpiopt.create(name, topo, islands=True, lr=0.01, **hyper)
    alg.setup(params)
    for step in range(1, start + steps):
        if step == start:
            before = topo.ledger.snapshot()
        alg.step(params, rng.standard_normal(d).astype(np.float32))
    alg.finish(params)  # an island reassembles what its rails exchanged in flight at the Wait: counted here
    delta = topo.ledger.since(before)
    between = {op: s for op, s in delta.ops.items() if op.startswith("rail.")}
    within = {op: s for op, s in delta.ops.items() if op.startswith("island.")}
    assert set(delta.ops) == set(between) | set(within), sorted(delta.ops)
    island_sent = sum(topo.group.allgather_obj(sum(s.bytes_sent for s in between.values())))
    calls = sum(s.calls for s in between.values())
    worker = round(expected_bytes(name, d, W, hyper, steps=steps, start=start)["sent"] * steps)  # one worker's, over the steps
    # Allreduce slices add up exactly; Allgather and Alltoall slices are padded to one width: < G bytes a block.
    assert worker <= island_sent <= worker + calls * W * (G - 1), (island_sent, worker)
    # The plan of the island run, level by level: the padded slices across, the mean and the reassembly within.
    island = dict(steps=steps, start=start, ranks_per_island=G)
    across = expected_bytes(name, d, world_size, hyper, level="link", **island)["sent"] * steps * G  # per island
    assert across == pytest.approx(island_sent, rel=1e-12), (across, island_sent)
    within_sent = sum(topo.group.allgather_obj(sum(s.bytes_sent for s in within.values())))
    assert expected_bytes(name, d, world_size, hyper, level="node", **island)["sent"] * steps * G == pytest.approx(within_sent)
    if G > 1 and W > 1:
        assert within_sent > 0
    topo.Free()


# -- refused settings: on every rank, before any communication, with the fix named ----------------------------------
@pytest.mark.parametrize("name, match", [
    ("lsgd", "lsgd takes no islands=True: it is node-aware already.*run it without islands"),
    ("async_msgd", "async_msgd takes no islands=True: its workers trade whole vectors with a server"),
    ("async_lsgd", "async_lsgd takes no islands=True"),
])
def test_algorithms_that_refuse_islands_say_why(topology, name, match):
    before = topology.ledger.snapshot()
    with pytest.raises(ValueError, match=match):
        mpiopt.create(name, topology, islands=True)
    assert not topology.ledger.since(before).ops


def test_unequal_islands_and_prevote_are_refused_with_the_fix(world_size):
    topo = Topology(group_size=2)
    prevote = "prevote.*islands=True a node is one worker already: use exchange='auto'"
    if world_size == 3:
        with pytest.raises(ValueError, match=r"diloco with islands=True: .*groups of \[2, 1\].*--group-size"):
            mpiopt.create("diloco", topo, islands=True)
    with pytest.raises(ValueError, match="groups of" if world_size == 3 else prevote):
        mpiopt.create("signum", topo, islands=True, exchange="prevote")
    with pytest.raises(TypeError, match="islands must be a bool"):
        mpiopt.create("sgd", topo, islands="yes")
    topo.Free()


def test_ranks_that_disagree_on_islands_are_told_at_setup(world_size):
    if world_size < 2:
        pytest.skip("needs two ranks")
    from mpiopt.comm import SetupMismatchError

    topo = Topology(group_size=1)
    alg = mpiopt.create("diloco", topo, islands=topo.rank == 0, period=2)
    with pytest.raises(SetupMismatchError, match="islands"):
        alg.setup(np.zeros(10))
    topo.Free()


@pytest.mark.parametrize("case", ["dasgd", "diloco+int8", "streaming_diloco", "sparseloco", "signum", "regtopk"])
def test_state_dict_resume_with_islands_is_bitwise(world_size, bitwise_resume, case):
    topo = Topology(group_size=2 if world_size % 2 == 0 else 1)
    grads = [_grad(topo.rank, t) for t in range(1, 11)]
    bitwise_resume(topo, algorithm(case), {**CASES[case], "islands": True}, _start(topo.rank), grads, split=5)
    topo.Free()
