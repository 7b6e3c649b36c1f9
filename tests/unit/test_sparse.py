"""Top-k, RegTop-k, error feedback and the sparse payloads against plain numpy references."""

import math
import shutil

import numpy as np
import pytest

from mpiopt.arrays import to_numpy
from mpiopt.kernels import (
    decode,
    density_to_k,
    encode,
    encoded_nbytes,
    error_feedback,
    payload_format,
    regtopk_scores,
    scatter_add,
    topk_indices,
)
from mpiopt.kernels import sparse
from mpiopt.kernels.sparse import aggregation, index_sets, selection

SIZES = [1, 7, 8, 9, 63, 64, 65, 1000, 4097]
DENSITIES = [0.001, 0.01, 0.3, 1.0]



def awkward(rng, d, kind):
    """float32 inputs: random, heavily tied (small integers with +-0.0), or all negative."""
    if kind == "normal":
        return rng.standard_normal(d).astype(np.float32)
    if kind == "ties":
        return rng.integers(-3, 4, d).astype(np.float32) * np.where(rng.random(d) < 0.5, -1, 1).astype(np.float32)
    return -rng.uniform(0.5, 1.0, d).astype(np.float32)


def reference_topk(scores, k):
    """Stable sort by descending score (lowest index first among ties), first k, sorted by index."""
    return np.sort(np.argsort(-scores, kind="stable")[:k])


def test_density_to_k():
    assert density_to_k(1000, 7) == 7
    assert density_to_k(1000, 0.01) == 10
    assert density_to_k(25_000_000, 0.001) == 25_000
    assert density_to_k(1000, 1e-9) == 1
    assert density_to_k(1000, 1.0) == 1000 and density_to_k(1000, 1) == 1
    assert density_to_k(10, np.int64(3)) == 3 and density_to_k(10, np.float32(0.5)) == 5


@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, "density_or_count must be >= 1 and <= 10, got 0"),
        (11, ValueError, "density_or_count must be >= 1 and <= 10, got 11"),
        (0.0, ValueError, r"density_or_count as a density must be in \(0, 1\], got 0.0"),
        (1.5, ValueError, r"must be in \(0, 1\], got 1.5"),
        (float("nan"), ValueError, r"must be in \(0, 1\], got nan"),
        (True, TypeError, "got True"),
        ("0.1", TypeError, "got '0.1'"),
    ],
)
def test_density_to_k_rejects(value, error, message):
    with pytest.raises(error, match=message):
        density_to_k(10, value)


@pytest.mark.parametrize("kind", ["normal", "ties", "negative"])
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("d", SIZES)
def test_topk_matches_stable_argsort(xp, d, density, kind):
    x = awkward(np.random.default_rng(d), d, kind)
    k = density_to_k(d, density)
    got = topk_indices(xp.asarray(x), k)
    assert got.dtype == np.int32 and got.shape == (k,)
    np.testing.assert_array_equal(to_numpy(got), reference_topk(np.abs(x), k))


@pytest.mark.parametrize("d", SIZES)
def test_topk_density_one_returns_every_index(xp, d):
    x = xp.asarray(awkward(np.random.default_rng(d), d, "normal"))
    np.testing.assert_array_equal(to_numpy(topk_indices(x, density_to_k(d, 1.0))), np.arange(d))
    assert topk_indices(x, 0).shape == (0,)


def record_candidates(monkeypatch):
    """A list that receives the number of candidates of each exact selection."""
    seen = []
    select = selection._select

    def spy(xp, candidates, *rest):
        seen.append(candidates.shape[0])
        return select(xp, candidates, *rest)

    monkeypatch.setattr(selection, "_select", spy)
    return seen


@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_topk_of_a_long_vector_uses_the_sample(xp, kind, monkeypatch):
    d, k = 300_007, 301
    x = awkward(np.random.default_rng(11), d, kind)
    seen = record_candidates(monkeypatch)
    np.testing.assert_array_equal(to_numpy(topk_indices(xp.asarray(x), k)), reference_topk(np.abs(x), k))
    # Candidates, not the whole vector (with heavy ties, every entry equal to the threshold).
    assert k <= seen[0] < (d // 100 if kind == "normal" else d)


def test_topk_falls_back_when_the_sample_misleads(xp, monkeypatch):
    """The large values are exactly the sampled (strided) entries, so the sample
    predicts many more entries above its threshold than there are."""
    d, k = 2**17, 10_000
    x = np.random.default_rng(12).uniform(0, 1, d).astype(np.float32)
    x[:: max(selection._MIN_STRIDE, d // selection._SAMPLE)] += 10
    seen = record_candidates(monkeypatch)
    np.testing.assert_array_equal(to_numpy(topk_indices(xp.asarray(x), k)), reference_topk(np.abs(x), k))
    assert seen == [d]


def test_topk_by_score_and_nan(xp):
    x = np.array([3.0, -5.0, np.nan, 1.0, np.nan, -np.inf, 2.0], dtype=np.float32)
    # absolute=False ranks by the values themselves: -5 ranks low.
    assert to_numpy(topk_indices(xp.asarray(x), 2, absolute=False)).tolist() == [0, 6]
    # NaN ranks below every number, -inf included; when needed, lowest index first.
    assert to_numpy(topk_indices(xp.asarray(x), 5, absolute=False)).tolist() == [0, 1, 3, 5, 6]
    assert to_numpy(topk_indices(xp.asarray(x), 6, absolute=False)).tolist() == [0, 1, 2, 3, 5, 6]
    assert to_numpy(topk_indices(xp.asarray(x), 3)).tolist() == [0, 1, 5]


def paper_scores(acc, sent_indices, sent_values, prev_aggregate, n_workers, mu, q):
    """The paper's formula entry by entry, in float64."""
    w = 1.0 / n_workers
    scores = []
    sent = dict(zip(sent_indices.tolist(), sent_values.tolist()))
    for j, a in enumerate(acc.tolist()):
        s = sent.get(j, 0.0)
        delta = (prev_aggregate[j] - w * s) / (w * s) if s != 0 else q
        scores.append(math.tanh(abs(1 + delta) / mu) * abs(a))
    return np.array(scores)


def test_regtopk_without_history_ranks_as_topk(xp):
    d, k = 4097, 40
    acc = awkward(np.random.default_rng(13), d, "normal")
    none = xp.zeros(0, dtype=xp.int32), xp.zeros(0, dtype=xp.float32)
    scores = regtopk_scores(xp.asarray(acc), *none, xp.zeros(d, dtype=xp.float32), n_workers=4, mu=5.0)
    np.testing.assert_array_equal(to_numpy(scores), np.abs(acc))  # tanh(|1 + 1e8| / 5) == 1.0
    np.testing.assert_array_equal(
        to_numpy(topk_indices(scores, k, absolute=False)), to_numpy(topk_indices(xp.asarray(acc), k))
    )


def test_regtopk_drops_an_entry_the_others_cancelled(xp):
    """Two workers.  Last round this worker sent entries 1 and 2 (value 1.0 each).
    The other worker sent -1.0 at entry 1, cancelling it (G = 0), and +1.0 at
    entry 2, agreeing (G = 1).  Entry 0 was not sent."""
    acc = np.array([0.5, 2.0, 0.6, 0.1], dtype=np.float32)
    sent_indices = np.array([1, 2], dtype=np.int32)
    sent_values = np.array([1.0, 1.0], dtype=np.float32)
    prev_aggregate = np.array([0.0, 0.0, 1.0, 0.0], dtype=np.float32)
    args = (sent_indices, sent_values, prev_aggregate)
    scores = to_numpy(regtopk_scores(xp.asarray(acc), *map(xp.asarray, args), n_workers=2, mu=4.0))
    # delta_1 = (0 - 0.5) / 0.5 = -1: score 0, although |a_1| is the largest.
    # delta_2 = (1 - 0.5) / 0.5 = 1: score tanh(2 / 4) * 0.6.  Unsent entries keep |a|.
    np.testing.assert_allclose(scores, [0.5, 0.0, math.tanh(0.5) * 0.6, 0.1], rtol=1e-6)
    np.testing.assert_allclose(scores, paper_scores(acc, *args, 2, 4.0, 1e8), rtol=1e-6)
    assert to_numpy(topk_indices(xp.asarray(scores), 1, absolute=False)).tolist() == [0]
    assert to_numpy(topk_indices(xp.asarray(acc), 1)).tolist() == [1]


def test_regtopk_matches_the_formula(xp):
    rng = np.random.default_rng(14)
    d, n_workers, mu, q = 1000, 5, 5.0, 3.0  # a small q makes the unsent factor tanh(4/5) < 1
    acc = rng.standard_normal(d).astype(np.float32)
    sent_indices = np.sort(rng.choice(d, 50, replace=False)).astype(np.int32)
    sent_values = rng.standard_normal(50).astype(np.float32)
    sent_values[:3] = 0.0  # a zero reference value counts as not sent
    prev_aggregate = rng.standard_normal(d).astype(np.float32)
    args = (acc, sent_indices, sent_values, prev_aggregate)
    out = xp.empty(d, dtype=xp.float32)
    scores = regtopk_scores(*map(xp.asarray, args), n_workers=n_workers, mu=mu, q=q, out=out)
    assert scores is out
    np.testing.assert_allclose(to_numpy(scores), paper_scores(*args, n_workers, mu, q), rtol=1e-5, atol=1e-7)


def test_regtopk_rejects(xp):
    acc = xp.zeros(4, dtype=xp.float32)
    idx, val = xp.asarray(np.array([2, 1], dtype=np.int32)), xp.zeros(2, dtype=xp.float32)
    with pytest.raises(ValueError, match=r"sent_indices must be unique indices in \[0, 4\) sorted ascending"):
        regtopk_scores(acc, idx, val, acc, 2, 4.0)
    with pytest.raises(ValueError, match="mu must be a finite number > 0, got 0"):
        regtopk_scores(acc, idx[:0], val[:0], acc, 2, 0)
    with pytest.raises(ValueError, match="n_workers must be >= 1, got 0"):
        regtopk_scores(acc, idx[:0], val[:0], acc, 0, 4.0)


@pytest.mark.parametrize("d", [1, 65, 4097])
def test_error_feedback_conserves_mass_bitwise(xp, d):
    rng = np.random.default_rng(d)
    grad = rng.standard_normal(d).astype(np.float32)
    old_error = (rng.standard_normal(d) * 1e-3).astype(np.float32)
    total = old_error + grad  # a = e + g, the same float32 sums
    error = xp.asarray(old_error)
    k = density_to_k(d, 0.1)
    indices, values = error_feedback(xp.asarray(grad), error, lambda a: topk_indices(a, k))
    indices, values, error = to_numpy(indices), to_numpy(values), to_numpy(error)
    np.testing.assert_array_equal(indices, reference_topk(np.abs(total), k))
    assert values.view(np.uint32).tolist() == total[indices].view(np.uint32).tolist()
    assert np.all(error[indices] == 0)
    rest = np.setdiff1d(np.arange(d), indices)
    assert error[rest].view(np.uint32).tolist() == total[rest].view(np.uint32).tolist()


def test_error_feedback_rejects(xp):
    grad, error = xp.ones(5, dtype=xp.float32), xp.zeros(5, dtype=xp.float32)
    with pytest.raises(TypeError, match="select must be callable"):
        error_feedback(grad, error, [0, 1])
    with pytest.raises(ValueError, match=r"select\(a\) must be unique indices in \[0, 5\) sorted ascending"):
        error_feedback(grad, error, lambda a: xp.asarray(np.array([3, 1])))
    with pytest.raises(TypeError, match="error must have dtype float32, got float64"):
        error_feedback(grad, xp.zeros(5, dtype=xp.float64), lambda a: topk_indices(a, 1))


@pytest.mark.parametrize("density", [0.001, 0.01, 0.03, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("d", SIZES)
def test_encode_decode_round_trip(xp, d, density):
    rng = np.random.default_rng(d)
    k = density_to_k(d, density)
    indices = np.sort(rng.choice(d, k, replace=False)).astype(np.int32)
    values = rng.standard_normal(k).astype(np.float32)
    payload = encode(xp.asarray(indices), xp.asarray(values), d)
    assert payload.dtype == np.uint8 and payload.shape == (encoded_nbytes(k, d),)
    got_indices, got_values = decode(payload, d)
    assert got_indices.dtype == np.int32 and got_values.dtype == np.float32
    np.testing.assert_array_equal(to_numpy(got_indices), indices)
    assert to_numpy(got_values).view(np.uint32).tolist() == values.view(np.uint32).tolist()


def test_format_choice():
    d = 80_000  # bitmap: 10,000 bytes; indices: 4k bytes
    assert payload_format(80, d) == "pairs" and encoded_nbytes(80, d) == 8 + 8 * 80  # 0.1 %
    assert payload_format(2500, d) == "pairs"  # 4k == d / 8: a tie goes to pairs
    assert payload_format(2501, d) == "bitmap" and encoded_nbytes(2501, d) == 8 + 4 * 2501 + 10_000
    assert payload_format(40_000, d) == "bitmap"  # 50 %


def test_encode_into_out_and_both_formats_tagged(xp):
    d = 64
    for k, fmt in ((2, "pairs"), (10, "bitmap")):
        indices, values = xp.arange(k, dtype=xp.int32) * 3, xp.ones(k, dtype=xp.float32)
        out = xp.empty(encoded_nbytes(k, d), dtype=xp.uint8)
        assert encode(indices, values, d, out=out) is out
        assert payload_format(k, d) == fmt
        header = to_numpy(out[:8]).view(np.uint32).tolist()
        assert header == [("pairs", "bitmap").index(fmt), k]


def test_encode_and_decode_reject(xp):
    idx, val = xp.asarray(np.array([1, 1], dtype=np.int32)), xp.ones(2, dtype=xp.float32)
    with pytest.raises(ValueError, match=r"indices must be unique indices in \[0, 8\) sorted ascending"):
        encode(idx, val, 8)
    with pytest.raises(TypeError, match="values must have dtype float32, got float64"):
        encode(idx, xp.ones(2, dtype=xp.float64), 8)
    payload = encode(xp.asarray(np.array([1, 5], dtype=np.int32)), val, 1000)
    with pytest.raises(ValueError, match="is not an encoding for d = 8"):
        decode(payload, 8)
    with pytest.raises(ValueError, match="is not an encoding for d = 1000"):
        decode(payload[:-1], 1000)
    with pytest.raises(ValueError, match="at least 8 bytes"):
        decode(payload[:4], 1000)


def test_scatter_add_aggregates_workers(xp):
    """Overlapping payloads of 5 workers, one scatter_add each, against np.add.at."""
    rng = np.random.default_rng(15)
    d, n_workers, k = 1000, 5, 300
    aggregate, reference = xp.zeros(d, dtype=xp.float32), np.zeros(d, dtype=np.float32)
    for _ in range(n_workers):
        indices = np.sort(rng.choice(d, k, replace=False)).astype(np.int32)
        values = rng.standard_normal(k).astype(np.float32)
        scatter_add(aggregate, *decode(encode(xp.asarray(indices), xp.asarray(values), d), d))
        np.add.at(reference, indices, values)
    np.testing.assert_array_equal(to_numpy(aggregate), reference)


def test_scatter_add_rejects_repeated_indices(xp):
    with pytest.raises(ValueError, match="indices must be unique"):
        scatter_add(xp.zeros(4, dtype=xp.float32), xp.asarray(np.array([1, 1])), xp.ones(2, dtype=xp.float32))


# -- preallocated workspaces and the C loops: the same numbers as the plain numpy code -----------------
needs_c = pytest.mark.skipif(index_sets._sparsec is None, reason="mpiopt.kernels._sparsec was not built")


def test_the_c_loops_are_built_where_a_c_compiler_is():
    """Else every test marked needs_c would skip without a word."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the numpy code runs everywhere")
    assert index_sets._sparsec is not None, "mpiopt.kernels._sparsec was not built although a C compiler is present"


@needs_c
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["normal", "ties", "negative"])
@pytest.mark.parametrize("d, k", [(9, 3), (1000, 1), (4097, 41), (100_003, 100), (100_003, 30_001)])
def test_topk_with_a_workspace_is_the_reference(dtype, kind, d, k):
    rng = np.random.default_rng([d, k])
    x = awkward(rng, d, kind).astype(dtype)
    x[rng.integers(0, d, max(1, d // 500))] = np.nan
    workspace = sparse.TopkWorkspace(d, k, dtype)
    for absolute in (True, False):
        expect = topk_indices(x, k, absolute=absolute)
        got = topk_indices(x, k, absolute=absolute, workspace=workspace)
        assert got.dtype == np.int32
        if kind == "normal" and d > 10_000:  # the sample's threshold held: the workspace's own result
            assert got is workspace.selected
        np.testing.assert_array_equal(got, expect)
        scores = np.abs(x) if absolute else x
        np.testing.assert_array_equal(got, reference_topk(np.where(np.isnan(scores), -np.inf, scores), k))


@needs_c
def test_topk_workspace_overflow_falls_back():
    """Every entry tied at the threshold: more candidates than the workspace holds, the same answer."""
    x = np.ones(100_003, np.float32)
    workspace = sparse.TopkWorkspace(x.size, 10, np.float32)
    np.testing.assert_array_equal(topk_indices(x, 10, workspace=workspace), np.arange(10))


@needs_c
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_regtopk_scores_with_a_workspace_are_bitwise_the_expression(dtype):
    rng = np.random.default_rng(5)
    d, k, n = 5003, 700, 3
    acc = rng.standard_normal(d).astype(dtype)
    indices = np.sort(rng.choice(d, k, replace=False)).astype(np.int32)
    values = rng.standard_normal(k).astype(dtype)
    values[::7] = 0.0  # a zero share: delta = q there
    values[1::11] = np.finfo(dtype).tiny / 4  # subnormal shares: delta overflows
    prev = rng.standard_normal(d).astype(dtype)
    prev[indices[::5]] = (values[::5] / n).astype(dtype)  # delta = 0 exactly
    workspace = sparse.TopkWorkspace(d, k, dtype)
    for q in (1e8, 0.5):
        expect = regtopk_scores(acc, indices, values, prev, n, 4.0, q)
        got = regtopk_scores(acc, indices, values, prev, n, 4.0, q, out=np.empty_like(acc), workspace=workspace)
        assert got.tobytes() == expect.tobytes()


@needs_c
@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("d, k", [(1001, 37), (1_000_003, 100_003)])  # the second in 3 threads' parts
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_indexed_loops_are_the_fancy_indexing(dtype, d, k, count, kernel_threads):
    kernel_threads(count)
    rng = np.random.default_rng(9)
    indices = np.sort(rng.choice(d, k, replace=False)).astype(np.int32)
    x = rng.standard_normal(d).astype(dtype)
    y = rng.standard_normal(d).astype(dtype)
    values = rng.standard_normal(k).astype(dtype)

    grad, error, plain_error = x.copy(), y.copy(), y.copy()
    out = np.empty(k + 5, dtype)
    got_i, got_v = error_feedback(grad, error, lambda a: topk_indices(a, k), values_out=out)
    expect_i, expect_v = error_feedback(grad, plain_error, lambda a: topk_indices(a, k))
    assert np.shares_memory(got_v, out) and got_v.tobytes() == expect_v.tobytes() and error.tobytes() == plain_error.tobytes()
    np.testing.assert_array_equal(got_i, expect_i)

    expect = x.copy()
    expect[indices] += values
    assert scatter_add(x.copy(), indices, values).tobytes() == expect.tobytes()
    expect = x.copy()
    expect[indices] = 0
    assert sparse.zero_at(x.copy(), indices).tobytes() == expect.tobytes()
    expect = x.copy()
    expect[indices] /= 3
    assert sparse.divide_at(x.copy(), indices, 3).tobytes() == expect.tobytes()
    expect = x.copy()
    expect[indices] -= 0.1 * y[indices]
    assert sparse.subtract_scaled_at(x.copy(), indices, y, 0.1).tobytes() == expect.tobytes()
    expect = x.copy()
    expect[indices] = values
    got = x.copy()
    assert index_sets._indexed(index_sets._SET, got, indices, values)
    assert got.tobytes() == expect.tobytes()
    with pytest.raises(ValueError, match="out of"):
        sparse.zero_at(x.copy(), np.array([d], np.int32))


@pytest.mark.parametrize("c_loops", [True, False])
def test_union_of_sorted(c_loops, monkeypatch):
    if not c_loops:
        monkeypatch.setattr(aggregation, "_sparsec", None)
    elif index_sets._sparsec is None:
        pytest.skip("mpiopt.kernels._sparsec was not built")
    rng = np.random.default_rng(2)
    d = 1003
    arrays = [np.sort(rng.choice(d, k, replace=False)).astype(np.int32) for k in (5, 300, 300, 1)]
    expect = np.unique(np.concatenate(arrays))
    out = np.empty(sum(a.size for a in arrays), np.int32)
    got = sparse.union_of_sorted(arrays, d, np.empty(-(-d // 8), np.uint8), out)
    np.testing.assert_array_equal(got, expect)
    assert np.shares_memory(got, out) == c_loops
    np.testing.assert_array_equal(sparse.union_of_sorted(arrays, d), expect)
    one = sparse.union_of_sorted(arrays[1:2], d, np.empty(-(-d // 8), np.uint8), out)  # one worker: a copy in out
    np.testing.assert_array_equal(one, arrays[1])
    assert np.shares_memory(one, out) and not np.shares_memory(one, arrays[1])


# Long enough for 3 threads' parts of at least 2**18 elements (mpiopt/kernels/_parallel.h), ragged at the end.
SPLIT_SIZE = 3 * 2**18 + 13


def regtopk_reference(acc, sent_indices, sent_values, prev, n, mu, k):
    """RegTop-k's selection with numpy's general code (no workspace, no C loops' fused pass)."""
    return topk_indices(regtopk_scores(acc, sent_indices, sent_values, prev, n, mu), k, absolute=False)


@needs_c
@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("regularized", [False, True], ids=["topk", "regtopk"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d, k", [(100_003, 100), (100_003, 30_001), (SPLIT_SIZE, 7_000)])
def test_feedback_select_is_error_feedback_then_the_selection(d, k, dtype, regularized, count, kernel_threads):
    """One fused pass gives error += grad and the selection of the plain code, bit for bit, over several steps."""
    kernel_threads(count)
    rng = np.random.default_rng([d, k, int(regularized)])
    workspace = sparse.TopkWorkspace(d, k, dtype)
    error = rng.standard_normal(d).astype(dtype)
    error[:: max(1, d // 300)] = np.nan  # NaN ranks below every number (an error buffer can hold one after a skip policy's bypass)
    plain = error.copy()
    sent_indices = np.sort(rng.choice(d, k, replace=False)).astype(np.int32)
    sent_values = rng.standard_normal(k).astype(dtype)
    sent_values[::9] = 0.0
    prev = rng.standard_normal(d).astype(dtype)
    prev[sent_indices[::4]] = (sent_values[::4] / 3).astype(dtype)  # delta = 0: the score drops to tanh(1/mu) |a|
    for step in range(2):
        grad = (rng.standard_normal(d) * (1 + step)).astype(dtype)
        grad[rng.integers(0, d, 50)] = -0.0
        sent_factors = None
        if regularized:
            sent_factors = sparse.regtopk_sent_factors(sent_indices, sent_values, prev, 3, 5.0, 1e8, workspace)
            sent_factors = sent_factors.copy()  # the workspace's rows are scratch of the selection below
        assert sparse.fused_feedback_available(grad, error, workspace)
        got, finite = sparse.feedback_select(
            grad, error, k, workspace, sent_indices=sent_indices if regularized else None, sent_factors=sent_factors,
        )
        assert finite is True
        plain += grad
        if regularized:
            expect = regtopk_reference(plain, sent_indices, sent_values, prev, 3, 5.0, k)
            # the factor times |a| is the score the general code gives the sent entries, bit for bit
            np.testing.assert_array_equal(
                sent_factors * np.abs(plain[sent_indices]), regtopk_scores(plain, sent_indices, sent_values, prev, 3, 5.0)[sent_indices]
            )
        else:
            expect = topk_indices(plain, k)
        assert error.tobytes() == plain.tobytes()
        assert got is not None and got.dtype == np.int32
        np.testing.assert_array_equal(got, expect)
        sent_indices = got.copy()
        sent_values = sparse.take_and_zero(error, sent_indices).copy()
        sparse.take_and_zero(plain, sent_indices)


@needs_c
def test_feedback_select_reports_candidates_that_do_not_fit():
    """Every entry tied at the threshold: None, with error += grad done all the same."""
    d, k = 100_003, 10
    workspace = sparse.TopkWorkspace(d, k, np.float32)
    error, grad = np.zeros(d, np.float32), np.ones(d, np.float32)
    assert sparse.feedback_select(grad, error, k, workspace) == (None, True)
    assert (error == 1).all()
    assert not sparse.fused_feedback_available(error, error, workspace)  # the same buffer twice
    assert not sparse.fused_feedback_available(grad.astype(np.float64), error, workspace)
    assert not sparse.fused_feedback_available(grad, error, None)


@needs_c
@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_scan_checks_the_gradient_it_adds(bad, dtype, count, kernel_threads):
    """One NaN or +-inf anywhere in g (a 64-entry block, the tail, any thread's chunk) makes the scan report it; never x's own."""
    kernel_threads(count)
    d = SPLIT_SIZE + 37  # a tail of 37 entries after the last whole block of 64
    rng = np.random.default_rng(d)
    x, g = rng.standard_normal(d).astype(dtype), rng.standard_normal(d).astype(dtype)
    idx, scores = np.empty(d, np.int32), np.empty(d, dtype)
    x[5] = np.nan  # a non-finite error entry is not the gradient's
    g[7] = np.finfo(dtype).max  # the largest finite value is finite
    g[8] = np.finfo(dtype).tiny / 4  # and so is a subnormal
    assert index_sets._sparsec.scan(x.copy(), g, d, x.dtype.itemsize, 1.0, True, None, None, idx, scores, count)[1] is True
    assert index_sets._sparsec.scan(x.copy(), None, d, x.dtype.itemsize, 1.0, True, None, None, idx, scores, count)[1] is True
    for at in (0, 63, 64, d // 2, d - 38, d - 37, d - 1):
        h = g.copy()
        h[at] = bad
        y = x.copy()
        n, finite = index_sets._sparsec.scan(y, h, d, x.dtype.itemsize, 1.0, True, None, None, idx, scores, count)
        assert finite is False, at
        assert y.tobytes() == (x + h).tobytes()  # x += g done all the same


@needs_c
def test_feedback_select_reports_a_non_finite_gradient():
    """No selection for a NaN gradient, error += grad done; finite gradients report True."""
    d, k = 100_003, 100
    workspace = sparse.TopkWorkspace(d, k, np.float32)
    rng = np.random.default_rng(4)
    error, grad = rng.standard_normal(d).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    grad[d - 3] = np.nan
    want = error + grad
    assert sparse.feedback_select(grad, error, k, workspace) == (None, False)
    assert error.tobytes() == want.tobytes()


@needs_c
def test_scan_refuses_bad_override_positions():
    x = np.zeros(10, np.float32)
    idx, scores = np.empty(10, np.int32), np.empty(10, np.float32)
    for bad in ([3, 3], [4, 2], [-1], [10]):
        over = np.array(bad, np.int32)
        with pytest.raises(ValueError, match="override positions must be unique, ascending and in"):
            index_sets._sparsec.scan(x, None, 10, 4, 0.0, True, over, np.zeros(len(bad), np.float32), idx, scores, 1)


@needs_c
@pytest.mark.parametrize("d", [1, 7, 8, 63, 64, 65, 1003, 1019, 1024, 64 * 20 - 5])
def test_bitmap_indices_reads_words_and_ignores_pad_bits(d):
    """The set bits of a random bitmap, pad bits set too, against numpy's unpackbits."""
    rng = np.random.default_rng(d)
    bits = rng.integers(0, 256, -(-d // 8), dtype=np.uint8)
    bits[-1] |= 0xFF ^ ((1 << (d % 8)) - 1) if d % 8 else 0  # every pad bit set
    expect = np.flatnonzero(np.unpackbits(bits, bitorder="little")[:d]).astype(np.int32)
    out = np.full(d + 1, -1, np.int32)
    assert index_sets._sparsec.bitmap_indices(bits, d, out) == expect.size
    np.testing.assert_array_equal(out[: expect.size], expect)
    small = np.empty(max(0, expect.size - 3), np.int32)  # too small: counted all the same, nothing written past it
    assert index_sets._sparsec.bitmap_indices(bits, d, small) == expect.size
    np.testing.assert_array_equal(small, expect[: small.size])


@needs_c
@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [1, 63, 64, 65, 1000, SPLIT_SIZE])
def test_scan_against_numpy(d, dtype, count):
    """x += g, then every score >= t in order; at the overrides (consecutive ones too) the factor times |x| (NaN, exactly t)."""
    rng = np.random.default_rng([d, np.dtype(dtype).itemsize])
    x, g = rng.standard_normal(d).astype(dtype), rng.standard_normal(d).astype(dtype)
    x[rng.integers(0, d, 1 + d // 1000)] = np.nan
    t = dtype(1.5)
    over = np.unique(np.concatenate([rng.choice(d, min(d, 1 + d // 10), replace=False), np.arange(min(d, 5))])).astype(np.int32)
    over_factors = rng.uniform(0, 3, over.size).astype(dtype)
    over_factors[::7] = np.nan
    for overrides in (False, True):
        y = x.copy()
        want_x = y + g
        scores = np.abs(want_x)
        if overrides:
            factors = over_factors.copy()
            exact = np.isfinite(scores[over]) & (scores[over] > 0)
            factors[1::7] = np.where(exact[1::7], t / scores[over][1::7], factors[1::7])  # near the threshold
            scores[over] = factors * scores[over]
        want = np.flatnonzero(scores >= t)
        idx, out = np.empty(d, np.int32), np.empty(d, dtype)
        args = (over, factors) if overrides else (None, None)
        n, finite = index_sets._sparsec.scan(y, g, d, y.dtype.itemsize, float(t), True, *args, idx, out, count)
        assert finite is True
        assert y.tobytes() == want_x.tobytes()
        assert n == want.size
        np.testing.assert_array_equal(idx[:n], want)
        assert out[:n].tobytes() == scores[want].tobytes()


@needs_c
@pytest.mark.parametrize("d, count", [(5003, 1), (1_000_003, 3)])  # the second settles in 3 threads' chunks
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_merge_and_settle_are_the_scatter_passes(rows, dtype, d, count, kernel_threads):
    """merge_sorted_rows + settle_aggregate give the floats of zero_at, scatter_add per row, divide_at and subtract_scaled_at."""
    kernel_threads(count)
    rng = np.random.default_rng([rows, np.dtype(dtype).itemsize, d])
    index_rows = [np.sort(rng.choice(d, rng.integers(0, d // 7), replace=False)).astype(np.int32) for _ in range(rows)]
    index_rows[0] = np.union1d(index_rows[0], [0, d - 1]).astype(np.int32)  # the ends of the vector
    value_rows = []
    for indices in index_rows:
        raw = np.zeros(indices.size * np.dtype(dtype).itemsize + 1, np.uint8)[1:]  # a misaligned row, as a payload's
        values = raw.view(dtype)
        values[...] = rng.standard_normal(indices.size)
        values[::5] = -0.0
        value_rows.append(values)
    stale = np.sort(rng.choice(d, d // 5, replace=False)).astype(np.int32)
    start = np.zeros(d, dtype)
    start[stale] = rng.standard_normal(stale.size)
    params = rng.standard_normal(d).astype(dtype)
    # the scatter passes
    want = start.copy()
    sparse.zero_at(want, stale)
    for indices, values in zip(index_rows, value_rows):
        scatter_add(want, indices, values)
    union = np.unique(np.concatenate(index_rows)).astype(np.int32)
    if rows > 1:
        sparse.divide_at(want, union, rows)
    want_params = sparse.subtract_scaled_at(params.copy(), union, want, 0.05)

    capacity = sum(i.size for i in index_rows)
    merged = sparse.merge_sorted_rows(index_rows, value_rows, d, np.empty(capacity, np.int32), np.empty(capacity, dtype))
    np.testing.assert_array_equal(merged[0], union)
    got, got_params = start.copy(), params.copy()
    sparse.settle_aggregate(got, merged[0], merged[1], rows, stale=stale, params=got_params, lr=0.05)
    assert got.tobytes() == want.tobytes() and got_params.tobytes() == want_params.tobytes()


@needs_c
def test_merge_refuses_bad_rows_and_small_outputs():
    good = np.array([1, 5], np.int32)
    values = np.ones(2, np.float32)
    out, sums = np.empty(4, np.int32), np.empty(4, np.float32)
    for bad in ([5, 1], [3, 3], [-1, 2], [2, 10]):
        with pytest.raises(ValueError, match="unique indices in \\[0, 10\\), ascending"):
            sparse.merge_sorted_rows([good, np.array(bad, np.int32)], [values, values], 10, out, sums)
    with pytest.raises(ValueError, match="cannot hold the union"):
        sparse.merge_sorted_rows([good, np.array([2, 3], np.int32)], [values, values], 10, out[:3], sums)
    assert sparse.merge_sorted_rows([good] * 9, [values] * 9, 10, out, sums) is None  # more rows: the scatter path
    assert sparse.merge_sorted_rows([good.astype(np.int64)], [values], 10, out, sums) is None
    with pytest.raises(ValueError, match="unique, ascending and in range"):
        sparse.settle_aggregate(np.zeros(10, np.float32), np.array([3, 2], np.int32), values, 1)


@needs_c
@pytest.mark.parametrize("density", [0.01, 0.3])  # int32 pairs and bitmap payloads
@pytest.mark.parametrize("rows", [1, 3, 9])  # 9: more rows than the merge takes
def test_aggregate_payloads_merged_equals_scattered(rows, density):
    from mpiopt.algorithms.topk import aggregate_payloads

    rng = np.random.default_rng([rows, int(density * 100)])
    d = 20_011
    k = density_to_k(d, density)
    payloads = np.stack([
        encode(np.sort(rng.choice(d, k, replace=False)).astype(np.int32), rng.standard_normal(k).astype(np.float32), d)
        for _ in range(rows)
    ])
    params = rng.standard_normal(d).astype(np.float32)
    want, want_params = np.zeros(d, np.float32), params.copy()
    got, got_params = np.zeros(d, np.float32), params.copy()
    capacity = min(d, rows * k)
    unions, sums = np.empty((2, capacity), np.int32), np.empty(capacity, np.float32)
    bits, indices = np.empty(-(-d // 8), np.uint8), np.empty((rows, k), np.int32)
    stale = None
    for step in range(3):
        touched_want = aggregate_payloads(payloads, want, params=want_params, lr=0.1).touched
        stale, values = aggregate_payloads(
            payloads, got, stale=stale, indices_out=indices, union_bits=bits, union_out=unions[step % 2], sums_out=sums,
            params=got_params, lr=0.1,
        )
        np.testing.assert_array_equal(stale, touched_want)
        if rows <= sparse.MERGE_MAX_ROWS:  # merged: the sums became G's values
            assert values.tobytes() == want[touched_want].tobytes()
        else:  # scatter-added: no values at hand
            assert values is None
        assert got.tobytes() == want.tobytes() and got_params.tobytes() == want_params.tobytes()
        payloads = np.roll(payloads, 1, axis=0)  # other workers' rows at each position next step


def test_aggregate_payloads_reads_every_rows_header_in_one_copy(monkeypatch):
    """The rows' headers come to the host in one copy (on a GPU one wait, not one a row); a bad one is still named."""
    from mpiopt.algorithms.topk import aggregate_payloads
    from mpiopt.kernels.sparse import payload as wire

    d, k = 1000, 10
    rng = np.random.default_rng(5)
    payloads = np.stack([
        encode(np.sort(rng.choice(d, k, replace=False)).astype(np.int32), rng.standard_normal(k).astype(np.float32), d) for _ in range(4)
    ])
    want = aggregate_payloads(payloads, np.zeros(d, np.float32)).touched
    copies = []
    monkeypatch.setattr(wire, "to_numpy", lambda a: copies.append(a.shape) or np.asarray(a))
    out = np.zeros(d, np.float32)
    assert np.array_equal(aggregate_payloads(payloads, out).touched, want) and copies == [(4, 8)]
    payloads[2, 4] = 0xFF  # row 2's k
    with pytest.raises(ValueError, match="not an encoding for d = 1000"):
        aggregate_payloads(payloads, out)


@needs_c
@pytest.mark.parametrize("count", [1, 2, 3])
def test_scan_of_clustered_candidates_fills_the_outputs_exactly(count, kernel_threads):
    """Every candidate in the first tenth of the vector: the chunks' proportional shares overflow, all fit."""
    kernel_threads(count)
    d = SPLIT_SIZE
    rng = np.random.default_rng(count)
    x = (rng.standard_normal(d) * 0.01).astype(np.float32)
    g = np.zeros(d, np.float32)
    x[: d // 10 : 7] = 5.0 + rng.random(len(range(0, d // 10, 7))).astype(np.float32)
    want = np.flatnonzero(np.abs(x) >= 1.0).astype(np.int32)
    idx, scores = np.empty(2 * want.size, np.int32), np.empty(2 * want.size, np.float32)
    n, finite = index_sets._sparsec.scan(x, g, d, 4, 1.0, True, None, None, idx, scores, count)
    assert n == want.size and finite is True
    np.testing.assert_array_equal(idx[:n], want)
    assert scores[:n].tobytes() == np.abs(x[want]).tobytes()
    assert index_sets._sparsec.scan(x, None, d, 4, 1.0, True, None, None, idx[: want.size - 1], scores, count) == (want.size, True)
    g[d - 1] = np.nan  # the exact second pass reads no g: the first pass's finite check stands
    assert index_sets._sparsec.scan(x, g, d, 4, 1.0, True, None, None, idx, scores, count) == (want.size, False)


@needs_c
def test_feedback_select_and_settle_refuse_bad_arguments():
    d, k = 1000, 10
    workspace = sparse.TopkWorkspace(d, k, np.float32)
    error, grad = np.zeros(d, np.float32), np.ones(d, np.float32)
    with pytest.raises(ValueError, match="k must be the workspace's k \\(10\\) and in \\[1, 1000\\], got 11"):
        sparse.feedback_select(grad, error, 11, workspace)
    with pytest.raises(ValueError, match="give sent_indices and sent_factors together"):
        sparse.feedback_select(grad, error, k, workspace, sent_indices=np.arange(3, dtype=np.int32))
    with pytest.raises((TypeError, ValueError), match="sent_factors"):  # float64 bytes would be read as float32
        sparse.feedback_select(grad, error, k, workspace, sent_indices=np.arange(3, dtype=np.int32), sent_factors=np.ones(3))
    with pytest.raises((TypeError, ValueError), match="sent_indices"):
        sparse.feedback_select(grad, error, k, workspace, sent_indices=np.arange(3), sent_factors=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="mu must be a finite number > 0, got 0"):
        sparse.regtopk_sent_factors(np.arange(3, dtype=np.int32), np.ones(3, np.float32), error, 2, 0, 1e8, workspace)
    with pytest.raises(ValueError, match="fused_feedback_available"):
        sparse.feedback_select(grad.astype(np.float64), error, k, workspace)
    union, sums = np.array([1, 2], np.int32), np.ones(2, np.float64)
    with pytest.raises(ValueError, match="must share a float32 or float64 dtype, got float32, float64"):
        sparse.settle_aggregate(np.zeros(d, np.float32), union, sums, 2)
    with pytest.raises(ValueError, match="union and stale must be int32"):
        sparse.settle_aggregate(np.zeros(d, np.float32), union.astype(np.int64), sums.astype(np.float32), 2)


@needs_c
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_regtopk_sent_factors_are_the_general_expressions_bits(dtype):
    """The C loop up to the tanh, then numpy's tanh: regtopk_scores' numpy expression bit for bit, special values too."""
    d, k = 5000, 700
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    indices = np.sort(rng.choice(d, k, replace=False)).astype(np.int32)
    values = rng.standard_normal(k).astype(dtype)
    prev = rng.standard_normal(d).astype(dtype)
    tiny = np.finfo(dtype).smallest_subnormal
    values[:8] = [0.0, -0.0, tiny, -tiny, np.nan, np.inf, -np.inf, 1.0]
    prev[indices[8:12]] = [np.nan, np.inf, 0.0, -0.0]
    prev[indices[::5]] = values[::5] / 3  # delta = 0
    workspace = sparse.TopkWorkspace(d, k, dtype)
    got = sparse.regtopk_sent_factors(indices, values, prev, 3, 5.0, 1e8, workspace).copy()
    acc = np.ones(d, dtype)  # |a| = 1: the general scores at the sent entries are the factors
    with np.errstate(all="ignore"):
        want = regtopk_scores(acc, indices, values, prev, 3, 5.0)[indices]
    assert got.tobytes() == want.tobytes()
    # G_prev by its non-zero entries (some sent entries outside them, where G_prev is 0): the same bits, no dense read
    support = np.union1d(indices[::2], rng.choice(d, 300, replace=False)).astype(np.int32)
    sparse_prev = np.zeros(d, dtype)
    sparse_prev[support] = prev[support]
    poisoned = np.full(d, np.nan, dtype)
    got = sparse.regtopk_sent_factors(indices, values, poisoned, 3, 5.0, 1e8, workspace, prev_support=(support, prev[support]))
    with np.errstate(all="ignore"):
        want = regtopk_scores(acc, indices, values, sparse_prev, 3, 5.0)[indices]
    assert got.tobytes() == want.tobytes()


@needs_c
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scale_sampled_scales_the_sampled_positions_only(dtype):
    d, stride = 1000, 7
    sample = np.arange(-(-d // stride), dtype=dtype) + 1
    indices = np.array([0, 3, 7, 8, 14, 700, 994, 999], np.int32)  # 994 = 142 * 7 is the last sampled position
    factors = np.arange(2, 2 + indices.size, dtype=dtype)
    want = sample.copy()
    sampled = indices % stride == 0
    want[indices[sampled] // stride] = factors[sampled] * want[indices[sampled] // stride]
    index_sets._sparsec.scale_sampled(sample, indices, factors, indices.size, sample.dtype.itemsize, stride)
    assert sample.tobytes() == want.tobytes()


@needs_c
def test_settle_without_the_dense_aggregate():
    """out=None: G only in sums (divided), params updated there, no dense vector touched."""
    union = np.array([2, 5, 9], np.int32)
    sums = np.array([3.0, -6.0, 1.0], np.float32)
    params = np.ones(12, np.float32)
    want_values = sums / np.float32(3)
    want_params = params.copy()
    want_params[union] -= np.float32(0.5) * want_values
    sparse.settle_aggregate(None, union, sums, 3, stale=np.array([1, 2], np.int32), params=params, lr=0.5)
    assert sums.tobytes() == want_values.tobytes() and params.tobytes() == want_params.tobytes()
