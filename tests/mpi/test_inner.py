"""Inner optimizers: every synchronous algorithm over a torch optimizer (AdamW first), synchronize() and clipping.

References: single-process AdamW on the mean gradient of every rank's batch,
torch DDP with AdamW, and each algorithm's own built-in update.  float64
models, so "to rounding" means a few ulps of float64.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpiopt
from mpiopt.algorithms import SYNCHRONOUS, algorithm_class, available
from mpiopt.torch import DistributedOptimizer

pytestmark = pytest.mark.mpi
STEPS = 6
ROUNDING = dict(rtol=1e-12, atol=1e-14)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def batches(size: int, steps: int = STEPS):
    """``steps`` batches for each of ``size`` ranks, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(size, 8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (size, 8), generator=g)) for _ in range(steps)]


def decay_groups(model: torch.nn.Module, decay: float = 0.1):
    """Weight decay on the weights, none on the biases: two parameter groups, as transformer recipes use."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": decay},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def train_reference(data, size: int, clip=None) -> torch.nn.Module:
    """One process, AdamW on the mean of every rank's loss (the gradient every data-parallel rank applies)."""
    model = make_model()
    opt = torch.optim.AdamW(decay_groups(model), lr=1e-2, betas=(0.9, 0.95))
    for xs, ys in data:
        opt.zero_grad()
        (sum(F.cross_entropy(model(xs[r]), ys[r]) for r in range(size)) / size).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def train_mpiopt(topology, data, algorithm="sgd", clip=None, **hyper) -> torch.nn.Module:
    model = make_model()
    inner = torch.optim.AdamW(decay_groups(model), lr=1e-2, betas=(0.9, 0.95))
    opt = DistributedOptimizer(model.parameters(), algorithm, topology=topology, inner=inner, **hyper)
    rank = topology.rank
    for xs, ys in data:
        opt.zero_grad()
        F.cross_entropy(model(xs[rank]), ys[rank]).backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def assert_close(model, reference, **tolerance):
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(mine.detach().numpy(), theirs.detach().numpy(), **(tolerance or ROUNDING))


@pytest.mark.parametrize("overlap", [False, True])
def test_sgd_with_adamw_is_adamw_on_the_mean_gradient(topology, overlap):
    """Also with the exchange overlapped with backward (buckets of 64 bytes: several per backward pass)."""
    data = batches(topology.size)
    assert_close(train_mpiopt(topology, data, overlap=overlap, bucket_cap_mb=64 / 2**20), train_reference(data, topology.size))


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.Adafactor, torch.optim.SGD], ids=lambda o: o.__name__)
def test_any_torch_optimizer_is_itself_on_the_mean_gradient(topology, optimizer):
    """Adam, Adafactor (a factored second moment: state shaped by each parameter, not by the flat buffer) and SGD."""
    data, rank, size = batches(topology.size), topology.rank, topology.size
    model, reference = make_model(), make_model()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=optimizer(model.parameters(), lr=1e-2))
    ref = optimizer(reference.parameters(), lr=1e-2)
    for xs, ys in data:
        opt.zero_grad()
        F.cross_entropy(model(xs[rank]), ys[rank]).backward()
        opt.step()
        ref.zero_grad()
        (sum(F.cross_entropy(reference(xs[r]), ys[r]) for r in range(size)) / size).backward()
        ref.step()
    assert_close(model, reference)
    assert len(opt.state_dict()["state"]) == len(ref.state)  # the inner optimizer's state (SGD without momentum: none)


@pytest.mark.parametrize("algorithm, hyper", [("sgd", {}), ("topk", {"density": 1.0}), ("regtopk", {"density": 1.0})])
def test_synchronize_then_clip_clips_the_exchanged_gradient(topology, algorithm, hyper):
    """At density 1 Top-k and RegTop-k send everything: all three exchange the mean, which is what gets clipped."""
    data = batches(topology.size)
    assert_close(train_mpiopt(topology, data, algorithm, clip=0.3, **hyper), train_reference(data, topology.size, clip=0.3))


def test_step_after_synchronize_exchanges_once(topology):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=torch.optim.AdamW(model.parameters()))
    d = sum(p.numel() for p in model.parameters())
    xs, ys = batches(topology.size, 1)[0]
    before = topology.ledger.snapshot()  # the exchange starts during backward (overlap, sgd's default)
    F.cross_entropy(model(xs[topology.rank]), ys[topology.rank]).backward()
    opt.synchronize()
    with pytest.raises(RuntimeError, match="synchronize\\(\\) was called twice"):
        opt.synchronize()
    opt.step()
    delta = topology.ledger.since(before)
    wire = 8 * d if topology.size > 1 else 0  # float64
    assert delta.bytes_sent == wire and opt.last.bytes_sent == wire and opt.algorithm.steps == 1


@pytest.mark.parametrize("clip", [None, 0.3])
def test_sgd_with_adamw_is_ddp_with_adamw(topology, clip):
    """With clipping too: after synchronize() mpiopt clips the exchanged gradient, as DDP's averaged one."""
    import torch.distributed as dist

    from mpiopt.training.ddp import init_gloo

    if not dist.is_initialized():
        init_gloo(topology)
    data = batches(topology.size)
    reference = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    opt = torch.optim.AdamW(decay_groups(reference), lr=1e-2, betas=(0.9, 0.95))
    for xs, ys in data:
        opt.zero_grad()
        F.cross_entropy(ddp(xs[topology.rank]), ys[topology.rank]).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        opt.step()
    assert_close(train_mpiopt(topology, data, clip=clip), reference)


def _torch_sgd_step(params: np.ndarray, hyper):
    """A torch.optim.SGD over a tensor sharing ``params``'s memory, as an inner step ``(params, grad)``."""
    weight = torch.nn.Parameter(torch.from_numpy(params))
    weight.grad = torch.zeros_like(weight)
    sgd = torch.optim.SGD([weight], lr=0.05, **hyper)

    def step(p, g):
        weight.grad.copy_(torch.from_numpy(g))
        sgd.step()

    return step


@pytest.mark.parametrize("name", [n for n in available(SYNCHRONOUS) if algorithm_class(n).inner_role])
def test_every_algorithm_with_inner_torch_sgd_is_its_builtin_update(topology, name):
    """To rounding, not bitwise: torch's CPU SGD computes ``a + alpha * b`` with a fused multiply-add that rounds
    once, where mpiopt's update rounds twice (mpiopt/kernels/update.py); what the built-in update fuses
    besides (DaSGD's merge, the division by the world size) is rounded the same when done apart."""
    extra = {"density": 0.3} if name in ("topk", "regtopk") else {}
    builtin = mpiopt.create(name, topology, lr=0.05, **extra)
    local = {k: v for k, v in builtin.hyperparameters().items() if k in ("momentum", "dampening", "nesterov", "weight_decay")}
    rng = np.random.default_rng([3, topology.rank])
    start = np.random.default_rng(5).standard_normal(301)
    grads = rng.standard_normal((12, 301))
    a, b = start.copy(), start.copy()
    builtin.setup(a)
    other = mpiopt.create(name, topology, **extra)
    other.use_inner(_torch_sgd_step(b, local), "SGD")
    other.setup(b)
    for step, g in enumerate(grads):
        builtin.step(a, g, loss=float(step % 3 + topology.rank))
        other.step(b, g, loss=float(step % 3 + topology.rank))
    other.finish(b)
    builtin.finish(a)
    np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)
    assert other.hyperparameters()["inner"] == "SGD" and other.momentum_buffer is None


def test_state_dict_with_an_inner_optimizer_resumes_bitwise(topology):
    data = batches(topology.size, 8)
    rank = topology.rank

    def run(model, opt, part):
        for xs, ys in part:
            opt.zero_grad()
            loss = F.cross_entropy(model(xs[rank]), ys[rank])
            loss.backward()
            opt.step(loss=loss)

    model = make_model()
    opt = DistributedOptimizer(model.parameters(), "lsgd", topology=topology, inner=torch.optim.AdamW(decay_groups(model)))
    run(model, opt, data[:4])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    run(model, opt, data[4:])
    buffer.seek(0)
    saved = torch.load(buffer)
    again = make_model()
    opt2 = DistributedOptimizer(again.parameters(), "lsgd", topology=topology, inner=torch.optim.AdamW(decay_groups(again)))
    again.load_state_dict(saved["model"])  # after the optimizer, which starts every rank from rank 0's parameters
    opt2.load_state_dict(saved["opt"])
    assert opt2.param_groups[1]["weight_decay"] == 0.0 and len(opt2.inner.state) == 4
    run(again, opt2, data[4:])
    assert_close(again, model, rtol=0, atol=0)


def test_bad_inner_optimizers_are_refused_on_every_rank(topology):
    model, other = make_model(), make_model()
    with pytest.raises(ValueError, match="inner optimizer AdamW holds other parameters"):
        DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=torch.optim.AdamW(other.parameters()))
    with pytest.raises(ValueError, match="sgd with inner=AdamW: lr, momentum belong to the inner optimizer"):
        DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=torch.optim.AdamW(model.parameters()), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="signum takes no inner optimizer: Signum is its own optimizer"):
        DistributedOptimizer(model.parameters(), "signum", topology=topology, inner=torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="inner must be a torch.optim.Optimizer"):
        DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner="adamw")
    lsgd = DistributedOptimizer(model.parameters(), "lsgd", topology=topology, inner=torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="lsgd exchanges parameters after the local step"):
        lsgd.synchronize()
    if topology.size > 1:
        served = make_model()
        with pytest.raises(TypeError, match="async_msgd takes no inner optimizer"):
            DistributedOptimizer(served.parameters(), "async_msgd", topology=topology, inner=torch.optim.SGD(served.parameters(), lr=0.1))


def test_an_inner_optimizer_over_other_tensors_is_refused_saying_what_differs(topology):
    import copy

    model = make_model()
    # Over a copy of the model: the same count, so the message must not read "4 against 4".
    with pytest.raises(ValueError, match=r"DistributedOptimizer's: the same number of parameters \(4\) but other tensors "
                                         r"\(was it created over a copy of the model\?\); create it over the same parameters"):
        DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=torch.optim.AdamW(copy.deepcopy(model).parameters()))
    with pytest.raises(ValueError, match=r"DistributedOptimizer's: 2 parameters against 4; create it over the same parameters"):
        DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=torch.optim.AdamW(model[0].parameters()))


# -- parameter groups with the built-in update ------------------------------------------------------------------------
def groups_of(model):
    """Decay and a Nesterov momentum on the weights; no decay, plain momentum and half the rate on the biases."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1, "momentum": 0.9, "nesterov": True},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "momentum": 0.5, "lr": 0.025}]


def test_builtin_groups_are_torch_sgd_with_those_groups(topology):
    """To rounding (torch's SGD uses a fused multiply-add); every group's setting changes the result."""
    data, rank = batches(topology.size), topology.rank
    model, reference = make_model(), make_model()
    opt = DistributedOptimizer(groups_of(model), "sgd", topology=topology, lr=0.05)
    ref = torch.optim.SGD(groups_of(reference), lr=0.05)
    for xs, ys in data:
        opt.zero_grad()
        F.cross_entropy(model(xs[rank]), ys[rank]).backward()
        opt.step()
        ref.zero_grad()
        (sum(F.cross_entropy(reference(xs[r]), ys[r]) for r in range(topology.size)) / topology.size).backward()
        ref.step()
    assert_close(model, reference)
    plain = make_model()
    single = DistributedOptimizer(plain.parameters(), "sgd", topology=topology, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)
    for xs, ys in data:
        single.zero_grad()
        F.cross_entropy(plain(xs[rank]), ys[rank]).backward()
        single.step()
    assert not np.allclose(plain[0].bias.detach().numpy(), model[0].bias.detach().numpy())


def test_inner_torch_sgd_with_groups_is_ddp_with_torch_sgd_bitwise_at_two_ranks(topology):
    """torch.optim.SGD's own bits with parameter groups: sgd over inner=torch.optim.SGD(groups) equals DDP + the
    same SGD bitwise where the two sums are the same (one and two ranks: a + b either way; DDP divides each
    gradient by 2 first, mpiopt the sum, the same bits for a power of two).  The built-in update equals it to
    rounding (torch's fused multiply-add; test_builtin_groups_are_torch_sgd_with_those_groups)."""
    import torch.distributed as dist

    from mpiopt.training.ddp import init_gloo

    if topology.size > 2:
        pytest.skip("gloo's and MPI's sums of more than two gradients differ in their order")
    if not dist.is_initialized():
        init_gloo(topology)
    data, rank = batches(topology.size), topology.rank
    model = make_model().float()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=torch.optim.SGD(groups_of(model), lr=0.05))
    reference = make_model().float()
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ref_opt = torch.optim.SGD(groups_of(reference), lr=0.05)
    for xs, ys in data:
        for net, optimizer in ((model, opt), (ddp, ref_opt)):
            optimizer.zero_grad()
            F.cross_entropy(net(xs[rank].float()), ys[rank]).backward()
            optimizer.step()
    assert_close(model, reference, rtol=0, atol=0)
    assert not torch.equal(model[0].weight, make_model().float()[0].weight)  # it trained


@pytest.mark.parametrize("name", [n for n in available(SYNCHRONOUS) if algorithm_class(n).inner_role])
def test_one_cycle_cycles_the_builtin_momentum_of_every_algorithm(topology, name):
    """OneCycleLR's default cycle_momentum=True needs momentum in the groups: each step's value reaches the update."""
    model = make_model()
    extra = {"density": 0.5} if name in ("topk", "regtopk") else {}
    opt = DistributedOptimizer(groups_of(model), name, topology=topology, **extra)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)
    rank = topology.rank
    local = opt.algorithm.local
    assert local.groups is not None and len(local.groups) == 2
    for xs, ys in batches(topology.size, 3):
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[rank]), ys[rank])
        loss.backward()
        asked = [(g["lr"], g["momentum"]) for g in opt.param_groups]
        opt.step(loss=loss)
        assert [(v["lr"], v["momentum"]) for v in local.group_values] == asked  # this step's, as the scheduler set them
        scheduler.step()
    opt.finish()
    assert asked[0][1] != 0.9 and asked[1][0] != 0.025  # the scheduler did move them


def test_autocast_bfloat16_and_a_compiled_model_with_an_inner_optimizer(topology):
    """bfloat16 autocast on CPU (float32 parameters: the flat buffers and the wire stay float32) and a torch.compile'd
    forward: the same steps as the inner optimizer (SGD with momentum: linear in the gradient, so bfloat16's rounding
    stays small; Adam's first steps are about lr times the gradient's sign) on the mean gradient under the same autocast."""
    data, rank, size = batches(topology.size, 3), topology.rank, topology.size

    def build():
        model = make_model().float()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, inner = build()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=inner)
    compiled = torch.compile(model, backend="eager")
    reference, ref_opt = build()
    for xs, ys in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(compiled(xs[rank].float()), ys[rank])
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total = sum(F.cross_entropy(reference(xs[r].float()), ys[r]) for r in range(size)) / size
        total.backward()
        ref_opt.step()
    assert opt.flat_params.dtype == torch.float32
    # bfloat16 products summed in another order (a mean of P losses against P separate backward passes): bfloat16's
    # rounding, a few parts in a thousand of a step, not float32's.
    assert_close(model, reference, rtol=0, atol=2e-3)
    with pytest.raises(TypeError, match="parameters must be float32 or float64, got torch.bfloat16"):
        DistributedOptimizer(make_model().bfloat16().parameters(), "sgd", topology=topology)


@pytest.mark.parametrize("clip", [None, 0.3])
def test_grad_scaler_with_an_inner_optimizer(topology, clip):
    """torch.amp.GradScaler over AdamW: the same bits as without a scaler (a power-of-two scale undone exactly), also
    when the exchanged gradient is unscaled and clipped after synchronize(); an overflow skips on every rank."""
    data, rank = batches(topology.size, 3), topology.rank
    scaled = make_model()
    inner = torch.optim.AdamW(decay_groups(scaled), lr=1e-2, betas=(0.9, 0.95))
    opt = DistributedOptimizer(scaled.parameters(), "sgd", topology=topology, inner=inner)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for xs, ys in data:
        opt.zero_grad()
        scaler.scale(F.cross_entropy(scaled(xs[rank]), ys[rank])).backward()
        if clip:
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(scaled.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    assert_close(scaled, train_mpiopt(topology, data, clip=clip), rtol=0, atol=0)
    before = opt.flat_params.clone()
    opt.zero_grad()
    loss = F.cross_entropy(scaled(data[0][0][rank]), data[0][1][rank])
    scaler.scale(loss * (float("inf") if rank == topology.size - 1 else 1.0)).backward()
    scaler.step(opt)  # the last rank overflowed: every rank skips, none hangs
    scaler.update()
    assert torch.equal(opt.flat_params, before)


def test_float16_autocast_and_grad_scaler_on_cpu_are_ddp_with_the_same_recipe(topology):
    """The CUDA recipe (float16 autocast, GradScaler, inner AdamW, float32 parameters) on CPU, against torch DDP +
    AdamW with torch's GradScaler: a scale of 2**20 overflows float16's backward on some steps; with
    mpiopt.torch.GradScaler both skip the same steps and keep the same scales; the parameters agree to float32
    rounding (the ranks' float32 gradients summed in MPI's order and in gloo's)."""
    import torch.distributed as dist

    from mpiopt.training.ddp import init_gloo

    if not dist.is_initialized():
        init_gloo(topology)
    data, rank = batches(topology.size, 8), topology.rank

    def run(model, opt, forward, scaler):
        scales = []
        for xs, ys in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(forward(xs[rank].float()), ys[rank])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    model = make_model().float()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=torch.optim.AdamW(decay_groups(model), lr=1e-2))
    scales = run(model, opt, model, mpiopt.torch.GradScaler("cpu", init_scale=2.0**20))
    reference = make_model().float()
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ref_opt = torch.optim.AdamW(decay_groups(reference), lr=1e-2)
    assert run(reference, ref_opt, ddp, torch.amp.GradScaler("cpu", init_scale=2.0**20)) == scales
    assert min(scales) < 2.0**20 and len(set(scales)) > 1  # some steps overflowed, and others were taken
    assert_close(model, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("agreeing", [True, False], ids=["mpiopt-scaler", "torch-scaler"])
def test_an_overflow_on_one_rank_backs_off_every_ranks_scale_with_mpiopts_scaler(topology, agreeing):
    """torch's scaler backs off only the overflowing rank's scale (every rank still skips); the next step then warns,
    naming mpiopt.torch.GradScaler, whose scales stay equal on every rank, as DDP's."""
    import warnings

    if topology.size == 1:
        pytest.skip("an overflow on some ranks only needs two ranks")
    data, rank = batches(topology.size, 2), topology.rank
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=torch.optim.AdamW(model.parameters()))
    scaler = (mpiopt.torch.GradScaler if agreeing else torch.amp.GradScaler)("cpu", init_scale=2.0**10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (xs, ys) in enumerate(data):
            opt.zero_grad()
            before = opt.flat_params.clone()
            overflow = step == 0 and rank == topology.size - 1
            scaler.scale(F.cross_entropy(model(xs[rank]), ys[rank]) * (float("inf") if overflow else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            assert torch.equal(opt.flat_params, before) == (step == 0)  # every rank skipped the step, and only it
    scales = topology.world.allgather_obj(scaler.get_scale())
    messages = [str(w.message) for w in caught if "different scales" in str(w.message)]
    if agreeing:
        assert scales == [2.0**9] * topology.size and messages == []
    else:
        assert sorted(scales) == [2.0**9] + [2.0**10] * (topology.size - 1)
        assert len(messages) == 1 and "use mpiopt.torch.GradScaler" in messages[0] and "sends the gradient twice" in messages[0]


@pytest.mark.parametrize("scaler_class", ["mpiopt", "torch"])
@pytest.mark.parametrize("algorithm, hyper", [("sgd", {"overlap": False}), ("topk", {"density": 0.3}), ("regtopk", {"density": 0.3})])
def test_an_overflow_around_synchronize_is_the_scalers_to_skip(topology, algorithm, hyper, scaler_class):
    """scaler.unscale_(opt) (before synchronize() for Top-k and RegTop-k, whose error feedback keeps what was not sent
    in the units it was sent in; either side for sgd), clipping, scaler.step(opt): an overflow on one rank (inf in
    its scaled gradient) makes every rank skip the exchange without touching its state, leaves a non-finite
    exchanged gradient on every rank (as a sum would), and every rank skips the step and backs off, with torch's
    scaler too; the run then equals the one that never saw that batch (a power-of-two scale is undone exactly).
    Before, synchronize() ended the job with a non-finite gradient under nan_policy='raise'."""
    data, rank = batches(topology.size, 4), topology.rank
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), algorithm, topology=topology, inner=torch.optim.AdamW(decay_groups(model), lr=1e-2, betas=(0.9, 0.95)), **hyper)
    scaler = (mpiopt.torch.GradScaler if scaler_class == "mpiopt" else torch.amp.GradScaler)("cpu", init_scale=2.0**10)
    for step, (xs, ys) in enumerate(data):
        opt.zero_grad()
        overflow = step == 1 and rank == topology.size - 1
        scaler.scale(F.cross_entropy(model(xs[rank]), ys[rank]) * (float("inf") if overflow else 1.0)).backward()
        if algorithm == "sgd":
            opt.synchronize()
            scaler.unscale_(opt)
        else:
            scaler.unscale_(opt)
            opt.synchronize()
        assert bool(torch.isfinite(torch.cat([p.grad.flatten() for p in model.parameters()])).all()) == (step != 1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        scaler.step(opt)
        scaler.update()
    assert opt.algorithm.steps == 3
    if algorithm == "sgd" or scaler_class == "mpiopt":  # torch's scaler unscaling the own gradient backs off the culprit only
        assert topology.world.allgather_obj(scaler.get_scale()) == [2.0**9] * topology.size
    assert_close(model, train_mpiopt(topology, data[:1] + data[2:], algorithm, clip=0.3, **hyper), rtol=0, atol=0)


@pytest.mark.parametrize("unscale", [True, False], ids=["unscale_-after", "no-unscale_"])
def test_a_loss_scaled_exchange_with_error_feedback_is_refused(topology, unscale):
    """Top-k's exchange after scaling but before unscaling would keep its error feedback in scaled units: refused."""
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), "topk", topology=topology, inner=torch.optim.AdamW(model.parameters()), density=0.5)
    scaler = mpiopt.torch.GradScaler("cpu", init_scale=2.0**10)
    xs, ys = batches(topology.size, 1)[0]
    scaler.scale(F.cross_entropy(model(xs[topology.rank]), ys[topology.rank])).backward()
    opt.synchronize()
    before = opt.flat_params.clone()
    with pytest.raises(RuntimeError, match="topk exchanged a loss-scaled gradient.*call scaler.unscale_\\(opt\\) before opt.synchronize\\(\\)"):
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
    assert torch.equal(opt.flat_params, before)


def test_a_non_finite_gradient_after_synchronize_without_a_scaler_names_the_rank():
    """No scaler to call it an overflow: step() ends the job under nan_policy='raise', every rank naming the rank at fault."""
    topology = mpiopt.Topology(abort_on_error=False)
    if topology.size == 1:
        topology.Free()
        pytest.skip("a rank at fault among others needs two ranks")
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), "topk", topology=topology, inner=torch.optim.AdamW(model.parameters()), density=0.5)
    xs, ys = batches(topology.size, 1)[0]
    culprit = topology.size - 1
    (F.cross_entropy(model(xs[topology.rank]), ys[topology.rank]) * (float("nan") if topology.rank == culprit else 1.0)).backward()
    opt.synchronize()
    with pytest.raises(FloatingPointError, match=f"topk: non-finite gradient on rank {culprit} at step 1"):
        opt.step()
    topology.Free()


def test_grad_scaler_on_cuda_with_float16_autocast(topology):
    """The CUDA recipe: float16 autocast, mpiopt.torch.GradScaler("cuda"), inner AdamW on CUDA parameters.  Scaled and unscaled
    float32 runs agree bitwise (a power-of-two scale undone exactly); under float16 autocast the loss falls; an
    overflow on one rank skips the step on every rank.  Runs where torch sees a GPU and cupy is installed."""
    from mpiopt.kernels._backend import array_modules

    if not torch.cuda.is_available() or len(array_modules()) < 2:
        pytest.skip("no CUDA GPU with cupy on this machine (the CUDA GradScaler runs on a GPU machine only)")
    data, rank = batches(topology.size, 4), topology.rank

    def run(scale, autocast, data):
        model = make_model().float().cuda()
        opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, inner=torch.optim.AdamW(model.parameters(), lr=1e-2))
        scaler = mpiopt.torch.GradScaler("cuda", init_scale=2.0**10, enabled=scale)
        losses = []
        for xs, ys in data:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
                loss = F.cross_entropy(model(xs[rank].float().cuda()), ys[rank].cuda())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss))
        return model, opt, scaler, losses

    scaled, _, _, _ = run(True, False, data)
    plain, _, _, _ = run(False, False, data)
    assert_close(scaled.cpu(), plain.cpu(), rtol=0, atol=0)
    model, opt, scaler, losses = run(True, True, data[:1] * 8)  # one batch again and again: its loss must fall
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    before = opt.flat_params.clone()
    opt.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(data[0][0][rank].float().cuda()), data[0][1][rank].cuda())
    scaler.scale(loss * (float("inf") if rank == topology.size - 1 else 1.0)).backward()
    scaler.step(opt)  # the last rank overflowed: every rank skips, none hangs
    assert torch.equal(opt.flat_params, before)
