"""Gradient accumulation (``backward_passes_per_step=N``): the optimizer averages the N passes and the ranks.

Reference: one process's SGD on the mean gradient over every rank's and every
pass's batch, in float64.  Each case runs with overlap on and off, with the
built-in update and with ``inner=torch.optim.SGD``, with and without
``synchronize()`` (whose ``.grad`` must already be that mean).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpiopt.torch import DistributedOptimizer

pytestmark = pytest.mark.mpi
STEPS = 4
LR, MOMENTUM = 0.1, 0.9
TOLERANCE = dict(rtol=1e-12, atol=1e-14)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def batch(step: int, rank: int, k: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + k)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def mean_loss(model, step: int, size: int, passes: int):
    """The mean over ranks and passes of each batch's loss: its gradient is what every rank must apply."""
    losses = [F.cross_entropy(model(x), y) for r in range(size) for x, y in [batch(step, r, k) for k in range(passes)]]
    return sum(losses) / len(losses)


def reference(size: int, passes: int):
    """One process: torch.optim.SGD on the mean gradient; the parameters after each step and the gradients before it."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        mean_loss(model, step, size, passes).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return params, grads


@pytest.mark.parametrize("synchronize", [False, True], ids=["step", "synchronize"])
@pytest.mark.parametrize("inner", [False, True], ids=["builtin", "inner-sgd"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("passes", [2, 3])
def test_accumulated_passes_are_sgd_on_the_mean_over_ranks_and_passes(topology, passes, overlap, inner, synchronize):
    want_params, want_grads = reference(topology.size, passes)
    model = make_model()
    if inner:
        options = dict(inner=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    else:
        options = dict(lr=LR, momentum=MOMENTUM)
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, overlap=overlap, backward_passes_per_step=passes, **options)
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(passes):
            x, y = batch(step, topology.rank, k)
            F.cross_entropy(model(x), y).backward()  # the loss is not divided by the passes: the optimizer does it
        if synchronize:
            opt.synchronize()
            for got, want in zip(model.parameters(), want_grads[step]):
                torch.testing.assert_close(got.grad, want, **TOLERANCE)
        opt.step()
        for got, want in zip(model.parameters(), want_params[step]):
            torch.testing.assert_close(got.detach(), want, **TOLERANCE)
