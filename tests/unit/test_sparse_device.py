"""The GPU's top-k selection (mpiopt.kernels.sparse.device) against the numpy path's bits; on a lent GPU only.

The CUDA source compiles on CPU too (tests/unit/test_cuda_source.py); its twin, the C scan, is tested in test_sparse.py.
"""

import numpy as np
import pytest

from mpiopt.kernels import sparse
from mpiopt.kernels._backend import array_modules
from mpiopt.kernels.sparse.device import DeviceTopkWorkspace

cupy = next((xp for xp in array_modules() if xp is not np), None)
pytestmark = pytest.mark.skipif(cupy is None, reason="no GPU: cupy and a device are needed")


def awkward(rng, d, kind, dtype):
    """Random, heavily tied (small integers with +-0.0), or all negative; with a NaN in every 500 entries."""
    if kind == "normal":
        x = rng.standard_normal(d)
    elif kind == "ties":
        x = rng.integers(-3, 4, d) * np.where(rng.random(d) < 0.5, -1.0, 1.0)
    else:
        x = -rng.uniform(0.5, 1.0, d)
    x = x.astype(dtype)
    x[rng.integers(0, d, max(1, d // 500))] = np.nan
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["normal", "ties", "negative"])
@pytest.mark.parametrize("d, k", [(1, 1), (9, 3), (4095, 1), (4097, 41), (100_003, 1), (100_003, 100), (1_000_003, 10_007), (100_003, 30_001)])
def test_device_topk_is_the_numpy_topk(dtype, kind, d, k):
    rng = np.random.default_rng([d, k])
    x = awkward(rng, d, kind, dtype)
    workspace = DeviceTopkWorkspace.create(d, k, dtype)
    assert workspace is not None, "the scan kernels did not compile"
    for absolute in (True, False):
        expect = sparse.topk_indices(x, k, absolute=absolute)
        got = sparse.topk_indices(cupy.asarray(x), k, absolute=absolute, workspace=workspace)
        if kind == "normal" and d > 10_000:  # the sample's threshold held: the kernels' own result
            assert got is workspace.selected
        assert got.dtype == np.int32
        np.testing.assert_array_equal(cupy.asnumpy(got), expect)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d, k", [(4097, 1), (100_003, 997), (1_000_003, 10_000)])
def test_device_feedback_select_is_the_c_scan(dtype, d, k):
    """error += grad and its top k in the kernels' pass: the C loops' error bits and indices (subnormals included)."""
    rng = np.random.default_rng(d)
    error = rng.standard_normal(d).astype(dtype)
    grad = rng.standard_normal(d).astype(dtype)
    error[:8] = np.finfo(dtype).tiny * np.array([0.5, -0.25, 1, -1, 3, 0.125, -0.0, 0.0], dtype)  # subnormal sums
    grad[:8] = np.finfo(dtype).tiny * np.array([0.25, 0.5, -0.5, 0.75, 0, 0.0, -0.0, -0.0], dtype)
    expect_error = error + grad
    expect = sparse.topk_indices(expect_error, k)
    on_device, workspace = cupy.asarray(error), DeviceTopkWorkspace.create(d, k, dtype)
    selection = sparse.feedback_select(cupy.asarray(grad), on_device, k, workspace)
    assert selection.finite
    np.testing.assert_array_equal(cupy.asnumpy(on_device).view(np.uint8), expect_error.view(np.uint8))
    np.testing.assert_array_equal(cupy.asnumpy(selection.indices), expect)


def test_device_feedback_select_flags_a_non_finite_gradient():
    d, k = 100_003, 100
    grad = np.ones(d, np.float32)
    grad[77_777] = np.inf
    workspace = DeviceTopkWorkspace.create(d, k, np.float32)
    selection = sparse.feedback_select(cupy.asarray(grad), cupy.zeros(d, np.float32), k, workspace)
    assert not selection.finite and selection.indices is None


def test_too_many_candidates_fall_back_to_the_general_selection():
    """Every entry tied: more candidates than the workspace holds, the numpy answer all the same."""
    d = 100_003
    workspace = DeviceTopkWorkspace.create(d, 10, np.float32)
    got = sparse.topk_indices(cupy.ones(d, np.float32), 10, workspace=workspace)
    assert got is not workspace.selected
    np.testing.assert_array_equal(cupy.asnumpy(got), np.arange(10))


def test_the_sparse_worker_selects_on_the_device():
    from mpiopt.algorithms.topk import Sparsifier
    from mpiopt.kernels.sparse.worker import SparseWorker

    worker = SparseWorker(Sparsifier(density=0.01), cupy.zeros(100_003, np.float32), 2)
    assert isinstance(worker._workspace, DeviceTopkWorkspace)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["normal", "ties", "negative"])
@pytest.mark.parametrize("chunk, k", [(8, 1), (8, 8), (64, 1), (64, 64), (100, 7), (4096, 1), (4096, 64), (4096, 4096), (3000, 64)])
def test_chunk_topk_is_the_array_codes(dtype, kind, chunk, k):
    """The codec's per-chunk selection (whole chunks by the kernel, a ragged last one by topk_indices): numpy's indices."""
    from mpiopt.codecs.topk import TopkCodec
    from mpiopt.kernels.sparse.device import chunk_topk

    d = 5 * chunk + chunk // 3
    x = awkward(np.random.default_rng([chunk, k]), d, kind, dtype)
    x[: min(chunk, 8)] = np.array([0.0, -0.0, 0.0, -0.0, 1.0, -1.0, np.nan, 1.0], dtype)[: min(chunk, 8)]
    codec = TopkCodec(chunk=chunk, k=k)
    expect = codec.select(np, x)
    rows = cupy.asarray(x[: 5 * chunk]).reshape(5, chunk)
    flat = cupy.empty(5 * k, np.int64)
    assert chunk_topk(rows, k, flat), "the kernel did not run"
    np.testing.assert_array_equal(cupy.asnumpy(flat), expect[: 5 * k])
    np.testing.assert_array_equal(cupy.asnumpy(codec.select(cupy, cupy.asarray(x))), expect)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d, k", [(4097, 1), (100_003, 997), (1_000_003, 10_000)])
def test_device_regtopk_step_is_the_c_loops(dtype, d, k):
    """RegTop-k's fused step on the device: the ratio's bits, tanh within an ulp of numpy's, and with those factors the
    C scan's error bits and indices (entries cancelled by the others, factor 0, among them)."""
    rng = np.random.default_rng(d)
    error, grad = rng.standard_normal(d).astype(dtype), rng.standard_normal(d).astype(dtype)
    sent = np.sort(rng.choice(d, k, replace=False)).astype(np.int32)
    values = np.round(rng.standard_normal(k) * 3).astype(dtype)
    prev = rng.standard_normal(d).astype(dtype)
    prev[sent[::3]] = 0
    host, workspace = sparse.TopkWorkspace(d, k, dtype), DeviceTopkWorkspace.create(d, k, dtype)
    expect = sparse.regtopk_sent_factors(sent, values, prev, 4, 5.0, 1e8, host).copy()
    got = sparse.regtopk_sent_factors(cupy.asarray(sent), cupy.asarray(values), cupy.asarray(prev), 4, 5.0, 1e8, workspace)
    np.testing.assert_array_equal(cupy.asnumpy(workspace.rows[1][:k]), host.rows[1][:k])  # the ratio, bitwise
    np.testing.assert_array_max_ulp(cupy.asnumpy(got), expect, maxulp=1)
    factors = cupy.asnumpy(got)
    expect_error = error.copy()
    expect_indices = sparse.feedback_select(grad, expect_error, k, host, sent_indices=sent, sent_factors=factors).indices
    on_device = cupy.asarray(error)
    selection = sparse.feedback_select(cupy.asarray(grad), on_device, k, workspace, sent_indices=cupy.asarray(sent), sent_factors=got)
    assert selection.finite
    np.testing.assert_array_equal(cupy.asnumpy(on_device).view(np.uint8), expect_error.view(np.uint8))
    np.testing.assert_array_equal(cupy.asnumpy(selection.indices), expect_indices)


def test_regtopk_reads_no_dense_aggregate_on_the_device():
    from mpiopt.algorithms.topk import Sparsifier
    from mpiopt.kernels.sparse.worker import SparseWorker

    worker = SparseWorker(Sparsifier(density=0.01, mu=5.0), cupy.zeros(100_003, np.float32), 2)
    assert not worker.reads_dense_aggregate  # the fused pass takes its factors on the device


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, d, k", [(1, 100_003, 100), (3, 1001, 7), (3, 4097, 2000), (3, 100_003, 5000), (4, 1_000_003, 10_000)])
def test_device_aggregation_is_the_numpy_aggregation(dtype, rows, d, k):
    """The P + 2 kernels against aggregate_payloads' numpy code: G's and the updated parameters' bits, twice in a row;
    pairs and bitmap rows (decoded by kernels), rows of any alignment."""
    from mpiopt.kernels.sparse.device_aggregation import DeviceAggregation
    from mpiopt.kernels.sparse.worker import aggregate_payloads

    rng = np.random.default_rng(d)
    workspace = DeviceAggregation.create(rows, k, d)
    assert workspace is not None, "the aggregation kernels did not compile"
    expect_out, params = np.zeros(d, dtype), rng.standard_normal(d).astype(dtype)
    got_out, got_params = cupy.full(d, np.nan, dtype), cupy.asarray(params)
    expect_stale = got_stale = None
    for call in range(2):
        payloads = np.stack([
            sparse.encode(np.sort(rng.choice(d, k, replace=False)).astype(np.int32), rng.standard_normal(k).astype(dtype), d, dtype=dtype)
            for _ in range(rows)
        ])
        expect = aggregate_payloads(payloads, expect_out, stale=expect_stale, params=params, lr=0.3)
        assert workspace.takes(cupy.asarray(payloads), got_out, got_params)  # no quiet fallback to the array code
        got = aggregate_payloads(cupy.asarray(payloads), got_out, stale=got_stale, params=got_params, lr=0.3, device=workspace)
        np.testing.assert_array_equal(cupy.asnumpy(got_out).view(np.uint8), expect_out.view(np.uint8))
        np.testing.assert_array_equal(cupy.asnumpy(got_params).view(np.uint8), params.view(np.uint8))
        np.testing.assert_array_equal(np.unique(cupy.asnumpy(got.touched)), expect.touched)
        expect_stale, got_stale = expect.touched, got.touched
