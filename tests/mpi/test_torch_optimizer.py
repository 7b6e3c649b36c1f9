"""mpiopt.torch.DistributedOptimizer: the torch layer adds no math, and sgd is torch.optim.SGD on the mean gradient."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mpiopt  # noqa: E402
from mpiopt.algorithms import SYNCHRONOUS, available  # noqa: E402
from mpiopt.torch import DistributedOptimizer, average_buffers, broadcast_module  # noqa: E402

pytestmark = pytest.mark.mpi

SYNC = {
    "sgd": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "easgd": dict(lr=0.05, period=2, momentum=0.5),
    "lsgd": dict(lr=0.05, period=2, global_period=4),
    "dasgd": dict(lr=0.05, period=3, delay_steps=1),
    "signum": dict(lr=0.01),
    "topk": dict(lr=0.05, density=0.2),
    "regtopk": dict(lr=0.05, density=0.2),
}
# Every synchronous algorithm with each of its state arrays in use after SAVE_AFTER steps: momentum wherever it is
# optional, lsgd's proximal pull (its leader copy), and in flight dasgd's averaging (started after step 6, merged
# after step 7) and streaming_diloco's fragment 0 (started after step 6, merged after step 8); a codec's residual
# (and dasgd's last average) wherever an algorithm takes one.
RESUMED = {
    **SYNC,
    "sgd": dict(SYNC["sgd"], codec="int8", codec_chunk=16),
    "easgd": dict(SYNC["easgd"], codec="fp4", codec_chunk=16),
    "dasgd": dict(SYNC["dasgd"], codec="int4", codec_chunk=16),
    "lsgd": dict(lr=0.05, period=2, global_period=4, momentum=0.5, proximal=0.1),
    "topk": dict(lr=0.05, density=0.2, momentum=0.5),
    "regtopk": dict(lr=0.05, density=0.2, momentum=0.5),
    "diloco": dict(lr=0.05, period=4, momentum=0.5, codec="topk", codec_chunk=16, codec_k=4),
    "streaming_diloco": dict(lr=0.05, period=6, fragments=2, overlap_steps=2, momentum=0.5, codec="sign", codec_chunk=16),
    "sparseloco": dict(lr=0.05, period=4, momentum=0.5, codec_chunk=16, codec_k=4),
}
SAVE_AFTER, STEPS = 6, 12


def make_model(seed: int) -> "torch.nn.Module":
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def batch(rank: int, step: int, size: int = 16):
    """A deterministic batch of rank ``rank`` at ``step`` (every rank can compute every rank's batch)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("name", sorted(SYNC))
def test_torch_layer_adds_no_math(topology, name):
    """Training through DistributedOptimizer == driving the flat API with the same gradients, bitwise."""
    model = make_model(seed=topology.rank)  # different seeds: the constructor's broadcast must equalise
    opt = DistributedOptimizer(model.parameters(), name, topology=topology, **SYNC[name])
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
    reference = mpiopt.create(name, topology, **SYNC[name])
    reference.setup(flat)
    for step in range(9):
        opt.zero_grad()
        loss = loss_of(model, *batch(topology.rank, step))
        loss.backward()
        grad = torch.nn.utils.parameters_to_vector(p.grad for p in model.parameters()).numpy().copy()
        opt.step(loss=loss)
        reference.step(flat, grad, loss=loss.item())
        assert opt.last.bytes_sent == reference.last.bytes_sent
    opt.finish()
    reference.finish(flat)
    got = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    assert np.array_equal(got, flat), f"{name}: max difference {np.abs(got - flat).max()}"
    assert np.array_equal(opt._params_array, flat)


def test_ranks_seeded_differently_start_identical(topology):
    model = make_model(seed=17 + topology.rank)
    DistributedOptimizer(model.parameters(), "sgd", topology=topology, lr=0.1)
    mine = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    everyone = topology.world.allgather_obj(mine)
    expected = torch.nn.utils.parameters_to_vector(make_model(seed=17).parameters()).detach().numpy()
    for theirs in everyone:
        assert np.array_equal(theirs, expected)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_equals_torch_sgd_on_the_mean_gradient(topology, nesterov):
    """Each rank on its own shard == one process stepping torch.optim.SGD with the ranks' mean gradient."""
    P = topology.size
    hyper = dict(lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=1e-2)
    model = make_model(seed=3)
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, **hyper)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ref_model = make_model(seed=3)
    ref_opt = torch.optim.SGD(ref_model.parameters(), **hyper)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4, gamma=0.5)
    for step in range(10):
        opt.zero_grad()
        loss_of(model, *batch(topology.rank, step)).backward()
        opt.step()
        assert opt.algorithm.lr == ref_opt.param_groups[0]["lr"]  # the scheduler's rate reached the algorithm
        scheduler.step()
        ref_opt.zero_grad()
        mean_loss = sum(loss_of(ref_model, *batch(r, step)) for r in range(P)) / P
        mean_loss.backward()
        ref_opt.step()
        ref_scheduler.step()
    got = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    want = torch.nn.utils.parameters_to_vector(ref_model.parameters()).detach()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_equals_the_doubled_batch(topology):
    P = topology.size
    model = make_model(seed=5)
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, backward_passes_per_step=2, lr=0.1, momentum=0.9)
    ref_model = make_model(seed=5)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        opt.zero_grad()
        for half in range(2):
            loss_of(model, *batch(topology.rank, 2 * step + half)).backward()
        opt.step()
        ref_opt.zero_grad()
        losses = []
        for r in range(P):
            x0, y0 = batch(r, 2 * step)
            x1, y1 = batch(r, 2 * step + 1)
            losses.append(loss_of(ref_model, torch.cat([x0, x1]), torch.cat([y0, y1])))
        (sum(losses) / P).backward()
        ref_opt.step()
    torch.testing.assert_close(
        torch.nn.utils.parameters_to_vector(model.parameters()).detach(),
        torch.nn.utils.parameters_to_vector(ref_model.parameters()).detach(),
        rtol=1e-5, atol=1e-6,
    )


def test_gradients_stay_views_of_the_flat_buffer(topology):
    model = make_model(seed=0)
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, lr=0.1)
    loss_of(model, *batch(0, 0)).backward()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert not opt._flat_grads.any()
    # A gradient the user replaced is taken into the flat buffer at the next step.
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    before = first.detach().clone()
    opt.step()
    assert opt._flat_grads[: first.numel()].eq(1).all()
    torch.testing.assert_close(first.detach(), before - 0.1)


def test_unsupported_groups_are_refused(topology):
    model = make_model(seed=0)
    first, second = list(model.children())[0], list(model.children())[2]
    # Per-group settings ride in the built-in SGD update (tests/mpi/test_inner.py); signum has none, and no
    # algorithm takes another optimizer's keywords without inner=.
    with pytest.raises(ValueError, match="parameter group 1 sets \\['weight_decay'\\]: signum takes one set"):
        DistributedOptimizer(
            [{"params": first.parameters()}, {"params": second.parameters(), "weight_decay": 0.1}], "signum", topology=topology
        )
    with pytest.raises(ValueError, match="parameter group 1 sets \\['betas'\\]: sgd's built-in update takes lr, momentum"):
        DistributedOptimizer([{"params": first.parameters()}, {"params": second.parameters(), "betas": (0.9, 0.99)}], "sgd", topology=topology)
    with pytest.raises(ValueError, match="different learning rates"):
        DistributedOptimizer([{"params": first.parameters(), "lr": 0.1}, {"params": second.parameters(), "lr": 0.2}], "signum", topology=topology)
    second.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="does not require grad"):
        DistributedOptimizer(model.parameters(), "sgd", topology=topology)
    with pytest.raises(ValueError, match="unknown algorithm 'adamw'"):
        DistributedOptimizer(first.parameters(), "adamw", topology=topology)
    with pytest.raises(TypeError, match=r"^diloco has no hyperparameter 'perido' \(did you mean 'period'\?\); it takes lr, "):
        DistributedOptimizer(first.parameters(), "diloco", topology=topology, perido=2)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        DistributedOptimizer(first.parameters(), "sgd", topology=topology, backward_passes_per_step=0)


def test_step_and_run_are_refused_where_they_do_not_apply(topology):
    opt = DistributedOptimizer(make_model(0).parameters(), "async_msgd", topology=topology)
    with pytest.raises(TypeError, match="asynchronous: train with opt.run"):
        opt.step()
    opt = DistributedOptimizer(make_model(0).parameters(), "sgd", topology=topology)
    with pytest.raises(TypeError, match="synchronous"):
        opt.run(lambda step: None, 1)


def test_lsgd_without_a_loss_names_the_torch_call():
    # Without the abort (by default a rank missing its loss ends the job) every rank raises the error.
    quiet = mpiopt.Topology(abort_on_error=False)
    model = make_model(0)
    opt = DistributedOptimizer(model.parameters(), "lsgd", topology=quiet)
    loss_of(model, *batch(quiet.rank, 0)).backward()
    with pytest.raises(ValueError, match=r"^lsgd: step\(\) needs this rank's training loss \(opt.step\(loss=loss\)\): the lowest"):
        opt.step()
    quiet.Free()


def _train(topology, model, opt, steps):
    for step in steps:
        opt.zero_grad()
        loss = loss_of(model, *batch(topology.rank, step))
        loss.backward()
        opt.step(loss=loss)


def _resumed(topology, name, model_state, opt_state):
    """A fresh model and optimizer restored from the states saved after SAVE_AFTER steps, trained to STEPS."""
    model = make_model(2)
    opt = DistributedOptimizer(model.parameters(), name, topology=topology, **RESUMED[name])
    model.load_state_dict(model_state)  # after the optimizer, which starts every rank from rank 0's parameters
    opt.load_state_dict(opt_state)
    _train(topology, model, opt, range(SAVE_AFTER, STEPS))
    opt.finish()
    return model


@pytest.mark.parametrize("name", available(SYNCHRONOUS))
def test_state_dict_through_torch_save_and_load_resumes_bitwise(topology, name):
    """``torch.save(opt.state_dict())`` and ``torch.load`` with its default ``weights_only=True`` (torch >= 2.6) resume
    every synchronous algorithm bitwise; so does the earlier form of the state, its arrays numpy arrays."""
    model = make_model(1)
    opt = DistributedOptimizer(model.parameters(), name, topology=topology, **RESUMED[name])
    _train(topology, model, opt, range(SAVE_AFTER))
    state, earlier = opt.state_dict(), {"algorithm": opt.algorithm.state_dict()}
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    assert state["param_groups"][0]["params"] == list(range(4)) and state["param_groups"][0]["lr"] == RESUMED[name]["lr"]
    arrays = state["mpiopt"]["algorithm"]["arrays"]
    assert all(isinstance(a, torch.Tensor) for a in arrays.values()), {k: type(a).__name__ for k, a in arrays.items()}
    _train(topology, model, opt, range(SAVE_AFTER, STEPS))
    opt.finish()
    # Written only now: the state taken after step SAVE_AFTER must not have followed the training since.
    buffer = io.BytesIO()
    torch.save({"model": saved_model, "opt": state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    resumed = _resumed(topology, name, loaded["model"], loaded["opt"])
    old_form = {**state, "mpiopt": {**state["mpiopt"], **earlier}}
    resumed_from_old_form = _resumed(topology, name, saved_model, old_form)
    for a, b, c in zip(model.parameters(), resumed.parameters(), resumed_from_old_form.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_batchnorm_buffers_are_averaged(topology):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5))
    DistributedOptimizer(model.parameters(), "sgd", topology=topology)
    broadcast_module(model, topology)
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(topology.rank)) * (1 + topology.rank))
    bn = model[1]
    mine = (bn.running_mean.clone().numpy(), bn.running_var.clone().numpy())
    everyone = topology.world.allgather_obj(mine)
    average_buffers(model, topology)
    np.testing.assert_allclose(bn.running_mean.numpy(), np.mean([m for m, _ in everyone], axis=0), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(bn.running_var.numpy(), np.mean([v for _, v in everyone], axis=0), rtol=1e-6)
    assert int(bn.num_batches_tracked) == 1
    if topology.size > 1:
        assert not np.array_equal(everyone[0][0], everyone[-1][0])  # they did differ before


def test_grad_scaler_is_bitwise_and_overflow_skips_on_every_rank(topology):
    model = make_model(seed=4)
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, lr=0.1, momentum=0.9)
    ref_model = make_model(seed=4)
    ref = DistributedOptimizer(ref_model.parameters(), "sgd", topology=topology, lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(loss_of(model, *batch(topology.rank, step))).backward()
        scaler.step(opt)
        scaler.update()
        ref.zero_grad()
        loss_of(ref_model, *batch(topology.rank, step)).backward()
        ref.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)  # scaling by a power of two and back is exact
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    steps_before = opt.algorithm.steps
    opt.zero_grad()
    loss = loss_of(model, *batch(topology.rank, 9))
    scaler.scale(loss * (float("inf") if topology.rank == topology.size - 1 else 1.0)).backward()
    scaler.step(opt)  # the last rank overflowed: every rank must skip, none may hang
    scaler.update()
    assert opt.algorithm.steps == steps_before
    assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()).detach(), before)


def test_async_run_trains_and_leaves_every_rank_identical(topology):
    model = make_model(seed=topology.rank)
    opt = DistributedOptimizer(model.parameters(), "async_msgd", topology=topology, lr=0.05, momentum=0.5)
    calls = []

    def compute(step):
        calls.append(step)
        loss = loss_of(model, *batch(topology.rank, step))
        loss.backward()
        return loss

    result = opt.run(compute, 6)
    assert result.version == 6 * max(1, topology.size - 1)
    assert calls == ([] if topology.rank == 0 and topology.size > 1 else list(range(6)))
    final = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
    for theirs in topology.world.allgather_obj(final):
        assert np.array_equal(theirs, final)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_parameters_live_in_one_device_buffer(topology):
    pytest.importorskip("cupy", reason="the GPU path needs cupy")
    torch.cuda.set_device(topology.group.rank % torch.cuda.device_count())
    model = make_model(seed=0).cuda()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, lr=0.1)
    ref = make_model(seed=0)
    ref_opt = DistributedOptimizer(ref.parameters(), "sgd", topology=topology, lr=0.1)
    for step in range(3):
        for m, o, device in ((model, opt, "cuda"), (ref, ref_opt, "cpu")):
            o.zero_grad()
            x, y = batch(topology.rank, step)
            loss_of(m, x.to(device), y.to(device)).backward()
            o.step()
    assert opt.flat_params.is_cuda
    torch.testing.assert_close(
        torch.nn.utils.parameters_to_vector(model.parameters()).cpu(), torch.nn.utils.parameters_to_vector(ref.parameters()),
        rtol=1e-5, atol=1e-6,
    )
