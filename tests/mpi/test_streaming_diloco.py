"""Streaming DiLoCo: one fragment without overlap is diloco, the sim twin with overlap, the schedule, resume, validation.

Each runs in both layouts where the layout could matter: contiguous slices and strided blocks.
"""

import numpy as np
import pytest

import mpiopt
from mpiopt.comm import Comm, SetupMismatchError
from mpiopt.algorithms.streaming_diloco import fragment_blocks, fragment_bounds, fragment_offsets, fragment_sizes
from mpiopt.checkpoint.layout import first_difference
from mpiopt.comm.ledger import plan_bytes
from mpiopt.sim.streaming_diloco import simulate

pytestmark = pytest.mark.mpi


def _grad(rank, step, n):
    return np.random.default_rng([11, rank, step]).standard_normal(n).astype(np.float32)


def _initial(rank, n):
    return np.random.default_rng([5, rank]).standard_normal(n).astype(np.float32)


STRIDED = dict(layout="strided", stride_blocks=3)


@pytest.mark.parametrize("layout", [{}, STRIDED], ids=["contiguous", "strided"])
def test_one_fragment_no_overlap_no_mixing_is_diloco_bitwise(topology, layout):
    rank, n = topology.rank, 33
    common = dict(lr=0.05, momentum=0.9, period=3, outer_lr=0.7, outer_momentum=0.9)
    a = mpiopt.create("streaming_diloco", topology, fragments=1, overlap_steps=0, alpha=0.0, **layout, **common)
    b = mpiopt.create("diloco", topology, **common)
    pa, pb = _initial(rank, n), _initial(rank, n)
    a.setup(pa)
    b.setup(pb)
    for t in range(1, 11):
        a.step(pa, _grad(rank, t, n))
        b.step(pb, _grad(rank, t, n))
        assert np.array_equal(pa, pb), t


@pytest.mark.parametrize("fragments, tau, alpha, momentum, layout", [
    (3, 2, 0.5, 0.9, {}), (2, 1, 0.0, 0.0, {}), (4, 3, 1.0, 0.9, {}), (1, 0, 0.3, 0.9, {}),
    (3, 2, 0.5, 0.9, STRIDED), (2, 1, 0.0, 0.0, dict(layout="strided", stride_blocks=5)), (4, 0, 0.3, 0.9, STRIDED),
], ids=lambda v: v.get("layout", "contiguous") if isinstance(v, dict) else str(v))
def test_against_the_sim_twin(topology, fragments, tau, alpha, momentum, layout):
    rank, size, n, steps, period = topology.rank, topology.size, 29, 17, 4
    hyper = dict(lr=0.05, momentum=momentum, period=period, fragments=fragments, overlap_steps=tau, alpha=alpha,
                 outer_lr=0.7, outer_momentum=0.9, **layout)
    alg = mpiopt.create("streaming_diloco", topology, **hyper)
    params = _initial(rank, n)
    alg.setup(params)
    for t in range(1, steps + 1):
        alg.step(params, _grad(rank, t, n))
    alg.finish(params)
    ref = simulate([_initial(r, n) for r in range(size)], lambda r, t, x: _grad(r, t, n), steps, **hyper)
    # float32 against float64 over 17 steps of O(1) values: a few float32 ulps.
    err = np.abs(params - ref[rank]).max() / (1 + np.abs(ref[rank]).max())
    assert err < 1e-5, err
    assert not alg.in_flight and not alg.merge_steps.any()


def test_strided_fragments_partition_the_buffer():
    """Block i of the F k near-equal blocks goes to fragment i mod F: every position in exactly one fragment."""
    assert fragment_blocks(10, 2, 2) == [[(0, 2), (5, 7)], [(2, 5), (7, 10)]]
    for d, fragments, k in [(100, 3, 4), (1001, 3, 5), (12, 4, 3), (37, 1, 8)]:
        blocks = fragment_blocks(d, fragments, k)
        assert all(len(b) == k and all(hi > lo for lo, hi in b) for b in blocks)
        positions = np.concatenate([np.arange(lo, hi) for b in blocks for lo, hi in b])
        assert np.array_equal(np.sort(positions), np.arange(d))
        assert sum(fragment_sizes(d, fragments, "strided", k)) == d
        assert max(fragment_sizes(d, fragments, "strided", k)) - min(fragment_sizes(d, fragments, "strided", k)) <= k


@pytest.mark.parametrize("layout", [{}, dict(layout="strided", stride_blocks=4)], ids=["contiguous", "strided"])
def test_schedule_and_bytes_per_step_follow_the_fragments(topology, layout):
    rank, size, n, period, fragments = topology.rank, topology.size, 100, 6, 3
    alg = mpiopt.create("streaming_diloco", topology, period=period, fragments=fragments, overlap_steps=2, lr=0.01, **layout)
    params = _initial(rank, n)
    alg.setup(params)
    bounds, offsets = fragment_bounds(n, fragments), fragment_offsets(period, fragments)
    assert bounds == [(0, 33), (33, 66), (66, 100)] and offsets == [0, 2, 4]
    if layout:  # the index arrays the exchanges gather with: each position once, in its block's fragment
        owner = np.concatenate([np.full(b - a, i % fragments) for i, (a, b) in enumerate(fragment_bounds(n, fragments * 4))])
        index = [np.asarray(i) for i in alg._index]
        assert np.array_equal(np.sort(np.concatenate(index)), np.arange(n))
        assert all(np.all(owner[i] == f) and np.all(np.diff(i) > 0) for f, i in enumerate(index))
    sizes = fragment_sizes(n, fragments, alg.layout, alg.stride_blocks)
    for t in range(1, 19):
        before = alg.ledger.snapshot()
        alg.step(params, _grad(rank, t, n))
        delta = alg.ledger.since(before)
        started = delta["world.Iallreduce"].calls if "world.Iallreduce" in delta else 0
        expected = [f for f in range(fragments) if t % period == offsets[f]]
        assert started == len(expected) <= 1, t  # one fragment at most per step: its bytes are the step's peak
        for f in expected:
            assert alg.merge_steps[f] == t + 2
        # This step's bytes: its fragment's size, as the plan says.
        plan = plan_bytes(type(alg).communication(n, size, alg.hyperparameters(), steps=range(t, t + 1)), size)
        assert delta.bytes_sent == plan["sent"] == (4 * sum(sizes[f] for f in expected) if size > 1 else 0), t
    alg.finish(params)


@pytest.mark.parametrize("layout", [{}, STRIDED], ids=["contiguous", "strided"])
def test_state_dict_resume_with_a_fragment_in_flight_is_bitwise(topology, layout):
    """Resumed with a fragment in flight, or with none (no sum in the state), a run continues bitwise, and its state
    later is the straight run's byte for byte, also while one fragment's region of the sum buffer is idle."""
    rank, n = topology.rank, 31
    hyper = dict(lr=0.05, momentum=0.9, period=6, fragments=2, overlap_steps=2, alpha=0.5, outer_lr=0.7, outer_momentum=0.9, **layout)
    alg = mpiopt.create("streaming_diloco", topology, **hyper)
    params = _initial(rank, n)
    alg.setup(params)
    # Fragment 1 starts after steps 3 and 9 and merges after 5 and 11, fragment 0 starts after step 6 and merges after 8.
    saved, later = {}, None
    for t in range(1, 13):
        alg.step(params, _grad(rank, t, n))
        if t in (6, 8):
            saved[t] = (alg.state_dict(), params.copy())
        if t == 10:
            later = alg.state_dict()
    alg.finish(params)
    assert list(saved[6][0]["arrays"]["merge_steps"]) == [8, 0] and saved[6][0]["arrays"]["pending_sum"] is not None
    assert not saved[8][0]["arrays"]["merge_steps"].any() and saved[8][0]["arrays"]["pending_sum"] is None
    # Fragment 0 idle since its merge after step 8, before the second resume's state: a region of the saved sum
    # buffer that run never wrote.
    assert list(later["arrays"]["merge_steps"]) == [0, 11] and later["arrays"]["pending_sum"] is not None
    # As saved before the idle regions were zeros: fragment 1's (idle after step 6) with other values, never read.
    stale = {**saved[6][0], "arrays": {**saved[6][0]["arrays"], "pending_sum": saved[6][0]["arrays"]["pending_sum"].copy()}}
    stale["arrays"]["pending_sum"][fragment_sizes(n, 2, alg.layout, alg.stride_blocks)[0]:] = 7.0
    cases = {"after step 6": (6, *saved[6]), "after step 8": (8, *saved[8]), "after step 6, stale": (6, stale, saved[6][1])}
    for case, (start, state, at_start) in cases.items():
        fresh = mpiopt.create("streaming_diloco", topology, **hyper)
        resumed = at_start.copy()
        fresh.setup(resumed)
        resumed[...] = at_start
        fresh.load_state_dict(state)
        for t in range(start + 1, 13):
            fresh.step(resumed, _grad(rank, t, n))
            if t == 10:
                assert first_difference(fresh.state_dict(), later) is None, case
        fresh.finish(resumed)
        assert np.array_equal(params, resumed), case


@pytest.mark.parametrize("hyper, value", [
    (dict(fragments=0), "0"), (dict(alpha=1.5), "1.5"), (dict(overlap_steps=-1), "-1"),
    (dict(period=4, fragments=5), "fragments=5"), (dict(period=4, overlap_steps=4), "overlap_steps=4"),
    (dict(outer_momentum=1.0), "1.0"),
    (dict(progress="async"), "async"), (dict(progress_interval=0.0), "0.0"), (dict(tests_per_poke=0), "tests_per_poke"),
    (dict(layout="layers"), "layers"), (dict(stride_blocks=0), "stride_blocks"),
])
def test_bad_hyperparameters_name_the_value(topology, hyper, value):
    with pytest.raises(ValueError, match=value):
        mpiopt.create("streaming_diloco", topology, **hyper)


def test_strided_needs_a_block_per_fragment_and_stride(topology):
    alg = mpiopt.create("streaming_diloco", topology, fragments=4, layout="strided", stride_blocks=8)
    with pytest.raises(ValueError, match="31 parameters cannot make fragments \\* stride_blocks = 4 \\* 8"):
        alg.setup(np.zeros(31, np.float32))


def test_strided_layout_is_checkpointed_and_refused_by_the_other_layout(topology):
    """The layout is mathematics: recorded in the state, and a resume in the other layout is refused, naming it."""
    strided = mpiopt.create("streaming_diloco", topology, period=4, fragments=2, **STRIDED)
    contiguous = mpiopt.create("streaming_diloco", topology, period=4, fragments=2)
    for alg in (strided, contiguous):
        alg.setup(_initial(topology.rank, 40))
    state, plain = strided.state_dict(), contiguous.state_dict()
    assert state["hyperparameters"]["layout"] == "strided" and state["hyperparameters"]["stride_blocks"] == 3
    # The contiguous record has no layout entry: checkpoints saved before the option existed read the same.
    assert "layout" not in plain["hyperparameters"] and "stride_blocks" not in plain["hyperparameters"]
    with pytest.raises(ValueError, match="layout: saved 'strided', here nothing"):
        contiguous.load_state_dict(state)
    with pytest.raises(ValueError, match="layout: saved nothing, here 'strided'"):
        strided.load_state_dict(plain)
    other = mpiopt.create("streaming_diloco", topology, period=4, fragments=2, layout="strided", stride_blocks=4)
    other.setup(_initial(topology.rank, 40))
    with pytest.raises(ValueError, match="stride_blocks: saved 3, here 4"):
        other.load_state_dict(state)


@pytest.mark.mpi(min_size=2)
def test_ranks_must_agree_on_the_layout(topology):
    layout = STRIDED if topology.rank == 0 else {}
    alg = mpiopt.create("streaming_diloco", topology, period=4, fragments=2, **layout)
    with pytest.raises(SetupMismatchError, match="layout"):
        alg.setup(_initial(topology.rank, 40))


def _run_with_progress(topology, progress, steps, hook=False):
    """Parameters after ``steps`` steps (fragments still in flight) and after ``finish``, under one progress mode."""
    rank, n = topology.rank, 4001
    alg = mpiopt.create(
        "streaming_diloco", topology, lr=0.05, momentum=0.9, period=4, fragments=2, overlap_steps=2, alpha=0.5,
        progress=progress, progress_interval=0.001,
    )
    params = _initial(rank, n)
    alg.setup(params)
    for t in range(1, steps + 1):
        if hook:  # the training loop's extra pokes, e.g. after each layer
            alg.progress_hook()
        alg.step(params, _grad(rank, t, n))
    pending = alg.merge_steps.copy()
    mid = params.copy()
    alg.finish(params)
    assert not alg.in_flight and alg.progress_hook()  # nothing left to poke
    return pending, mid, params


@pytest.mark.parametrize("progress, hook", [("thread", False), ("none", False), ("test", True)])
def test_progress_modes_change_nothing_bitwise(topology, progress, hook):
    """Who pokes MPI (a helper thread, nobody, or the loop's progress_hook) changes no bit of the parameters."""
    pending, mid, final = _run_with_progress(topology, "test", 10)
    other_pending, other_mid, other_final = _run_with_progress(topology, progress, 10, hook=hook)
    assert list(pending) == [0, 12]  # fragment 1 started after step 10: in flight at the comparison
    assert list(other_pending) == list(pending)
    assert np.array_equal(mid, other_mid) and np.array_equal(final, other_final)


@pytest.mark.parametrize("algorithm", ["streaming_diloco", "dasgd"])
def test_progress_thread_is_refused_without_thread_multiple(topology, monkeypatch, algorithm):
    """The check both algorithms share: a helper thread may not call an MPI initialised below MPI_THREAD_MULTIPLE."""
    monkeypatch.setattr(Comm, "thread_multiple", property(lambda self: False))
    alg = mpiopt.create(algorithm, topology, progress="thread")
    with pytest.raises(ValueError, match=f"{algorithm}: progress='thread' .* needs MPI_THREAD_MULTIPLE"):
        alg.setup(np.zeros(16, np.float32))
    mpiopt.create(algorithm, topology, progress="test").setup(np.zeros(16, np.float32))  # the default is fine
