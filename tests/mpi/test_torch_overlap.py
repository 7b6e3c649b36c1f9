"""DistributedOptimizer(overlap=True): sgd's exchange in buckets during backward is bitwise the exchange after it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpiopt.torch import DistributedOptimizer  # noqa: E402
from mpiopt.torch.overlap import bucket_bounds  # noqa: E402

pytestmark = pytest.mark.mpi

#: 39 float32 elements: the model below then has three buckets (parameters {5, 4}, {3, 2}, {1, 0}).
SMALL_CAP_MB = 39 * 4 / 2**20
HYPER = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.1, momentum=0.9, dampening=0.1),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
}


class Net(torch.nn.Module):
    """Three layers; ``skip`` leaves the middle one out of the forward pass (its hooks never fire)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.first, self.middle, self.last = torch.nn.Linear(6, 12), torch.nn.Linear(12, 12), torch.nn.Linear(12, 3)

    def forward(self, x, skip: bool = False):
        h = torch.tanh(self.first(x))
        return self.last(h if skip else torch.tanh(self.middle(h)))


def loss_on(model, rank: int, step: int, skip: bool = False):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    return torch.nn.functional.cross_entropy(model(x, skip=skip), y)


def flat(model) -> "torch.Tensor":
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def train(topology, overlap, hyper, steps=5, passes=1, skip=lambda step: False, cap=SMALL_CAP_MB, **options):
    """Train a Net; returns its parameters, the step records, and the Iallreduce calls made before each step()."""
    model = Net()
    opt = DistributedOptimizer(
        model.parameters(), "sgd", topology=topology, overlap=overlap, bucket_cap_mb=cap,
        backward_passes_per_step=passes, **options, **hyper,
    )
    records, early = [], []
    for step in range(steps):
        opt.zero_grad()
        calls = topology.ledger["world.Iallreduce"].calls
        for k in range(passes):
            loss_on(model, topology.rank, passes * step + k, skip=skip(step)).backward()
        early.append(topology.ledger["world.Iallreduce"].calls - calls)
        opt.step()
        records.append(opt.last)
    return flat(model), records, early


def assert_same_training(topology, hyper, **kwargs):
    """Overlap on and off: bitwise the same parameters and the same bytes every step; returns the overlapped run."""
    want, plain_records, _ = train(topology, False, hyper, **kwargs)
    got, records, early = train(topology, True, hyper, **kwargs)
    assert torch.equal(got, want), f"max difference {(got - want).abs().max().item()}"
    assert [(r.bytes_sent, r.bytes_recv, r.step) for r in records] == [(r.bytes_sent, r.bytes_recv, r.step) for r in plain_records]
    if topology.size > 1:
        assert records[-1].bytes_sent == 4 * want.numel()  # the buckets add up to one Allreduce of the vector
    return got, records, early


def test_buckets_walk_the_parameters_backwards():
    assert bucket_bounds([72, 12, 144, 12, 36, 3], 40) == ([(228, 279), (84, 228), (0, 84)], [2, 2, 1, 0, 0, 0])
    assert bucket_bounds([5, 5], 1000) == ([(0, 10)], [0, 0])
    assert bucket_bounds([5, 5, 5], 1) == ([(10, 15), (5, 10), (0, 5)], [2, 1, 0])


@pytest.mark.parametrize("name", sorted(HYPER))
def test_overlap_is_bitwise_the_exchange_after_backward(topology, name):
    _, _, early = assert_same_training(topology, HYPER[name])
    assert early == [3] * 5  # all three buckets left during backward, none waited for step()


def test_one_bucket_by_default(topology):
    _, _, early = assert_same_training(topology, HYPER["nesterov"], cap=25.0)
    assert early == [1] * 5


def test_gradient_accumulation_sends_after_the_last_pass(topology):
    model = Net()
    opt = DistributedOptimizer(
        model.parameters(), "sgd", topology=topology, overlap=True, bucket_cap_mb=SMALL_CAP_MB, backward_passes_per_step=2, lr=0.1
    )
    before = topology.ledger["world.Iallreduce"].calls
    loss_on(model, topology.rank, 0).backward()
    assert topology.ledger["world.Iallreduce"].calls == before  # the first pass sends nothing
    loss_on(model, topology.rank, 1).backward()
    assert topology.ledger["world.Iallreduce"].calls == before + 3
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=2"):
        loss_on(model, topology.rank, 2).backward()
    opt.zero_grad()  # completes what was sent and starts afresh
    # Each bucket is divided by the pass count as the whole buffer is (3 does not divide exactly).
    assert_same_training(topology, HYPER["momentum"], passes=2)
    assert_same_training(topology, HYPER["plain"], passes=3, steps=3)


@pytest.mark.parametrize("who", ["every rank", "some ranks"])
def test_a_parameter_left_out_of_backward_is_sent_by_step(topology, who):
    """The middle layer (bucket 1) skips some steps: its bucket, and bucket 2 after it, wait for step()."""
    if who == "every rank":
        skip = lambda step: step % 2 == 1  # noqa: E731
    else:
        skip = lambda step: (step + topology.rank) % 2 == 1  # noqa: E731
    _, _, early = assert_same_training(topology, HYPER["nesterov"], steps=6, skip=skip)
    assert early == [1 if skip(step) else 3 for step in range(6)]  # bucket 2 cannot leave before bucket 1


def test_gradients_set_to_none_by_the_model_are_taken_back(topology):
    """model.zero_grad() sets .grad to None; the hooks put the new gradients into the flat buffer before sending."""
    want, _, _ = train(topology, False, HYPER["momentum"], steps=3)
    model = Net()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, overlap=True, bucket_cap_mb=SMALL_CAP_MB, **HYPER["momentum"])
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss_on(model, topology.rank, step).backward()
        assert all(p.grad is view for p, view in zip(model.parameters(), opt._grad_views))
        opt.step()
    assert torch.equal(flat(model), want)


def test_a_backward_without_step_is_discarded_by_zero_grad(topology):
    results = []
    for overlap in (False, True):
        model = Net()
        opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, overlap=overlap, bucket_cap_mb=SMALL_CAP_MB, lr=0.1)
        for step in range(3):
            loss_on(model, topology.rank, 100 + step).backward()  # thrown away
            opt.zero_grad()
            loss_on(model, topology.rank, step).backward()
            opt.step()
        results.append(flat(model))
    assert torch.equal(results[0], results[1])


def test_grad_scaler_is_bitwise_and_overflow_skips_on_every_rank(topology):
    """Steps 0-1 unscale the sums; after step 2 the scales differ (P > 1) and step 3 exchanges again, unscaled."""
    finals = []
    for overlap in (False, True):
        model = Net()
        opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, overlap=overlap, bucket_cap_mb=SMALL_CAP_MB, **HYPER["nesterov"])
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        for step in range(4):
            opt.zero_grad()
            overflow = step == 2 and topology.rank == topology.size - 1
            scaler.scale(loss_on(model, topology.rank, step) * (float("inf") if overflow else 1.0)).backward()
            scaler.step(opt)  # at step 2 the last rank overflowed: every rank skips, none hangs
            scaler.update()
        assert opt.algorithm.steps == 3
        finals.append(flat(model))
    assert torch.equal(finals[0], finals[1])


def test_unscaling_before_step_is_refused(topology):
    model = Net()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, overlap=True, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_on(model, topology.rank, 0)).backward()
    scaler.unscale_(opt)
    before = flat(model)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.step(opt)
    assert torch.equal(flat(model), before)


@pytest.mark.parametrize("change", ["clip", "replace", "unset"])
def test_changing_the_sent_gradient_before_step_is_refused_and_synchronize_is_its_place(topology, change):
    """Under overlap the gradient has left by the end of backward: clipping it (or replacing .grad) before step()
    would silently not be sent, so step() refuses, naming synchronize(); nothing is applied and the next step
    trains.  Clipping after synchronize() (the exchanged gradient) and with overlap=False (the own one) works."""
    def alter(model):
        if change == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        elif change == "replace":
            model.last.bias.grad = model.last.bias.grad * 0.5
        else:
            model.last.bias.grad = None

    model = Net()
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, overlap=True, bucket_cap_mb=SMALL_CAP_MB, lr=0.1)
    loss_on(model, topology.rank, 0).backward()
    alter(model)
    before = flat(model)
    with pytest.raises(RuntimeError, match="changed after backward.*Call opt.synchronize\\(\\) before changing it"):
        opt.step()
    assert torch.equal(flat(model), before) and opt.algorithm.steps == 0
    for step, synchronized in enumerate([True, False]):  # then the loop as it should be, and one without a change
        opt.zero_grad()
        loss_on(model, topology.rank, step).backward()
        if synchronized:
            opt.synchronize()
            alter(model)
        opt.step()
    assert opt.algorithm.steps == 2 and not torch.equal(flat(model), before)
    plain = Net()
    blocking = DistributedOptimizer(plain.parameters(), "sgd", topology=topology, overlap=False, lr=0.1)
    loss_on(plain, topology.rank, 0).backward()
    alter(plain)
    blocking.step()
    assert blocking.algorithm.steps == 1


def test_a_second_optimizer_takes_over_the_model(topology):
    """Hooks of an optimizer whose parameters moved to another optimizer's buffer remove themselves."""
    want, _, _ = train(topology, True, HYPER["plain"], steps=3)
    model = Net()
    first = DistributedOptimizer(model.parameters(), "sgd", topology=topology, overlap=True, bucket_cap_mb=SMALL_CAP_MB, lr=0.1)
    opt = DistributedOptimizer(model.parameters(), "sgd", topology=topology, overlap=True, bucket_cap_mb=SMALL_CAP_MB, **HYPER["plain"])
    for step in range(3):
        opt.zero_grad()
        loss_on(model, topology.rank, step).backward()
        opt.step()
    assert torch.equal(flat(model), want)
    assert first.algorithm.steps == 0


def test_bad_options_are_refused(topology):
    params = list(Net().parameters())
    with pytest.raises(ValueError, match="overlap=True needs .*'topk' does not"):
        DistributedOptimizer(params, "topk", topology=topology, overlap=True)
    with pytest.raises(TypeError, match="overlap must be a bool, got 'yes'"):
        DistributedOptimizer(params, "sgd", topology=topology, overlap="yes")
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0, got 0"):
        DistributedOptimizer(params, "sgd", topology=topology, overlap=True, bucket_cap_mb=0)
