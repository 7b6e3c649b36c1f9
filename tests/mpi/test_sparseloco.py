"""SparseLoCo against float64 re-computations of the paper's Algorithm 1 (``aggregate="ranks"``) and of its code's
per-entry mean over the senders (``"senders"``), its bytes against float32 DiLoCo, and what it declares (resume and resize: tests/mpi/test_codec_exchange.py, tests/unit/test_resize.py)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpiopt
from mpiopt.algorithms import algorithm_class
from mpiopt.codecs import create as create_codec
from mpiopt.comm.ledger import plan_bytes

pytestmark = pytest.mark.mpi

D, H, OUTER = 300, 3, 3
HYPER = dict(lr=0.05, momentum=0.9, period=H, outer_lr=0.8, codec_chunk=64, codec_k=8, codec_bits=2, codec_beta=0.95)


def _start(rank):
    return np.random.default_rng([21, rank]).standard_normal(D)


def _grad(rank, step):
    return np.random.default_rng([22, rank, step]).standard_normal(D)


def reference(size, aggregate="ranks"):
    """Algorithm 1 of arXiv:2508.15706 in float64, every rank at once: H inner momentum-SGD steps, Delta_r = theta -
    theta_r, e_r <- beta e_r + Delta_r, s_r = Q(TopK(e_r)), e_r <- e_r - s_r, theta <- theta - alpha mean_r s_r.

    ``aggregate="senders"``: the paper's code (tplr-ai SparseLoCo, ``scatter_reduce(reduce="mean", include_self=False)``
    over every rank's indices): each entry's mean over the ranks whose TopK picked it, 0 where none did."""
    codec = create_codec("topk", chunk=64, k=8, bits=2)
    quantized = lambda e: codec.decode(codec.encode(e), D, out=np.empty(D))  # Q(TopK(.)): what the payload carries
    theta = np.mean([_start(r) for r in range(size)], axis=0)
    local = [theta.copy() for _ in range(size)]
    momentum = [None] * size
    error = [np.zeros(D) for _ in range(size)]
    history = []
    for t in range(1, H * OUTER + 1):
        for r in range(size):
            g = _grad(r, t)
            momentum[r] = g if momentum[r] is None else 0.9 * momentum[r] + g
            local[r] = local[r] - 0.05 * momentum[r]
        if t % H == 0:
            sent, picked = [], np.zeros(D)
            for r in range(size):
                error[r] = 0.95 * error[r] + (theta - local[r])
                sent.append(quantized(error[r]))
                picked[codec.select(np, error[r])] += 1  # TopK's indices, sent whatever their quantized value
                error[r] = error[r] - sent[-1]
            mean = np.mean(sent, axis=0) if aggregate == "ranks" else np.sum(sent, axis=0) / np.maximum(picked, 1)
            theta = theta - 0.8 * mean
            local = [theta.copy() for _ in range(size)]
            history.append((theta.copy(), [e.copy() for e in error]))
    return history


@pytest.mark.parametrize("aggregate", ["ranks", "senders"])
def test_equals_a_float64_recomputation_of_the_paper_over_three_outer_steps(topology, aggregate):
    rank, size = topology.rank, topology.size
    alg = mpiopt.create("sparseloco", topology, **HYPER, aggregate=aggregate)
    params = _start(rank)  # float64 throughout: the codec then sends the accumulator's own top entries
    alg.setup(params)
    expected = reference(size, aggregate)
    for outer in range(OUTER):
        for t in range(outer * H + 1, (outer + 1) * H + 1):
            alg.step(params, _grad(rank, t))
        theta, errors = expected[outer]
        np.testing.assert_allclose(params, theta, rtol=0, atol=1e-12)
        np.testing.assert_allclose(alg.theta_start, theta, rtol=0, atol=1e-12)
        np.testing.assert_allclose(alg.codec_residual, errors[rank], rtol=0, atol=1e-12)
        assert alg.codec_residual.dtype == np.float64 and np.count_nonzero(errors[rank]) > D // 2
    assert alg.outer_steps == OUTER
    if aggregate == "senders" and size > 1:  # the rules differ where the ranks' picks differ
        assert np.abs(expected[-1][0] - reference(size, "ranks")[-1][0]).max() > 1e-3
    if size > 1:
        assert alg.ledger["world.Allgather"].calls == OUTER and "world.Allreduce" in alg.ledger  # only setup's mean


def test_bytes_per_outer_step_against_float32_diloco():
    """At d = 11M and 4 ranks: the issue's goal is at least 140x fewer bytes sent than float32 DiLoCo."""
    d, P = 11_000_000, 4
    cls, diloco = algorithm_class("sparseloco"), algorithm_class("diloco")
    ours = plan_bytes(cls.communication(d, P, {"period": 1}), P)
    theirs = plan_bytes(diloco.communication(d, P, {"period": 1}), P)
    assert ours == {"sent": 311_576, "recv": 3 * 311_576}  # docs/codecs.md: 116 bytes per chunk of 4,096
    assert theirs["sent"] / ours["sent"] >= 140


def test_declares_the_paper_s_recipe(topology):
    cls = algorithm_class("sparseloco")
    assert cls.evaluates == "average" and cls.inner_role == "local" and "2508.15706" in cls.__doc__
    defaults = cls.schema.defaults()
    assert (defaults["codec"], defaults["codec_chunk"], defaults["codec_k"], defaults["codec_bits"], defaults["codec_beta"]) == (
        "topk", 4096, 64, 2, 0.95)
    assert "outer_momentum" not in cls.schema and "codec_feedback" not in cls.schema  # the accumulator is the momentum
    with pytest.raises(TypeError, match="sparseloco has no hyperparameter 'outer_momentum'"):
        mpiopt.create("sparseloco", topology, outer_momentum=0.9)
    alg = mpiopt.create("sparseloco", topology)
    assert alg.hyperparameters() == {
        "period": 15, "outer_lr": 1.0, "codec": "topk", "codec_chunk": 4096, "codec_k": 64, "codec_bits": 2, "codec_beta": 0.95,
        "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0, "aggregate": "senders",
    }


def test_a_bad_aggregate_is_refused_on_every_rank_before_any_communication(topology):
    with pytest.raises(ValueError, match=r"aggregate must be one of 'senders', 'ranks'; got 'sum'") as caught:
        mpiopt.create("sparseloco", topology, aggregate="sum")
    assert topology.ledger.total().calls == 0  # refused in the constructor: nothing was sent
    assert len(set(MPI.COMM_WORLD.allgather(str(caught.value)))) == 1
