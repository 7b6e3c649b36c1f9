"""The CUDA kernels' own source run on the CPU (``cuda_on_cpu.h``: a block's threads as fibers), against the C loops
and numpy, in every CI run: their logic (selection, ties, NaN, bit fields, barriers, the Python wrappers' arguments)
checked without a GPU.  The GPU's arithmetic is the CPU's here; a lent GPU runs the same comparisons for real
(tests/unit/test_codecs.py, test_sparse_device.py)."""

import sys

import numpy as np
import pytest

from mpiopt.codecs import create, fused
from mpiopt.kernels import _codecs_cuda, _codecs_dense_cuda, _cuda
from mpiopt.kernels.sparse import device, device_aggregation, encode, feedback_select, regtopk_scores, regtopk_sent_factors, topk_indices
from mpiopt.kernels.sparse.payload import payload_header
from mpiopt.kernels.sparse.worker import aggregate_payloads
from mpiopt.kernels.sparse.index_sets import _sparsec as sparse_c
from mpiopt.kernels.sparse.selection import TopkWorkspace, _sample_plan, _sample_threshold
from test_codecs import _same_bits_but_nans


# ---- topk's codec: the kernels against the C loops ---------------------------------------------------------------


def _inputs(d, seed, special):
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(3, d) * rng.uniform(0.1, 10)).astype(np.float32)
    if special == "ties":
        x = np.round(x)
    elif special == "non-finite" and d >= 300:
        x[: min(d, 70)] = 0.0
        x[[71, d // 3, d // 2, d - 1]] = [-0.0, np.nan, np.inf, -np.inf]
    return x


CODECS = [{}, {"chunk": 64, "k": 64, "bits": 8}, {"chunk": 100, "k": 8, "bits": 3}]


@pytest.mark.skipif(fused._codecsc is None, reason="the C loops are not built")
@pytest.mark.parametrize("params", CODECS, ids=["defaults", "whole-chunk", "k8-3bits"])
def test_topk_codec_kernels_give_the_c_loops_bits(params, as_device):
    """topk_encode (no fold, fold, fold with decay; with and without feedback) and topk_decode (one row, rows, added
    to, divided, with the senders counted) against _codecsc's, at awkward lengths with ties, NaN, +-inf and -0.0."""
    codec = create("topk", **params)
    k, bits, index_bits, low, spacing, table = fused._topk(codec)
    nbytes = codec.payload_nbytes
    for d in (1, 7, 257, 3001):
        for special in ("", "ties", "non-finite"):
            x, e0 = _inputs(d, 1, special), _inputs(d, 2, special)
            for beta, fold, feedback in ((1.0, False, False), (1.0, True, True), (0.95, True, True), (0.95, True, False)):
                outputs = []
                for encode in (fused._codecsc.topk_encode, _codecs_cuda.topk_encode):
                    e, payload = e0.copy(), np.zeros(nbytes(d), np.uint8)
                    args = (e, x if fold else None, beta, payload, codec.chunk, k, bits, index_bits, low, spacing, table, feedback)
                    assert encode(*args, *([1] if encode is fused._codecsc.topk_encode else [])) in (None, True)
                    outputs.append((e, payload))
                (e_c, p_c), (e_k, p_k) = outputs
                assert _same_bits_but_nans(codec, d, e_c, e_k) and _same_bits_but_nans(codec, d, p_c, p_k), (d, special, beta, fold, feedback)
            rows = np.stack([codec.encode(_inputs(d, 10 + r, special)) for r in range(3)])
            for payloads, add, divisor, counted in ((rows[0], False, 1.0, False), (rows, False, 3.0, False), (rows[:2], True, 2.0, False),
                                                    (rows, False, 1.0, True), (np.concatenate([rows, rows[:1]]), False, 1.0, True)):
                outputs = []
                for decode in (fused._codecsc.topk_decode, _codecs_cuda.topk_decode):
                    out = x.copy()
                    counts = np.full(d, 7, np.int32) if counted else None
                    rows_n = 1 if payloads.ndim == 1 else payloads.shape[0]
                    args = (payloads, rows_n, out, codec.chunk, k, bits, index_bits, table, add, divisor, counts)
                    assert decode(*args, *([1] if decode is fused._codecsc.topk_decode else [])) in (None, True)
                    outputs += [out, counts]
                out_c, counts_c, out_k, counts_k = outputs
                assert _same_bits_but_nans(codec, d, out_c, out_k) and (not counted or np.array_equal(counts_c, counts_k)), (d, special, add, divisor, counted)


DENSE_CODECS = [("int8", {}), ("int8", {"chunk": 100}), ("int4", {"chunk": 64}), ("fp4", {}), ("fp4", {"chunk": 6}),
                ("sign", {}), ("sign", {"chunk": 8}), ("sign", {"chunk": 8192}), ("bf16", {}), ("none", {})]


@pytest.mark.skipif(fused._codecsc is None, reason="the C loops are not built")
@pytest.mark.parametrize("name, params", DENSE_CODECS, ids=[f"{n}-{p.get('chunk', 'default')}" for n, p in DENSE_CODECS])
def test_dense_codec_kernels_give_the_c_loops_bits(name, params, as_device):
    """dense_encode (no fold, fold, fold with decay; with and without feedback; bf16's rounding) and dense_decode (one
    row, rows, added to, divided) against _codecsc's, at awkward lengths with ties, NaN, +-inf, -0.0 and subnormals."""
    codec = create(name, **params)
    kind, chunk = fused._KINDS[name], fused._chunk(codec)
    for d in (1, 7, 257, 9001 if chunk >= 64 else 1001):  # the emulator's time goes by blocks: one a chunk
        for special in ("", "ties", "non-finite", "tiny", "wide", "edges"):
            x, e0 = _inputs(d, 1, special), _inputs(d, 2, special)
            if special == "edges":  # a chunk of zeros, then rint's ties and E3M0's edges at an absmax of 127
                edges = np.array([127, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, 127 / 128, -127 / 128, 1.5 * 127 / 128, 127 / 64, 63.5], np.float32)
                x = np.resize(edges, d)
                x[: min(d // 2, 4096)], e0 = 0, np.zeros(d, np.float32)
            if special == "tiny":  # subnormal chunks: their scale and codes (the kernels read the bits, never -ftz's compare)
                x, e0 = x * np.float32(1e-41), e0 * np.float32(1e-40)
            elif special == "wide":  # magnitudes 1e-30 to 1e30: sign's float64 sum rounds, in numpy's order
                x, e0 = (v * np.float32(10.0) ** np.random.default_rng(d).integers(-30, 30, d).astype(np.float32) for v in (x, e0))
            encodes = [(1.0, False, False)] if name in ("bf16", "none") else [(1.0, False, False), (1.0, True, True), (0.95, True, True), (0.95, True, False)]
            for beta, fold, feedback in encodes if name != "none" else []:
                outputs = []
                for kernel in (True, False):
                    e, payload = e0.copy(), np.zeros(codec.payload_nbytes(d), np.uint8)
                    if kernel:
                        assert _codecs_dense_cuda.dense_encode(kind, e, x if fold else None, beta, payload, chunk, feedback)
                    else:
                        fused._codecsc.encode(kind, e, x if fold else None, beta, payload, chunk, feedback, 1)
                    outputs.append((e, payload))
                (e_k, p_k), (e_c, p_c) = outputs
                assert _same_bits_but_nans(codec, d, e_c, e_k) and _same_bits_but_nans(codec, d, p_c, p_k), (d, special, beta, fold, feedback)
            rows = np.stack([codec.encode(_inputs(d, 10 + r, special)) for r in range(5)])
            for payloads, add, divisor in ((rows[0], False, 1.0), (rows, False, 5.0), (rows[:2], True, 2.0), (rows[:3], False, 3.0)):
                outputs = []
                for kernel in (True, False):
                    out, n = x.copy(), 1 if payloads.ndim == 1 else payloads.shape[0]
                    if kernel:
                        assert _codecs_dense_cuda.dense_decode(kind, payloads, n, out, chunk, add, divisor)
                    else:
                        fused._codecsc.decode(kind, payloads, n, out, chunk, add, divisor, 1)
                    outputs.append(out)
                assert _same_bits_but_nans(codec, d, *outputs), (d, special, add, divisor)


def test_the_kernels_decline_what_they_do_not_take(as_device):
    """Settings whose chunks share bytes, chunks over a block, k over MAX_SENT, values over 8 bits (the kernel's shared
    value words), float64: False, nothing written."""
    e, payload = np.ones(100, np.float32), np.zeros(1, np.uint8)
    for chunk, k, bits, index_bits in ((333, 1, 1, 9), (8192, 64, 2, 13), (4096, 2048, 2, 12), (100, 7, 3, 7), (64, 8, 16, 6)):
        assert not _codecs_cuda.topk_encode(e, None, 1.0, payload, chunk, k, bits, index_bits, 0.0, 1.0, np.ones(2, np.float32), False)
    assert not _codecs_cuda.topk_encode(e.astype(np.float64), None, 1.0, payload, 64, 8, 2, 6, 0.0, 1.0, np.ones(4, np.float32), False)


# ---- top-k selection: chunk_topk and the scan --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("chunk, k", [(64, 1), (64, 64), (100, 7), (4096, 64), (333, 333)])
def test_chunk_topk_selects_the_kernels_top_k_of_every_row(chunk, k, dtype, emulated):
    """chunk_topk against topk_indices (the numpy path) per row: ascending flat indices, ties to the lowest, NaN last."""
    rng = np.random.default_rng(chunk + k)
    rows = np.round(rng.standard_normal((5, chunk)) * 3).astype(dtype)  # many ties
    rows[1, ::7] = np.nan
    rows[2, :] = -0.0
    rows[3, ::5] = np.inf
    flat = np.empty(rows.shape[0] * k, np.int64)
    emulated(device.SELECT, "chunk_topk", rows.dtype, rows.shape[0], (np.int64(rows.shape[0]), np.int32(chunk), np.int32(k), rows, flat))
    expected = np.concatenate([topk_indices(row, k).astype(np.int64) + i * chunk for i, row in enumerate(rows)])
    assert np.array_equal(flat, expected)


def test_chunk_topk_refuses_a_k_its_select_cannot_find(as_device):
    """k = 0 or k over the chunk: no k-th key, and the kernel would write past ``out``; an error naming k, nothing run."""
    rows, flat = np.ones((2, 8), np.float32), np.full(20, -1, np.int64)
    for k in (0, 9):
        with pytest.raises(ValueError, match=f"k must be in \\[1, chunk = 8\\], got {k}"):
            device.chunk_topk(rows, k, flat)
    assert np.all(flat == -1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("d, k", [(1, 1), (5000, 1), (5000, 50), (70001, 700), (70001, 7000)])
def test_the_device_scan_selects_what_numpy_selects(d, k, dtype, emulated, monkeypatch):
    """DeviceTopkWorkspace.scan_select (scan_count, scan_write, the k best of the candidates) with a gradient folded in
    and the sampled threshold, against ``error += grad`` and topk_indices; a non-finite gradient is reported."""
    monkeypatch.setattr(_cuda, "launch", emulated)
    monkeypatch.setitem(sys.modules, "cupy", np)  # the workspace's buffers: numpy's, alike in what it calls
    workspace = device.DeviceTopkWorkspace(d, k, dtype)
    rng = np.random.default_rng(d + k)
    error = np.round(rng.standard_normal(d) * 4).astype(dtype)  # ties at the k-th place
    grad = np.round(rng.standard_normal(d) * 4).astype(dtype)
    expected_error = error + grad
    expected = topk_indices(expected_error, k)
    stride, _, rank = _sample_plan(d, k)
    sample = np.abs(error[::stride] + grad[::stride])
    threshold = _sample_threshold(np, sample.copy(), rank, False, sample)
    threshold = np.asarray(threshold, dtype=dtype)
    got = workspace.scan_select(error, grad, threshold, True, k)
    assert np.array_equal(error, expected_error) and got.finite
    assert got.indices is not None and np.array_equal(got.indices, expected)  # None would be the general code's turn
    grad[d // 2] = np.nan
    assert workspace.scan_select(error, grad, threshold, True, k).finite is False


@pytest.mark.skipif(sparse_c is None, reason="the C loops are not built")
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("d, k", [(1, 1), (5000, 1), (5000, 50), (70001, 700), (70001, 7000)])
def test_regtopks_device_factors_and_scan_select_what_the_c_loops_select(d, k, dtype, emulated, monkeypatch):
    """RegTop-k's fused step on the device workspace (regtopk_ratio, scale_sampled, the scan with factors at last step's
    entries) against the C loops': the same factors' bits, error and indices; sent values of 0 (delta = q), ties."""
    monkeypatch.setattr(_cuda, "launch", emulated)
    monkeypatch.setitem(sys.modules, "cupy", np)
    rng = np.random.default_rng(d + k)
    error = np.round(rng.standard_normal(d) * 4).astype(dtype)
    grad = np.round(rng.standard_normal(d) * 4).astype(dtype)
    # Entries at a tile's edges (the kernels' tiles are 4096 long), large, sent last step and cancelled by the
    # others (factor 0): Top-k would take them, RegTop-k must not.
    edges = np.array([e for e in (0, 4095, 4096, 8192, 65535) if e < d][:k], np.int32)
    others = rng.choice(np.setdiff1d(np.arange(d), edges), k - edges.shape[0], replace=False)
    sent = np.sort(np.concatenate([edges, others])).astype(np.int32)
    values = np.round(rng.standard_normal(k) * 3).astype(dtype)  # some 0: delta = q there
    prev = np.round(rng.standard_normal(d) * 2).astype(dtype)
    prev[sent[::2]] = values[::2] / 3  # this worker's share: delta = 0
    values[np.isin(sent, edges)], prev[edges], error[edges] = 5, 0, 100
    results = []
    for workspace in (TopkWorkspace(d, k, dtype), device.DeviceTopkWorkspace(d, k, dtype)):
        factors = regtopk_sent_factors(sent, values, prev, 3, 0.5, 1e8, workspace)
        assert factors is not None
        e = error.copy()
        selection = feedback_select(grad, e, k, workspace, sent_indices=sent, sent_factors=factors)
        assert selection.finite and selection.indices is not None
        results.append((factors.copy(), e, selection.indices.copy()))
    (f_c, e_c, i_c), (f_k, e_k, i_k) = results
    assert f_c.tobytes() == f_k.tobytes() and e_c.tobytes() == e_k.tobytes()
    assert np.array_equal(i_c, i_k)
    expected = topk_indices(regtopk_scores(error + grad, sent, values, prev, 3, 0.5), k, absolute=False)
    assert np.array_equal(i_k, expected)  # and the general code's selection


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("n, k", [(1, 1), (300, 1), (300, 300), (9000, 17), (9000, 4500), (20000, 9999)])
def test_keep_best_keeps_the_k_highest_scores(n, k, dtype, emulated, monkeypatch):
    """keep_best (two kernels over tiles of 4,096 candidates, up to 5 of them) against the array code's choice: signed
    scores, -0.0 equal to +0.0, ties at the k-th to the lowest index across tiles, +-inf."""
    from mpiopt.kernels.sparse.selection import _select

    monkeypatch.setattr(_cuda, "launch", emulated)
    rng = np.random.default_rng(n + k)
    scores = (rng.integers(-3, 4, n) * rng.choice([1.0, -1.0], n)).astype(dtype)  # many ties, +-0.0
    scores[:: max(1, n // 7)] = np.inf
    scores[1 :: max(2, n // 5)] = -np.inf
    candidates = np.sort(rng.choice(10 * n, n, replace=False)).astype(np.int32)
    selected = np.full(k, -1, np.int32)
    kth = np.sort(scores)[n - k : n - k + 1]
    counts, ends = np.full(13, -1, np.int32), np.full(13, -1, np.int32)
    device.keep_best(kth, candidates, scores, k, counts, ends, selected)
    assert np.array_equal(selected, _select(np, candidates, scores, k))


def test_take_zero_sends_and_clears_the_selected_entries(as_device):
    """take_zero, error feedback's send on the device, against numpy's indexing."""
    for dtype in (np.float32, np.float64):
        error = np.random.default_rng(0).standard_normal(70001).astype(dtype)
        indices = np.sort(np.random.default_rng(1).choice(70001, 700, replace=False)).astype(np.int32)
        expected_values, expected_error = error[indices], error.copy()
        expected_error[indices] = 0
        values = np.full(1000, np.nan, dtype)
        assert device.take_zero(error, indices, values[:700])
        assert np.array_equal(values[:700], expected_values) and np.array_equal(error, expected_error)


# ---- the aggregation of P payloads ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(
    "rows, d, k", [(1, 1, 1), (1, 5000, 50), (3, 1000, 7), (3, 70, 9), (3, 5000, 2500), (4, 100_003, 1000), (3, 100_003, 5000)],
)
def test_the_device_aggregation_gives_the_array_codes_floats(rows, d, k, dtype, emulated, monkeypatch):
    """Two calls of DeviceAggregation (the second clearing the first's entries) against aggregate_payloads' own code:
    G's and the updated parameters' bits, the entries G may be non-zero at; entries sent by several rows, both formats
    (bitmaps of one tile and of 13, decoded by the kernels), rows of any alignment (float64 pairs of odd k, bitmaps)."""
    monkeypatch.setattr(_cuda, "launch", emulated)
    monkeypatch.setitem(sys.modules, "cupy", np)
    rng = np.random.default_rng(rows * d + k)
    workspace = device_aggregation.DeviceAggregation(rows, k, d)
    expected_out, got_out = np.zeros(d, dtype), np.full(d, np.nan, dtype)
    params = rng.standard_normal(d).astype(dtype)
    expected_params, got_params = params.copy(), params.copy()
    expected_stale = got_stale = None
    for call in range(2):
        shared = rng.choice(d, min(k, 3), replace=False)  # entries every row sends
        rest = np.setdiff1d(np.arange(d), shared)
        payloads = np.stack([
            encode(
                np.sort(np.concatenate([shared, rng.choice(rest, k - shared.shape[0], replace=False)])).astype(np.int32),
                (rng.standard_normal(k) * 10.0 ** rng.integers(-3, 3, k)).astype(dtype), d, dtype=dtype,
            )
            for _ in range(rows)
        ])
        lr = 0.1 * (call + 1)
        assert workspace.takes(payloads, got_out, got_params)  # no quiet fallback to the array code
        expected = aggregate_payloads(payloads, expected_out, stale=expected_stale, params=expected_params, lr=lr)
        got = aggregate_payloads(payloads, got_out, stale=got_stale, params=got_params, lr=lr, device=workspace)
        assert got_out.tobytes() == expected_out.tobytes() and got_params.tobytes() == expected_params.tobytes(), call
        assert np.array_equal(np.unique(got.touched), expected.touched) and got.values is None
        assert not workspace.marks.any()  # clear between calls
        expected_stale, got_stale = expected.touched, got.touched


def test_the_device_aggregation_names_a_bad_row(emulated, monkeypatch):
    """A row with a header of another k, or indices out of order, repeated or out of range: an error naming it."""
    monkeypatch.setattr(_cuda, "launch", emulated)
    monkeypatch.setitem(sys.modules, "cupy", np)
    d, good, values = 1000, np.array([1, 5, 7, 9], np.int32), np.ones(4, np.float32)
    workspace = device_aggregation.DeviceAggregation(3, 4, d)
    payload = encode(good, values, d)  # pairs: the header, the values, the indices
    message = r"payload row 1 is not 4 of 1000 entries: its header must be \[0, 0, 0, 0, 4, 0, 0, 0\] and its indices unique"
    for bad in ([1, 7, 5, 9], [1, 5, 7, 1000], [-1, 5, 7, 9], [1, 5, 5, 9], "header"):
        payloads = np.stack([payload] * 3)
        if bad == "header":
            payloads[1, :8] = payload_header(5, d)
        else:
            payloads[1, 24:] = np.array(bad, np.int32).view(np.uint8)
        payloads[2, :8] = payload_header(3, d)  # a later bad row: the first is named
        params = np.ones(d, np.float32)
        with pytest.raises(ValueError, match=message):
            aggregate_payloads(payloads, np.zeros(d, np.float32), params=params, lr=0.5, device=workspace)
        assert np.all(params == 1)  # no update from a bad exchange
    out = np.zeros(d, np.float32)
    aggregate_payloads(np.stack([payload] * 3), out, device=workspace)  # the marks a failed call left are cleared first
    assert np.array_equal(np.flatnonzero(out), good) and np.all(out[good] == 1)


def test_the_device_aggregation_reads_a_bitmap_as_the_array_code_does(emulated, monkeypatch):
    """Bitmap rows: bits past d ignored, as the array code's decode does; a bitmap of another count than k (a bit more or
    less) an error naming the first such row, the parameters unchanged."""
    monkeypatch.setattr(_cuda, "launch", emulated)
    monkeypatch.setitem(sys.modules, "cupy", np)
    d, k, rows = 1003, 40, 3  # 4k > ceil(d / 8) = 126: a bitmap, its last byte's 5 high bits past d
    rng = np.random.default_rng(7)
    payloads = np.stack([
        encode(np.sort(rng.choice(d, k, replace=False)).astype(np.int32), rng.standard_normal(k).astype(np.float32), d)
        for _ in range(rows)
    ])
    last = payloads.shape[1] - 1
    assert not (payloads[:, last] & 0xF8).any()
    payloads[:, last] |= 0xF8  # the padding bits set
    workspace = device_aggregation.DeviceAggregation(rows, k, d)
    assert workspace.bitmap and workspace.takes(payloads, np.zeros(d, np.float32), None)
    expected, got = np.zeros(d, np.float32), np.zeros(d, np.float32)
    aggregate_payloads(payloads, expected)
    aggregate_payloads(payloads, got, device=workspace)
    assert got.tobytes() == expected.tobytes() and np.count_nonzero(got) > k
    bitmap = 8 + 4 * k  # where each row's bitmap starts
    message = r"payload row 1 is not 40 of 1003 entries: its header must be \[1, 0, 0, 0, 40, 0, 0, 0\] and its bitmap must mark k = 40"
    for change in ("a bit more", "a bit less"):
        bad = payloads.copy()
        for row in (1, 2):  # a later bad row too: the first is named
            bits = np.unpackbits(bad[row, bitmap:], bitorder="little")[:d]
            bits[np.flatnonzero(bits == (change == "a bit less"))[0]] ^= 1
            bad[row, bitmap:] = np.packbits(bits, bitorder="little")
        with pytest.raises(ValueError, match="payload bitmap marks"):
            aggregate_payloads(bad, np.zeros(d, np.float32))  # the array code refuses it too
        params = np.ones(d, np.float32)
        with pytest.raises(ValueError, match=message):
            aggregate_payloads(bad, np.zeros(d, np.float32), params=params, lr=0.5, device=workspace)
        assert np.all(params == 1)
    got[...] = np.nan
    aggregate_payloads(payloads, got, device=workspace)  # after the failed calls, the same sum again
    assert got.tobytes() == expected.tobytes()
