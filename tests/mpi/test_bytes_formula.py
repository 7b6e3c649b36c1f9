"""Each algorithm's per-step byte formulas (mpiopt.bench.algorithms.expected_bytes) against the ledger, every synchronous algorithm."""

from __future__ import annotations

import numpy as np
import pytest

import mpiopt
from mpiopt.bench.algorithms import expected_bytes, synchronous

pytestmark = pytest.mark.mpi

# (algorithm, hyperparameters, group size or None): every exchange mode and period of the synchronous algorithms.
CASES = [
    ("sgd", {"momentum": 0.9}, None),
    ("easgd", {"period": 3}, None),
    ("lsgd", {"period": 2, "global_period": 4}, None),
    ("lsgd", {"period": 2, "global_period": 4}, 2),
    ("lsgd", {"period": 1, "global_period": 3, "pull_local": 0.0}, 2),
    ("dasgd", {"period": 5, "delay_steps": 2}, None),
    ("dasgd", {"period": 2, "delay_steps": 0}, None),
    ("diloco", {"period": 3}, None),
    ("diloco", {"period": 4, "outer_lr": 1.0, "outer_momentum": 0.0}, None),
    ("streaming_diloco", {"period": 6, "fragments": 3, "overlap_steps": 2}, None),
    ("streaming_diloco", {"period": 4, "fragments": 1, "overlap_steps": 0}, None),
    ("sparseloco", {"period": 3, "codec_chunk": 128, "codec_k": 9}, None),
    ("sparseloco", {"period": 2, "codec": "none"}, None),
    ("streaming_diloco", {"period": 6, "fragments": 3, "overlap_steps": 2, "layout": "strided", "stride_blocks": 5}, None),
    ("signum", {"exchange": "allgather"}, None),
    ("signum", {"exchange": "twophase"}, None),
    ("signum", {"exchange": "auto"}, None),
    ("signum", {"exchange": "prevote"}, 2),
    ("topk", {"k": 7}, None),
    ("topk", {"density": 0.6}, None),  # dense enough for the bitmap encoding
    ("regtopk", {"density": 0.05, "mu": 4.0}, None),
]
D = 1001
STEPS, START = 12, 4  # steps 4..15: periods 2, 3, 4, 5 fall at different places


def test_every_synchronous_algorithm_has_a_case():
    assert {name for name, _, _ in CASES} == set(synchronous())


@pytest.mark.parametrize("name, hyper, group_size", CASES, ids=lambda v: str(v))
def test_formula_matches_ledger(name, hyper, group_size):
    topology = mpiopt.Topology(group_size=group_size)
    try:
        P = topology.size
        rng = np.random.default_rng([3, topology.rank])
        params = rng.standard_normal(D).astype(np.float32)
        alg = mpiopt.create(name, topology, lr=0.01, **hyper)
        alg.setup(params)
        for step in range(1, START + STEPS):
            if step == START:
                before = topology.ledger.snapshot()
            alg.step(params, rng.standard_normal(D).astype(np.float32), loss=float(rng.random()))
        delta = topology.ledger.since(before)
        alg.finish(params)
        sent, recv = topology.world.allreduce_obj(np.array([delta.bytes_sent, delta.bytes_recv]))
        groups = [size for _, size in sorted(set(topology.world.allgather_obj((topology.group_index, topology.group.size))))]
        expected = expected_bytes(name, D, P, hyper, groups=groups, steps=STEPS, start=START)
        # expected_bytes is per rank and step; the ledger's sums are over ranks and steps.
        assert expected["sent"] * P * STEPS == pytest.approx(sent, rel=1e-12, abs=1e-9)
        assert expected["recv"] * P * STEPS == pytest.approx(recv, rel=1e-12, abs=1e-9)
        if P > 1:
            assert sent > 0
    finally:
        topology.Free()


def test_closed_forms_by_hand():
    # d = 1000, P = 3 worked out on paper (the ledger's convention, per rank and step).
    d, P = 1000, 3
    assert expected_bytes("sgd", d, P) == {"sent": 4000, "recv": 4000}
    assert expected_bytes("easgd", d, P, {"period": 4}, steps=8) == {"sent": 1000, "recv": 1000}
    # ceil(1000 / 8) = 125 bytes of signs; Allgather: sent 125, received 2 x 125.
    assert expected_bytes("signum", d, P, {"exchange": "allgather"}) == {"sent": 125, "recv": 250}
    # Two-phase: 16 words in chunks of 5, 5, 6 words; the widest, 45 bytes (cut at 125), is the Alltoall block:
    # Alltoall sends and receives 2 x 45, the Allgather of the voted chunk sends 45 and receives 2 x 45.
    assert expected_bytes("signum", d, P, {"exchange": "twophase"}) == {"sent": 135, "recv": 180}
    # Top-k, k = 10: 8-byte header + 10 int32 indices + 10 float32 values = 88 bytes, received from 2 others.
    assert expected_bytes("topk", d, P, {"k": 10}) == {"sent": 88, "recv": 176}
    # LSGD, one group, global period 4 (local period 1 by default): every step elects (16 bytes) and
    # broadcasts 4000 bytes from one of 3 ranks.
    both = expected_bytes("lsgd", d, P, {"global_period": 4})
    assert both["sent"] == pytest.approx(16 + 4000 / 3) and both["recv"] == pytest.approx(16 + 2 * 4000 / 3)
    assert expected_bytes("dasgd", d, 1) == {"sent": 0, "recv": 0}
    with pytest.raises(ValueError, match="synchronous"):
        expected_bytes("async_msgd", d, P)
    with pytest.raises(ValueError, match="groups"):
        expected_bytes("lsgd", d, P, groups=[2, 2])
