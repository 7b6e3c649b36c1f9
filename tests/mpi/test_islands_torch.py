"""Islands through the torch front end: the island run is the per-rank run on the islands' union batches.

With or without the buckets that sum the island's gradient during backward, with an inner optimizer, with clipping
of the island's mean gradient (``synchronize()``), and through ``state_dict()``.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpiopt import Topology
from mpiopt.comm.islands import shard_counts

torch = pytest.importorskip("torch")
from mpiopt.torch import DistributedOptimizer  # noqa: E402

pytestmark = pytest.mark.mpi

STEPS, BATCH = 8, 4
CASES = {
    "diloco": dict(lr=0.05, momentum=0.9, period=3, outer_lr=0.7, outer_momentum=0.9),
    "sgd": dict(lr=0.1, momentum=0.9),
    "topk": dict(lr=0.1, density=0.3),
    "signum": dict(lr=0.01, momentum=0.9),
    "dasgd": dict(lr=0.05, period=3, delay_steps=1),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()


def _batch(rank: int, step: int):
    rng = np.random.default_rng([9, rank, step])
    return torch.from_numpy(rng.standard_normal((BATCH, 6))), torch.from_numpy(rng.integers(0, 3, BATCH))


def _union(island: int, G: int, step: int):
    parts = [_batch(r, step) for r in range(island * G, (island + 1) * G)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _train(opt, model, batches, clip=None):
    """Every step's flat parameters, stepping on ``batches(step)``."""
    seen = []
    for t in range(1, STEPS + 1):
        x, y = batches(t)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            if opt.algorithm.islands or opt.algorithm.inner_role == "gradient":  # else .grad is the worker's already
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step(loss=loss)
        seen.append(opt.flat_params.detach().clone().numpy())
    opt.finish()
    return seen


def _layout(world_size: int) -> int:
    """Islands of the largest size that leaves two islands or more (one island where there is one rank)."""
    return max(g for g in range(1, world_size + 1) if world_size % g == 0 and (g < world_size or world_size == 1))


def _compare(name, hyper, world_size, overlap=None, inner=None, clip=None):
    G = _layout(world_size)
    W = world_size // G
    topo = Topology(group_size=G)
    model = _model()
    opt = DistributedOptimizer(model.parameters(), name, topology=topo, islands=True, overlap=overlap,
                               inner=inner(model) if inner else None, **({} if inner else hyper))
    assert opt.overlap == (G > 1 if overlap is None and name != "topk" else bool(overlap))
    seen = _train(opt, model, lambda t: _batch(topo.rank, t), clip)
    islands = topo.world.allgather_obj(seen)[::G]
    few = topo.first(W)
    if few is not None:
        model = _model()
        opt = DistributedOptimizer(model.parameters(), name, topology=few, inner=inner(model) if inner else None,
                                   **({} if inner else hyper))
        want = _train(opt, model, lambda t: _union(few.rank, G, t), clip)
        for t, (got, expected) in enumerate(zip(islands[few.rank], want), start=1):
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=f"{name}: step {t}")
        few.Free()
    topo.Free()


@pytest.mark.parametrize("overlap", [None, False], ids=["buckets", "one-allreduce"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_island_run_is_the_per_rank_run_on_the_islands_union_batches(world_size, name, overlap):
    _compare(name, CASES[name], world_size, overlap=overlap)


def test_an_inner_adamw_steps_on_the_islands_mean(world_size):
    _compare("diloco", None, world_size, inner=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))


@pytest.mark.parametrize("name", ["diloco", "sgd"])
def test_clipping_after_synchronize_clips_the_islands_mean(world_size, name):
    _compare(name, CASES[name], world_size, clip=0.05)


def test_state_dict_resumes_an_island_run_bitwise(world_size):
    G = _layout(world_size)
    topo = Topology(group_size=G)
    model = _model()
    opt = DistributedOptimizer(model.parameters(), "diloco", topology=topo, islands=True, **CASES["diloco"])
    batches = lambda t: _batch(topo.rank, t)  # noqa: E731
    for t in range(1, 5):
        x, y = batches(t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    state, saved = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    rest = _train_from(opt, model, batches, 5)
    model2 = _model()
    model2.load_state_dict(saved)
    opt2 = DistributedOptimizer(model2.parameters(), "diloco", topology=topo, islands=True, **CASES["diloco"])
    model2.load_state_dict(saved)  # after the set-up's common start
    opt2.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(rest, _train_from(opt2, model2, batches, 5)))
    topo.Free()


def _train_from(opt, model, batches, first):
    seen = []
    for t in range(first, STEPS + 1):
        x, y = batches(t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        seen.append(opt.flat_params.detach().clone().numpy())
    return seen


@pytest.mark.parametrize("overlap", [None, False], ids=["buckets", "one-allreduce"])
def test_a_steps_record_counts_each_byte_once_at_its_level(world_size, overlap):
    """With islands of 2: every step the island's mean (4d) within; every period half the vector across the rails."""
    if world_size % 2:
        pytest.skip("islands of 2 need an even world")
    topo = Topology(group_size=2)
    model = _model()
    opt = DistributedOptimizer(model.parameters(), "diloco", topology=topo, islands=True, overlap=overlap, **CASES["diloco"])
    d, W = opt.flat_params.numel(), world_size // 2
    for t in range(1, 4):  # period 3: the third step exchanges
        x, y = _batch(topo.rank, t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        record = opt.last
        across = record.bytes_sent - record.island_bytes_sent
        half = 8 * shard_counts(d, 2)[topo.group.rank]  # float64: this rank's slice of the elements
        assert across == (half if t == 3 and W > 1 else 0), (t, across)
        assert record.island_bytes_sent == 8 * d + (half if t == 3 and W > 1 else 0), (t, record.island_bytes_sent)
    topo.Free()
