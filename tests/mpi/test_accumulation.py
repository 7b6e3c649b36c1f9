"""Gradient accumulation (``backward_passes_per_step=N``): the optimizer averages the N passes and the ranks.

Reference: one process's SGD on the mean gradient over every rank's and every
pass's batch, in float64.  Each case runs with overlap on and off, with the
built-in update and with ``inner=torch.optim.SGD``, with and without
``synchronize()`` (whose ``.grad`` must already be that mean).
"""

from __future__ import annotations

import io

import numpy as np
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


# -- resume with accumulation: the error feedback of topk and regtopk ---------------------------------------------------
def gpt_like_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 50))


def no_decay_groups(model):
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build(topology, algorithm, passes):
    """A model, DistributedOptimizer over inner AdamW with a no-decay group, and a warm-up schedule, as a user builds them."""
    model = gpt_like_model()
    opt = DistributedOptimizer(model.parameters(), algorithm, topology=topology, backward_passes_per_step=passes,
                               inner=torch.optim.AdamW(no_decay_groups(model), lr=1e-2), density=0.05)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 4))


def train_steps(model, opt, scheduler, rank, steps, passes, synchronize):
    for step in steps:
        for k in range(passes):
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + k)
            x, y = torch.randint(0, 50, (8, 4), generator=g), torch.randint(0, 50, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y)
            loss.backward()
        if synchronize:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(loss=loss)
        scheduler.step()
        opt.zero_grad(set_to_none=True)


def save_hdf5(directory, topology, model, opt, step):
    from mpiopt.checkpoint import checkpoint_path, save_checkpoint
    from mpiopt.training.optimizers import inner_state

    state = {"params": opt.flat_params.numpy().copy(), "algorithm": opt.algorithm.state_dict(), "inner": inner_state(opt.inner),
             "lr": np.array([group["lr"] for group in opt.param_groups])}
    return save_checkpoint(checkpoint_path(directory, step), topology.world, model=None, rank_state=state, attrs={"step": step})


def load_hdf5(path, topology, model, opt):
    from mpiopt.checkpoint import load_checkpoint
    from mpiopt.training.optimizers import load_inner_state

    state = load_checkpoint(path, topology.world).rank_state
    opt.algorithm.load_state_dict(state["algorithm"])
    load_inner_state(opt.inner, state["inner"])
    for group, lr in zip(opt.param_groups, state["lr"]):
        group["lr"] = float(lr)
    with torch.no_grad():
        opt.flat_params.copy_(torch.from_numpy(state["params"]))


@pytest.mark.parametrize("synchronize", [False, True], ids=["step", "synchronize"])
@pytest.mark.parametrize("algorithm", ["topk", "regtopk"])
def test_error_feedback_with_accumulation_resumes_bitwise(topology, shared_dir, algorithm, synchronize):
    passes, rank = 2, topology.rank
    model, opt, scheduler = build(topology, algorithm, passes)
    train_steps(model, opt, scheduler, rank, range(3), passes, synchronize)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scheduler": scheduler.state_dict()}, saved)
    path = save_hdf5(shared_dir, topology, model, opt, 3)
    train_steps(model, opt, scheduler, rank, range(3, 7), passes, synchronize)
    for route in ("torch.save", "hdf5"):
        again, opt2, scheduler2 = build(topology, algorithm, passes)  # built first, loaded after
        saved.seek(0)
        state = torch.load(saved)
        scheduler2.load_state_dict(state["scheduler"])
        if route == "torch.save":
            again.load_state_dict(state["model"])
            opt2.load_state_dict(state["opt"])
        else:
            load_hdf5(path, topology, again, opt2)
        train_steps(again, opt2, scheduler2, rank, range(3, 7), passes, synchronize)
        for got, want in zip(again.parameters(), model.parameters()):
            assert torch.equal(got, want), f"{route}: max difference {(got - want).abs().max().item()}"
