"""Top-k with error feedback and RegTop-k: dense limit, error feedback, aggregate, bytes, validation, resume, simulation."""

import numpy as np
import pytest
from mpi4py import MPI

import mpiopt
from mpiopt.algorithms.topk import Sparsifier
from mpiopt.kernels import decode, encoded_nbytes, payload_format
from mpiopt.sim.topk import simulate
from mpiopt.tasks.linreg import make_problem

pytestmark = pytest.mark.mpi

NAMES = ["topk", "regtopk"]


def _grad(rank, step, n, scale=1.0):
    # Per-rank means make the ranks' selections differ (as with non-i.i.d. data).
    rng = np.random.default_rng([21, rank, step])
    return (scale * rng.standard_normal(n) + rank - 1.5).astype(np.float32)


def _initial(n):
    return np.random.default_rng(3).standard_normal(n).astype(np.float32)


def _gather(array):
    """Every rank's copy of ``array``, stacked in rank order."""
    out = np.empty((MPI.COMM_WORLD.Get_size(),) + array.shape, dtype=array.dtype)
    MPI.COMM_WORLD.Allgather(np.ascontiguousarray(array), out)
    return out


def _reference_selection(name, acc, prev, size, mu, k):
    """Top-k of |a| or of RegTop-k's scores, in float64; ties to the lowest index."""
    scores = np.abs(acc.astype(np.float64))
    if name == "regtopk" and prev is not None:
        indices, values, aggregate = prev
        share = values.astype(np.float64) / size
        delta = (aggregate[indices].astype(np.float64) - share) / share
        scores[indices] *= np.tanh(np.abs(1 + delta) / mu)
    return np.sort(np.argsort(-scores, kind="stable")[:k])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_full_density_is_dense_sgd(topology, name, momentum):
    """density=1.0 sends everything: the error stays 0 and the run is data-parallel SGD."""
    n, steps = 37, 8
    hyper = dict(lr=0.05, momentum=momentum, weight_decay=1e-3)
    sparse = mpiopt.create(name, topology, density=1.0, **hyper)
    dense = mpiopt.create("sgd", topology, **hyper)
    x_sparse, x_dense = _initial(n), _initial(n)
    sparse.setup(x_sparse)
    dense.setup(x_dense)
    errors_zero = []
    for t in range(steps):
        g = _grad(topology.rank, t, n)
        sparse.step(x_sparse, g)
        dense.step(x_dense, g)
        errors_zero.append(not np.any(sparse.error))
    assert sparse.k == n and all(errors_zero)
    if topology.size <= 2:
        # Adding two gradients is commutative: the same float32 sum in any order.
        assert np.array_equal(x_sparse, x_dense)
    else:
        assert np.allclose(x_sparse, x_dense, rtol=1e-6, atol=1e-6), np.abs(x_sparse - x_dense).max()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("density", [0.05, 0.3, 0.8])
def test_error_feedback_selection_and_aggregate(topology, name, density):
    """Each step: sent + new error = old error + g (bitwise); the selection is the top k of the right score;
    the aggregate and the update match float64 references built from every rank's selection."""
    rank, size, n, steps, mu, lr = topology.rank, topology.size, 300, 6, 2.0, 0.1
    hyper = dict(mu=mu) if name == "regtopk" else {}
    alg = mpiopt.create(name, topology, lr=lr, density=density, **hyper)
    params = _initial(n)
    alg.setup(params)
    k = alg.k
    prev = None
    mass, selection, aggregate, update = [], [], [], []
    for t in range(steps):
        g = _grad(rank, t, n, scale=3.0)
        old_error, old_params = alg.error.copy(), params.copy()
        alg.step(params, g)
        indices, values = (np.array(v) for v in decode(alg.payload, n))
        # Error feedback: scatter the sent values back into the new error.
        restored = alg.error.copy()
        restored[indices] += values
        mass.append(np.array_equal(restored, old_error + g) and np.all(alg.error[indices] == 0))
        acc = old_error + g  # a = e + g, the float32 sum the kernel makes
        expected = _reference_selection(name, acc, prev, size, mu, k)
        selection.append(indices.shape[0] == k and np.array_equal(indices, expected))
        # Aggregate: every rank's (indices, values), gathered, summed in float64.
        all_indices, all_values = _gather(indices), _gather(values)
        reference = np.zeros(n)
        for idx, val in zip(all_indices, all_values):
            reference[idx] += val
        reference /= size
        aggregate.append(np.abs(alg.aggregate - reference).max() <= 1e-6 * (1 + np.abs(reference).max()))
        update.append(np.abs(params - (old_params - lr * reference)).max() <= 1e-6 * (1 + np.abs(old_params).max()))
        prev = (indices, values, alg.aggregate.copy())
    assert all(mass), mass
    assert all(selection), selection
    assert all(aggregate), aggregate
    assert all(update), update


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n, k", [(1000, 10), (1000, 200)])
def test_ledger_bytes_per_step(topology, name, n, k):
    """One Allgather of encoded_nbytes(k, d) per step: that many bytes sent, (P - 1) times that received."""
    alg = mpiopt.create(name, topology, k=k)
    params = _initial(n)
    alg.setup(params)
    before = alg.ledger.snapshot()
    records = [alg.step(params, _grad(topology.rank, t, n)) for t in range(3)]
    steps = alg.ledger.since(before)
    nbytes = encoded_nbytes(k, n)
    size = topology.size
    assert payload_format(k, n) == ("pairs" if k == 10 else "bitmap")
    assert alg.payload.nbytes == nbytes
    for record in records:
        assert record.bytes_sent == (nbytes if size > 1 else 0)
        assert record.bytes_recv == (size - 1) * nbytes
    assert set(steps.ops) == {"world.Allgather"} and steps["world.Allgather"].calls == 3


@pytest.mark.parametrize(
    "name, hyper, error, argument",
    [
        ("topk", dict(k=3, density=0.1), ValueError, "k or density"),
        ("regtopk", dict(k=3, density=0.1), ValueError, "k or density"),
        ("topk", dict(density=0.0), ValueError, "density"),
        ("topk", dict(density=1.5), ValueError, "density"),
        ("regtopk", dict(density=-0.1), ValueError, "density"),
        ("topk", dict(density="0.1"), TypeError, "density"),
        ("topk", dict(k=0), ValueError, "k"),
        ("topk", dict(k=2.0), TypeError, "k"),
        ("regtopk", dict(mu=0.0), ValueError, "mu"),
        ("regtopk", dict(mu=-4.0), ValueError, "mu"),
        ("regtopk", dict(q=0.0), ValueError, "q"),
        ("topk", dict(momentum=1.0), ValueError, "momentum"),
        ("topk", dict(mu=4.0), TypeError, "mu"),  # Top-k has no mu
    ],
)
def test_validation_names_the_argument(topology, name, hyper, error, argument):
    with pytest.raises(error, match=argument):
        mpiopt.create(name, topology, **hyper)


@pytest.mark.parametrize("name", NAMES)
def test_setup_rejects_k_above_d_and_float16(topology, name):
    alg = mpiopt.create(name, topology, k=11)
    with pytest.raises(ValueError, match=r"k must be <= the number of parameters \(10\), got k=11"):
        alg.setup(np.zeros(10, np.float32))
    alg = mpiopt.create(name, topology, k=2)
    with pytest.raises(TypeError, match="float32 or float64"):  # float64 is carried since issue 11
        alg.setup(np.zeros(10, np.float16))


def test_defaults(topology):
    alg = mpiopt.create("regtopk", topology)
    hyper = alg.hyperparameters()
    assert alg.lr == 0.01 and hyper["mu"] == 5.0 and hyper["q"] == 1e8
    assert hyper["k"] is None and hyper["density"] == 0.001 and hyper["momentum"] == 0.0
    assert "mu" not in mpiopt.create("topk", topology).hyperparameters()
    alg.setup(np.zeros(5000, np.float32))
    assert alg.k == 5
    # An int density is a density, not a count.
    one = mpiopt.create("topk", topology, density=1)
    one.setup(np.zeros(8, np.float32))
    assert one.k == 8


def test_a_state_with_bad_sent_indices_is_refused_before_loading(topology):
    """RegTop-k's step indexes with last step's sent entries unchecked: a state holding others is refused, naming them."""
    alg = mpiopt.create("regtopk", topology, k=3, mu=4.0)
    params = np.zeros(16, np.float32)
    alg.setup(params)
    alg.step(params, np.arange(16, dtype=np.float32))
    state, before = alg.state_dict(), alg.sent_indices.copy()
    for bad in ([3, 1, 7], [3, 7, 16], [-1, 3, 7], [3, 3, 7]):
        broken = {**state, "arrays": {**state["arrays"], "sent_indices": np.array(bad, np.int32)}}
        with pytest.raises(ValueError, match=r"the state's sent_indices must be unique indices in \[0, 16\) sorted ascending"):
            alg.load_state_dict(broken)
        assert np.array_equal(alg.sent_indices, before)  # nothing loaded
    alg.load_state_dict(state)


@pytest.mark.mpi(min_size=2)
def test_ranks_must_agree_on_k(topology):
    alg = mpiopt.create("topk", topology, k=2 + topology.rank % 2)
    with pytest.raises(mpiopt.SetupMismatchError, match="hyperparameters"):
        alg.setup(np.zeros(16, np.float32))


@pytest.mark.parametrize("name, momentum", [("topk", 0.0), ("topk", 0.9), ("regtopk", 0.0), ("regtopk", 0.9)])
def test_resume_is_bitwise(topology, bitwise_resume, name, momentum):
    n = 200
    hyper = dict(lr=0.05, density=0.5, momentum=momentum, **(dict(mu=3.0) if name == "regtopk" else {}))
    grads = [_grad(topology.rank, t, n, scale=2.0) for t in range(12)]
    alg, _ = bitwise_resume(topology, name, hyper, _initial(n), grads, 5)
    if name == "regtopk":
        assert alg.has_history and alg.sent_indices.shape == (100,)
    assert (alg.momentum_buffer is None) == (momentum == 0.0)


@pytest.mark.parametrize("name, density, mu", [("topk", 0.3, None), ("regtopk", 0.3, 4.0), ("regtopk", 0.7, 2.0)])
def test_mpi_run_is_the_simulation_bitwise(topology, name, density, mu):
    """P ranks on the linear-regression task = simulate() of the same P workers, bit for bit."""
    rank, size, steps = topology.rank, topology.size, 60
    problem = make_problem(num_workers=size, dim=24, samples=40, seed=5)
    hyper = dict(mu=mu) if mu is not None else {}
    alg = mpiopt.create(name, topology, lr=0.01, density=density, **hyper)
    x = np.zeros(problem.dim, np.float32)
    alg.setup(x)
    grad = np.empty_like(x)
    for _ in range(steps):
        alg.step(x, problem.gradient(rank, x, out=grad))
    run = simulate(problem, Sparsifier(density=density, mu=mu), steps)
    assert np.array_equal(x, run.params)
    assert np.array_equal(alg.aggregate, run.aggregate)
    assert run.squared_distance[-1] < 0.5 * run.squared_distance[0]  # it is training, not standing still


@pytest.mark.parametrize("name, mu", [("topk", None), ("regtopk", 4.0)])
def test_sparse_momentum_run_is_the_simulation_bitwise(topology, name, mu):
    """Momentum at a low density, where the update reads G's non-zero entries alone and Top-k writes the dense G
    only when asked for: the simulation's dense update, bit for bit, however often the aggregate is read."""
    rank, size, steps, density = topology.rank, topology.size, 20, 0.004
    problem = make_problem(num_workers=size, dim=2000, samples=40, seed=7)
    hyper = dict(mu=mu) if mu is not None else {}
    alg = mpiopt.create(name, topology, lr=0.01, density=density, momentum=0.9, **hyper)
    x = np.zeros(problem.dim, np.float32)
    alg.setup(x)
    grad = np.empty_like(x)
    for step in range(steps):
        alg.step(x, problem.gradient(rank, x, out=grad))
        if step % 3 == 0:  # read now and then: a step after a read and after none
            assert np.count_nonzero(alg.aggregate) <= size * alg.k
    run = simulate(problem, Sparsifier(density=density, mu=mu), steps, momentum=0.9)
    assert 8 * size * alg.k < problem.dim  # the sparse reading of G
    assert np.array_equal(x, run.params)
    assert np.array_equal(alg.aggregate, run.aggregate)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_regtopk_general_selection_run_is_the_simulation_bitwise(topology, momentum):
    """RegTop-k with a q other than the paper's, whose selection reads the dense G_prev every step (the fused
    pass does not apply), so the step writes G every step: the simulation, bit for bit."""
    rank, size, steps, density = topology.rank, topology.size, 20, 0.004
    problem = make_problem(num_workers=size, dim=2000, samples=40, seed=7)
    alg = mpiopt.create("regtopk", topology, lr=0.01, density=density, momentum=momentum, mu=2.0, q=0.5)
    x = np.zeros(problem.dim, np.float32)
    alg.setup(x)
    assert alg.worker.reads_dense_aggregate
    grad = np.empty_like(x)
    for _ in range(steps):
        alg.step(x, problem.gradient(rank, x, out=grad))
    run = simulate(problem, Sparsifier(density=density, mu=2.0, q=0.5), steps, momentum=momentum)
    assert np.array_equal(x, run.params)
    assert np.array_equal(alg.aggregate, run.aggregate)


@pytest.mark.mpi(min_size=4)
def test_claim_at_four_ranks_matches_simulation():
    """The linear-regression claim, small, through MPI: 4 workers (d = 20, 200 samples each, heterogeneous
    means), lr 0.05, density 0.7, mu = 4.  Top-k stays above 1e-3 from x* (squared distance) over the last
    150 of 300 steps; RegTop-k's median there is below 1e-6; the trajectories are the simulation's, bit for bit."""
    rank, steps, window = MPI.COMM_WORLD.Get_rank(), 300, slice(150, 301)
    problem = make_problem(num_workers=4, dim=20, samples=200, seed=0)
    four = MPI.COMM_WORLD.Split(0 if rank < 4 else MPI.UNDEFINED, rank)  # exactly 4 workers at any size >= 4
    distances = {}
    if four != MPI.COMM_NULL:
        workers = mpiopt.Topology(four)
        grad = np.empty(problem.dim, np.float32)
        for name, mu in (("topk", None), ("regtopk", 4.0)):
            alg = mpiopt.create(name, workers, lr=0.05, density=0.7, **({"mu": mu} if mu else {}))
            x = np.zeros(problem.dim, np.float32)
            alg.setup(x)
            trace = [problem.squared_distance(x)]
            for _ in range(steps):
                alg.step(x, problem.gradient(workers.rank, x, out=grad))
                trace.append(problem.squared_distance(x))
            run = simulate(problem, Sparsifier(density=0.7, mu=mu), steps, lr=0.05)
            distances[name] = (np.array(trace), run.squared_distance)
        workers.Free()
        four.Free()
    for mpi_run, simulated in distances.values():
        assert np.array_equal(mpi_run, simulated)
    if distances:
        top, reg = distances["topk"][0], distances["regtopk"][0]
        assert top[window].min() > 1e-3, top[window].min()
        assert np.median(reg[window]) < 1e-6, np.median(reg[window])


def _dyadic_grad(rank, step, n, dtype):
    """Multiples of 1/8 in [-64, 64]: exact in float32 and float64, and so are their sums here."""
    rng = np.random.default_rng([31, rank, step])
    return (rng.integers(-512, 513, n) / 8.0).astype(dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("density", [0.01, 0.3])  # pairs and bitmap payloads
def test_float64_selects_as_float32(topology, name, density):
    """On values exact in both types, float64 sends the same indices as float32, its values in float64."""
    n, runs = 1001, {}
    for dtype in (np.float32, np.float64):
        params = np.zeros(n, dtype)
        alg = mpiopt.create(name, topology, lr=0.125, density=density, mu=4.0) if name == "regtopk" else \
            mpiopt.create(name, topology, lr=0.125, density=density)
        alg.setup(params)
        sent = []
        for step in range(4):
            alg.step(params, _dyadic_grad(topology.rank, step, n, dtype))
            indices, values = decode(alg.payload, n, dtype)
            assert values.dtype == dtype and alg.payload.nbytes == encoded_nbytes(alg.k, n, dtype)
            sent.append((indices.copy(), values.astype(np.float64)))
        runs[dtype] = (sent, params.astype(np.float64))
    for (i32, v32), (i64, v64) in zip(runs[np.float32][0], runs[np.float64][0]):
        np.testing.assert_array_equal(i32, i64)
        np.testing.assert_array_equal(v32, v64)  # sums of multiples of 1/8 below 2**20: exact in both
    np.testing.assert_allclose(runs[np.float64][1], runs[np.float32][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_float64_error_feedback_conserves_mass(topology, name):
    """e_new + sent == e_old + g exactly, in float64, every step."""
    n = 2000
    rng = np.random.default_rng([5, topology.rank])
    params = rng.standard_normal(n)
    alg = mpiopt.create(name, topology, lr=0.01, density=0.05)
    alg.setup(params)
    error = np.zeros(n)
    for step in range(5):
        g = rng.standard_normal(n)
        alg.step(params, g)
        indices, values = decode(alg.payload, n, np.float64)
        rebuilt = alg.error.copy()
        rebuilt[indices] += values
        np.testing.assert_array_equal(rebuilt, error + g)
        error = alg.error.copy()


@pytest.mark.parametrize("name", NAMES)
def test_float64_full_density_is_dense_sgd(topology, name):
    """Density 1 in float64: the mean gradient each step, as sgd's Allreduce (to float64 rounding)."""
    n, lr = 300, 0.05
    params, reference = _initial(n).astype(np.float64), _initial(n).astype(np.float64)
    alg = mpiopt.create(name, topology, lr=lr, density=1.0)
    sgd = mpiopt.create("sgd", topology, lr=lr)
    alg.setup(params)
    sgd.setup(reference)
    for step in range(5):
        g = _grad(topology.rank, step, n).astype(np.float64) * np.pi  # not exact in float32
        alg.step(params, g)
        sgd.step(reference, g.copy())
    assert params.dtype == np.float64
    np.testing.assert_allclose(params, reference, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("name, hyper, fused", [
    ("topk", {}, True), ("regtopk", {}, True), ("regtopk", {"q": 1.0}, False),  # q != the paper's: no fused pass
])
def test_a_non_finite_gradient_raises_before_the_exchange(name, hyper, fused):
    """Under nan_policy="raise" the error-feedback pass checks g (the fused one in passing); every rank raises before the Allgather."""
    own = mpiopt.Topology(abort_on_error=False)
    try:
        n = 5000
        params = _initial(n)
        alg = mpiopt.create(name, own, lr=0.05, density=0.01, **hyper)
        alg.setup(params)
        for step in range(2):  # RegTop-k's second step ranks with its history
            alg.step(params, _grad(own.rank, step, n))
        assert alg.worker._fusable is fused
        error = alg.error.copy()
        bad = _grad(own.rank, 2, n)
        bad[n - 1 - own.rank] = np.nan
        sent = alg.ledger.snapshot()
        with pytest.raises(FloatingPointError, match=f"{name}: non-finite gradient on rank {own.rank} at step 3"):
            alg.step(params, bad)
        assert alg.steps == 2 and alg.ledger.since(sent).bytes_sent == 0
        # without the fused pass the check comes first and the error is untouched
        assert np.array_equal(alg.error, error, equal_nan=True) is not fused
    finally:
        own.Free()
