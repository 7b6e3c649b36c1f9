"""Codecs against independent references: round-trip bounds, exact payload sizes, aggregation, error feedback.

References are written from the definitions (float64 arithmetic, per-chunk Python loops, the kernels' 1-D top-k),
never from the codecs' own vectorised code.
"""

import ast
import math
import os
import tracemalloc

import numpy as np
import pytest

from mpiopt.arrays import to_numpy
from mpiopt.codecs import CODECS, ErrorFeedback, create, fused
from mpiopt.codecs.base import SCALE_BYTES, Chunked
from mpiopt.codecs.bitfields import unpack_fields
from mpiopt.codecs.scaled import E3M0_MAGNITUDES
from mpiopt.codecs.topk import topk_levels
from mpiopt.kernels.sparse import topk_indices
from mpiopt.kernels.threads import get_num_threads, set_num_threads

SIZES = [1, 2, 3, 7, 63, 64, 65, 100, 1000, 4095, 4096, 4097, 8192, 10001]
SMALL_CHUNK = 256  # several chunks and a ragged last one at test sizes


def _vector(d, seed=0, dtype=np.float32, heavy=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, d) if heavy else rng.standard_normal(d)
    return (x * rng.uniform(0.1, 10)).astype(dtype)


def _chunks(x, chunk):
    return [x[start : start + chunk] for start in range(0, x.shape[0], chunk)]


def _scales(codec, payload, d):
    """The float32 scales a payload carries (the first section after the empty header)."""
    return payload[: 4 * codec.chunks(d)].copy().view(np.float32)


def _round_trip(codec, x):
    payload = codec.encode(x)
    return payload, codec.decode(payload, x.shape[0], out=np.empty(x.shape[0], np.float64))


# ---- round trips --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 5, 4096, 10001])
def test_none_is_exact(d):
    x = _vector(d)
    assert np.array_equal(create("none").decode(create("none").encode(x), d), x)


def _bf16_reference(value):
    """Round a float32 to bfloat16 in float64 arithmetic: 8 significant bits (fewer below 2**-126), the nearer
    neighbour, ties to an even last bit, and infinity past the largest finite bfloat16 (IEEE's unbounded rounding)."""
    v = float(value)
    if not math.isfinite(v) or v == 0:
        return v
    exponent = max(math.frexp(abs(v))[1] - 1, -126)
    ulp = 2.0 ** (exponent - 7)
    low = math.floor(v / ulp)  # exact: v / ulp is a power-of-two scaling
    rest = v / ulp - low
    units = low + 1 if rest > 0.5 or (rest == 0.5 and low % 2) else low
    rounded = units * ulp
    return math.copysign(math.inf, v) if abs(rounded) >= 2.0**128 else rounded


def test_bf16_rounds_to_nearest_even():
    specials = np.array(
        [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, np.finfo(np.float32).max, -np.finfo(np.float32).max,
         np.finfo(np.float32).tiny, 1e-40, -1e-42, 3.0e38],
        dtype=np.float32,
    )
    ties = (np.arange(1, 40, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exactly half way: to even
    near = (np.arange(1, 40, dtype=np.uint32) << 16 | 0x7FFF).view(np.float32)
    x = np.concatenate([specials, ties, near, _vector(5000), _vector(5000, seed=1) * 1e-30])
    d = x.shape[0]
    decoded = create("bf16").decode(create("bf16").encode(x), d)
    expected = np.array([_bf16_reference(v) for v in x])
    assert np.array_equal(decoded.astype(np.float64), expected, equal_nan=True)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("d", [1, 7, 255, 256, 257, 1000, 5000])
def test_integers_within_half_a_step(name, d):
    codec = create(name, chunk=SMALL_CHUNK)
    qmax = 127 if name == "int8" else 7
    x = _vector(d, seed=d, heavy=True)
    x[: min(d, 300)] = 0.0 if d > 600 else x[: min(d, 300)]  # an all-zero chunk where there is room
    payload, decoded = _round_trip(codec, x)
    steps = _scales(codec, payload, x.shape[0])
    for i, (part, out) in enumerate(zip(_chunks(x, SMALL_CHUNK), _chunks(decoded, SMALL_CHUNK))):
        step = np.float32(np.abs(part.astype(np.float64)).max() / qmax)
        assert steps[i] == step
        q = out / step if step else out
        assert np.array_equal(q, np.round(q)) and np.abs(q).max() <= qmax  # decoded = integer * step
        assert np.abs(out - part.astype(np.float64)).max() <= step / 2 * (1 + 2.0**-20)


def _nearest_on_grid(values, decoded, grid):
    """Every decoded value is a grid point, and no grid point is nearer to its input."""
    on_grid = np.isclose(decoded[:, None], grid[None, :], rtol=1e-6, atol=0).any(axis=1) | (decoded == 0) & (grid == 0).any()
    best = np.abs(values[:, None] - grid[None, :]).min(axis=1)
    return on_grid.all() and (np.abs(values - decoded) <= best * (1 + 1e-6) + 1e-30).all()


@pytest.mark.parametrize("d", [1, 3, 256, 257, 3000])
def test_fp4_is_the_nearest_e3m0_value(d):
    codec = create("fp4", chunk=SMALL_CHUNK)
    x = _vector(d, seed=d, heavy=True)
    # The edges: both sides of every midpoint, zero and the absmax.
    if d >= 256:
        edges = np.array([0.0, 2.0**-7, 2.0**-7 * 0.999, 1.5 * 2.0**-3, 1.5 * 2.0**-3 * 1.001, 0.74, 0.76, 1.0])
        x[: edges.shape[0]] = edges * -3.0
        x[edges.shape[0]] = 3.0
    payload, decoded = _round_trip(codec, x)
    scales = _scales(codec, payload, x.shape[0])
    grid = np.concatenate([E3M0_MAGNITUDES, -E3M0_MAGNITUDES])
    for i, (part, out) in enumerate(zip(_chunks(x, SMALL_CHUNK), _chunks(decoded, SMALL_CHUNK))):
        scale = np.float32(np.abs(part).max())
        assert scales[i] == scale
        assert _nearest_on_grid(part.astype(np.float64) / scale, out / scale, grid)


def test_fp4_grid_is_e3m0():
    assert np.array_equal(E3M0_MAGNITUDES, [0, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1])


@pytest.mark.parametrize("d", [1, 8, 9, 256, 1001])
def test_sign_is_mean_magnitude_times_sign(d):
    codec = create("sign", chunk=SMALL_CHUNK)
    x = _vector(d, seed=d)
    x[0] = 0.0  # zero is sent as +
    payload, decoded = _round_trip(codec, x)
    for part, out in zip(_chunks(x, SMALL_CHUNK), _chunks(decoded, SMALL_CHUNK)):
        scale = np.float32(np.abs(part.astype(np.float64)).mean())
        assert np.array_equal(out, np.where(part >= 0, scale, -scale).astype(np.float64))


def _topk_reference(x, chunk, k):
    """Flat indices of the top k |x| of every chunk: the kernels' 1-D top-k, one chunk at a time."""
    picks = [topk_indices(part, min(k, part.shape[0])).astype(np.int64) + i * chunk for i, part in enumerate(_chunks(x, chunk))]
    return np.concatenate(picks)


@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("d", [1, 10, 64, 65, 4096, 4097, 10001])
def test_topk_sends_the_top_k_on_the_grid(d, bits):
    codec = create("topk", chunk=1024, k=32, bits=bits)
    x = _vector(d, seed=d + bits, heavy=True)
    payload, decoded = _round_trip(codec, x)
    chosen = _topk_reference(x, 1024, 32)
    assert np.array_equal(np.flatnonzero(decoded), chosen)
    scales = _scales(codec, payload, x.shape[0])
    levels = topk_levels(bits)
    grid = np.concatenate([levels, -levels])
    for i, part in enumerate(_chunks(x, 1024)):
        in_chunk = chosen[(chosen >= i * 1024) & (chosen < (i + 1) * 1024)]
        scale = np.float32(np.abs(x[in_chunk].astype(np.float64)).mean())
        assert scales[i] == scale
        assert _nearest_on_grid(x[in_chunk].astype(np.float64) / scale, decoded[in_chunk] / scale, grid)


@pytest.mark.parametrize("d, chunk, k, bits", [(1, 64, 8, 2), (65, 64, 8, 2), (1001, 64, 5, 3), (10001, 4096, 64, 2), (333, 333, 1, 1)])
def test_topk_counts_the_senders_of_every_entry(d, chunk, k, bits):
    """count_senders: per entry, how many rows picked it (the reference's top-k per row, counted one row at a time);
    rows that pick the same entries count it more than once, a zero-valued pick counts too."""
    codec = create("topk", chunk=chunk, k=k, bits=bits)
    vectors = [_vector(d, seed=s, heavy=True) for s in range(3)] + [np.zeros(d, np.float32)]
    vectors.append(vectors[0].copy())  # the same picks as row 0
    expected = np.zeros(d, np.int64)
    for x in vectors:
        expected[_topk_reference(x, chunk, k)] += 1
    payloads = np.stack([codec.encode(x) for x in vectors])
    for dtype in (np.int32, np.float64):
        out = np.full(d, 7, dtype)  # overwritten, not added to
        assert codec.count_senders(payloads, d, out) is out and np.array_equal(out, expected)
    dense = create("int8", chunk=64)
    assert np.array_equal(dense.count_senders(np.stack([dense.encode(x) for x in vectors]), d, np.empty(d, np.int32)), [5] * d)
    with pytest.raises(ValueError, match="out must have length d"):
        codec.count_senders(payloads, d, np.empty(d + 1, np.int32))


@pytest.mark.parametrize("c_loops", [True, False], ids=["c", "array"])
@pytest.mark.parametrize("d, chunk, k, bits", [(1, 64, 8, 2), (1001, 64, 5, 3), (10001, 4096, 64, 2), (333, 333, 1, 1)])
def test_topk_senders_mean_is_each_entrys_mean_over_its_senders(d, chunk, k, bits, c_loops, monkeypatch):
    """senders_mean against a float64 re-computation from the reference's picks and the decoded rows: the rows' sum in
    row order (float32), over the senders in float64 rounded to float32, +0.0 where nobody sent; counts >= 1."""
    monkeypatch.setattr(fused, "enabled", c_loops)
    codec = create("topk", chunk=chunk, k=k, bits=bits)
    vectors = [_vector(d, seed=s, heavy=True) for s in range(3)] + [np.zeros(d, np.float32), _vector(d, seed=0, heavy=True)]
    payloads = np.stack([codec.encode(x) for x in vectors])
    senders, total = np.zeros(d, np.int64), np.zeros(d, np.float32)
    for x, payload in zip(vectors, payloads):
        senders[_topk_reference(x, chunk, k)] += 1
        total += codec.decode(payload, d)  # +0.0 off the picks: the same float32 sums
    expected = (total.astype(np.float64) / np.maximum(senders, 1)).astype(np.float32)
    out, counts = np.full(d, 7, np.float32), np.full(d, 7, np.int32)
    assert codec.senders_mean(payloads, d, out, counts) is out
    assert np.array_equal(counts, np.maximum(senders, 1)) and np.array_equal(out.view(np.uint32), expected.view(np.uint32))
    with pytest.raises(ValueError, match="counts must have length d"):
        codec.senders_mean(payloads, d, out, np.empty(d + 1, np.int32))


def test_topk_ties_take_the_lowest_indices_and_nan_ranks_last():
    codec = create("topk", chunk=16, k=4, bits=2)
    x = np.zeros(48, np.float32)
    x[[3, 5, 7, 9, 11]] = [2.0, -1.0, 1.0, 1.0, -1.0]  # chunk 0: 2 and the first three of four tied at 1
    x[16:32] = np.nan
    x[[20, 30]] = [5.0, -4.0]  # chunk 1: two numbers, then NaN from the lowest index
    x[32:48] = 7.0  # chunk 2: all tied
    picked = np.sort(codec.select(np, x))
    assert np.array_equal(picked, [3, 5, 7, 9, 16, 17, 20, 30, 32, 33, 34, 35])
    assert np.array_equal(picked, _topk_reference(x, 16, 4))


def test_topk_of_a_whole_chunk_is_lossless_up_to_the_grid():
    codec = create("topk", chunk=8, k=8, bits=1)
    x = np.array([1, -1, 1, 1, -1, 1, -1, -1] * 3, np.float32)
    assert np.array_equal(codec.decode(codec.encode(x), 24), x)


@pytest.mark.parametrize("name", ["int8", "int4", "fp4", "sign", "topk"])
def test_a_non_finite_chunk_decodes_non_finite(name):
    codec = create(name, chunk=64)
    x = _vector(256)
    x[70] = np.nan
    x[200] = np.inf
    decoded = codec.decode(codec.encode(x), 256)
    assert np.isfinite(decoded[:64]).all() and np.isfinite(decoded[128:192]).all()
    assert not np.isfinite(decoded[64:128]).all() and not np.isfinite(decoded[192:]).all()


def test_topk_sends_inf_and_ranks_nan_last():
    codec = create("topk", chunk=64, k=8)
    x = _vector(128)
    x[3], x[70] = np.inf, np.nan
    decoded = codec.decode(codec.encode(x), 128)
    assert not np.isfinite(decoded[:64][decoded[:64] != 0]).any()  # inf is a number: sent, its chunk's scale inf
    assert decoded[70] == 0 and np.isfinite(decoded[64:]).all()  # NaN below every number (algorithms check first)


def test_float64_input_and_output():
    x64 = _vector(3000, dtype=np.float64, heavy=True)
    x32 = x64.astype(np.float32)
    for name in CODECS:
        codec = create(name, chunk=512) if name not in ("none", "bf16") else create(name)
        payload = codec.encode(x64)
        decoded = codec.decode(payload, 3000, out=np.empty(3000, np.float64))
        if name in ("none", "bf16"):  # float32 bits on the wire: float64 input is rounded to float32 first
            assert np.array_equal(payload, codec.encode(x32))
        # Within the bound float32 input meets, up to float32's rounding of the input.
        bound = np.abs(codec.decode(codec.encode(x32), 3000) - x32).max()
        assert np.abs(decoded - x64).max() <= bound * (1 + 1e-3) + 1e-6 * np.abs(x64).max(), name


# ---- bytes ------------------------------------------------------------------------------------------------


def _expected_nbytes(name, d, chunk=4096, k=64, bits=2):
    """The layouts of docs/codecs.md, written out."""
    chunks = -(-d // chunk)
    if name == "none":
        return 4 * d
    if name == "bf16":
        return 2 * d
    if name == "int8":
        return 4 * chunks + d
    if name in ("int4", "fp4"):
        return 4 * chunks + -(-d // 2)
    if name == "sign":
        return 4 * chunks + -(-d // 8)
    sent = d // chunk * k + min(k, d % chunk)
    return 4 * chunks + -(-sent * 12 // 8) + -(-sent * bits // 8)


@pytest.mark.parametrize("name", list(CODECS))
def test_payload_sizes_are_exact(name):
    codec = create(name)
    for d in SIZES:
        payload = codec.encode(_vector(d, seed=d))
        breakdown = codec.bytes_breakdown(d)
        assert payload.shape == (codec.payload_nbytes(d),) == (sum(breakdown.values()),) == (_expected_nbytes(name, d),)
        assert list(breakdown)[0] == "header" and breakdown["header"] == 0


def test_topk_bits_per_parameter_at_the_defaults():
    codec = create("topk")
    # Per chunk of 4,096: a float32 scale, 64 indices of 12 bits, 64 values of 2 bits.
    assert codec.bytes_breakdown(4096) == {"header": 0, "scales": 4, "indices": 96, "values": 16}
    assert codec.bits_per_parameter(4096) == 928 / 4096 == 0.2265625
    assert codec.bits_per_parameter(40 * 4096) == 0.2265625


D_MODEL = 11_000_000  # the GPT task's size


@pytest.mark.parametrize("name, at_least", [("topk", 140), ("fp4", 7.5), ("int8", 3.9), ("int4", 7.5), ("bf16", 2), ("sign", 31)])
def test_byte_goals_against_float32(name, at_least):
    ratio = 4 * D_MODEL / create(name).payload_nbytes(D_MODEL)
    assert ratio >= at_least


# ---- aggregation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("ranks", [1, 3])
def test_aggregate_is_the_sum_of_the_decoded(name, ranks):
    d = 5000
    codec = create(name, chunk=512) if name != "none" and name != "bf16" else create(name)
    payloads = np.stack([codec.encode(_vector(d, seed=r)) for r in range(ranks)])
    decoded = [codec.decode(row, d) for row in payloads]
    in_order = decoded[0].copy()
    for one in decoded[1:]:
        in_order += one
    total = codec.aggregate(payloads, d)
    assert np.array_equal(total, in_order)  # rank order, float32: the same bits on every rank
    exact = np.sum([one.astype(np.float64) for one in decoded], axis=0)
    assert np.allclose(total, exact, rtol=2e-7 * ranks, atol=1e-7 * np.abs(exact).max())
    mean = codec.aggregate(payloads, d, out=np.empty(d, np.float32), mean=True)
    assert np.array_equal(mean, in_order / np.float32(ranks))


def test_aggregate_rows_need_not_be_aligned():
    codec = create("int8", chunk=100)
    d = 333  # 4 * 4 + 333 = 349 bytes: odd rows
    payloads = np.stack([codec.encode(_vector(d, seed=r)) for r in range(3)])
    assert np.array_equal(codec.aggregate(payloads, d), sum(codec.decode(row.copy(), d) for row in payloads))


# ---- error feedback ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CODECS))
def test_error_feedback_loses_nothing(name):
    d, steps = 3000, 6
    codec = create(name, chunk=512) if name not in ("none", "bf16") else create(name)
    feedback = ErrorFeedback(codec, d, beta=1.0, dtype=np.float64)
    inputs = sum_sent = np.zeros(d)
    for step in range(steps):
        x = _vector(d, seed=step, dtype=np.float64)
        inputs = inputs + x
        sum_sent = sum_sent + codec.decode(feedback.encode(x), d, out=np.empty(d, np.float64))
    scale = np.abs(inputs).max()
    assert np.allclose(sum_sent + feedback.residual, inputs, rtol=0, atol=1e-13 * steps * scale)


@pytest.mark.parametrize("name", ["topk", "int4", "sign"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_error_feedback_with_decay_is_the_recursion(name, dtype):
    d, beta = 2000, 0.95
    codec = create(name, chunk=256)
    feedback = ErrorFeedback(codec, d, beta=beta, dtype=dtype)
    reference, largest = np.zeros(d), 0.0
    for step in range(5):
        x = _vector(d, seed=10 + step, dtype=dtype)
        largest = max(largest, float(np.abs(x).max()))
        payload = feedback.encode(x)
        accumulated = beta * reference + x
        if dtype == np.float64:  # what was sent is the encoding of the accumulator, re-computed
            assert np.array_equal(payload, codec.encode(accumulated))
        reference = accumulated - codec.decode(payload, d, out=np.empty(d, np.float64))
    tolerance = 5 * np.finfo(dtype).eps * 5  # a few roundings of the input's size per step, five steps
    assert np.allclose(feedback.residual, reference, rtol=0, atol=tolerance * largest)


def test_error_feedback_state_round_trips():
    codec = create("topk", chunk=256, k=8)
    first = ErrorFeedback(codec, 1000, beta=0.9)
    for step in range(3):
        first.encode(_vector(1000, seed=step))
    state = {key: (to_numpy(value).copy() if hasattr(value, "shape") else value) for key, value in first.state_dict().items()}
    assert set(state) == {"codec", "codec_chunk", "codec_k", "codec_bits", "beta", "residual"}
    assert all(isinstance(v, (str, int, float, np.ndarray)) for v in state.values())
    second = ErrorFeedback(create("topk", chunk=256, k=8), 1000, beta=0.9)
    second.load_state_dict(state)
    x = _vector(1000, seed=99)
    assert np.array_equal(first.encode(x), second.encode(x))
    assert np.array_equal(first.residual, second.residual)
    with pytest.raises(ValueError, match="codec_k"):
        ErrorFeedback(create("topk", chunk=256, k=9), 1000, beta=0.9).load_state_dict(state)
    with pytest.raises(ValueError, match="beta"):
        ErrorFeedback(codec, 1000, beta=1.0).load_state_dict(state)


# ---- bad input --------------------------------------------------------------------------------------------


def test_unknown_codec_names_the_value_and_the_choices():
    with pytest.raises(ValueError) as error:
        create("fp8")
    assert "'fp8'" in str(error.value) and all(name in str(error.value) for name in CODECS)


@pytest.mark.parametrize(
    "name, params, words",
    [
        ("topk", {"k": 0}, ["k", "0", ">= 1"]),
        ("topk", {"k": 5000}, ["k", "5000", "4096"]),
        ("topk", {"bits": 9}, ["bits", "9", "8"]),
        ("topk", {"bits": 2.0}, ["bits", "2.0"]),
        ("int8", {"chunk": 0}, ["chunk", "0"]),
        ("int8", {"chunk": True}, ["chunk", "True"]),
        ("int8", {"bits": 4}, ["'bits'", "chunk"]),
        ("none", {"chunk": 64}, ["'chunk'", "none"]),
    ],
)
def test_bad_parameters_are_refused_by_name(name, params, words):
    with pytest.raises(ValueError) as error:
        create(name, **params)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_bad_arrays_and_beta_are_refused():
    codec = create("int8")
    with pytest.raises(ValueError, match="4100"):
        codec.encode(_vector(4096), out=np.empty(4099, np.uint8))
    with pytest.raises(TypeError, match="float32 or float64"):
        codec.encode(np.ones(10, np.float16))
    with pytest.raises(ValueError, match="beta"):
        ErrorFeedback(codec, 10, beta=1.5)


# ---- no d-sized allocation per call, the layer ------------------------------------------------------------


@pytest.mark.parametrize("name", list(CODECS))
def test_encode_and_decode_allocate_little_once_warm(name):
    d = 1 << 20
    codec = create(name)
    x = _vector(d)
    payload, out = codec.encode(x), np.empty(d, np.float32)
    codec.decode(payload, d, out)
    tracemalloc.start()
    try:
        codec.encode(x, payload)
        codec.decode(payload, d, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Per-chunk and per-selected-entry arrays and bounded blocks only: far below one d-sized float32 temporary.
    assert peak < (2 * d if name == "topk" else d // 2)


def test_codecs_import_only_arrays_kernels_and_themselves():
    folder = os.path.join(os.path.dirname(__file__), "..", "..", "mpiopt", "codecs")
    for file in os.listdir(folder):
        if file.endswith(".py"):
            with open(os.path.join(folder, file), encoding="utf-8") as handle:
                tree = ast.parse(handle.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    top = (node.module or "").split(".")[0]
                    assert node.level == 1 or top in ("arrays", "kernels"), f"{file} imports {node.module}"
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                    assert not any(n and n.startswith("mpiopt") for n in names), f"{file} imports {names}"


# ---- the fused C loops: the array code's bits ---------------------------------------------------------------


def _specials(x):
    """An all-zero chunk, -0.0, NaN, inf and -inf in their own chunks of 64 (when ``x`` has room)."""
    if x.shape[0] >= 5000:
        x[:300] = 0.0
        x[[301, 1000, 2000, 3000]] = [-0.0, np.nan, np.inf, -np.inf]
    return x


def _inputs(d, seed, special):
    """Heavy-tailed, with :func:`_specials`, or rounded to integers (many ties for topk)."""
    x = _vector(d, seed=seed, heavy=True)
    return _specials(x) if special == "non-finite" else np.round(x) if special == "ties" else x


def _everything(codec, d, special, xp=np):
    """Every output of every entry point (encode, decode, add_decoded, aggregate, error feedback) at length ``d``, as numpy."""
    x = xp.asarray(_inputs(d, d, special))
    rows = xp.stack([codec.encode(xp.asarray(_inputs(d, d + r, special))) for r in range(3)])
    outputs = [codec.encode(x), codec.decode(rows[1], d), codec.add_decoded(rows[2], d, x.copy())]
    five = xp.concatenate([rows, rows[::-1][:2]])
    outputs += [codec.aggregate(rows, d), codec.aggregate(rows, d, mean=True), codec.aggregate(rows[:1], d, mean=True)]
    outputs += [codec.aggregate(five[:4], d, mean=True), codec.aggregate(five, d, mean=True)]
    for payloads in (rows[:1], five):
        counts = xp.empty(d, dtype=np.int32)
        outputs += [codec.senders_mean(payloads, d, xp.empty(d, dtype=np.float32), counts), counts]
    for beta in (1.0, 0.95):
        feedback = ErrorFeedback(codec, d, beta=beta, like=x)
        outputs += [feedback.encode(xp.asarray(_inputs(d, s, special))) for s in range(3)]
        outputs.append(feedback.residual.copy())
    return [to_numpy(a) for a in outputs]


@pytest.mark.skipif(fused._codecsc is None, reason="the C loops are not built")
@pytest.mark.parametrize(
    "name, params",
    [(name, {"chunk": chunk}) for name in ("int8", "int4", "fp4", "sign") for chunk in (64, 200, 4096)]
    + [("none", {}), ("bf16", {}), ("topk", {}), ("topk", {"chunk": 64, "k": 64, "bits": 8}), ("topk", {"chunk": 100, "k": 7, "bits": 3}),
       ("topk", {"chunk": 333, "k": 1, "bits": 1})],
)
def test_the_c_loops_give_the_array_codes_bits(name, params, monkeypatch):
    codec = create(name, **params)
    assert fused.available(codec)
    for d in (1, 7, 257, 5000, 10001):
        for special in ("", "non-finite", "ties"):
            with_c = _everything(codec, d, special)
            monkeypatch.setattr(fused, "enabled", False)
            with_numpy = _everything(codec, d, special)
            monkeypatch.setattr(fused, "enabled", True)
            for i, (a, b) in enumerate(zip(with_c, with_numpy)):
                assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), (d, special, i)


@pytest.mark.skipif(fused._codecsc is None, reason="the C loops are not built")
@pytest.mark.parametrize("name", list(CODECS))
def test_the_c_loops_give_the_same_bits_on_two_threads(name):
    d = 600_001  # parts of at least 2**18 entries: two threads take a share each
    codec = create(name)

    def run():
        feedback = ErrorFeedback(codec, d, beta=0.95)
        outputs = [feedback.encode(_vector(d, seed=s, heavy=True)) for s in range(2)] + [feedback.residual.copy()]
        return outputs + [codec.aggregate(np.stack(outputs[:2]), d, mean=True)]

    previous = get_num_threads()
    one = run()
    set_num_threads(2)
    try:
        two = run()
    finally:
        set_num_threads(previous)
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(one, two))


# ---- cupy where a GPU is: the same bits as numpy ----------------------------------------------------------


def _same_bits_but_nans(codec, d, a, b):
    """Equal bits, but that two NaNs are equal whatever their payload and sign (the GPU's arithmetic returns its
    canonical NaN, x86 a negative one, and which operand's NaN a CPU build's a + b keeps is the compiler's order):
    floats, a payload's scales, and (topk) the sign bits of the value codes of a chunk whose scale is NaN on both
    sides (every value of it decodes to NaN); the rest of a payload bytewise."""
    if a.dtype != np.uint8:
        both_nan = np.isnan(a) & np.isnan(b)
        return a.dtype == b.dtype and np.array_equal(np.where(both_nan, 0, a).view(np.uint8), np.where(both_nan, 0, b).view(np.uint8))
    if a.shape != b.shape:
        return False
    if codec.name != "topk":  # a dense codec's codes are the same (its kernels give fp4's inf / inf x86's code)
        at = SCALE_BYTES * codec.chunks(d) if isinstance(codec, Chunked) else 0
        return _same_bits_but_nans(codec, d, a[:at].copy().view(np.float32), b[:at].copy().view(np.float32)) and np.array_equal(a[at:], b[at:])
    sa, sb = codec._sections(a, d), codec._sections(b, d)
    scales_a, scales_b = sa["scales"].copy().view(np.float32), sb["scales"].copy().view(np.float32)
    if not (np.array_equal(sa["indices"], sb["indices"]) and _same_bits_but_nans(codec, d, scales_a, scales_b)):
        return False
    count = codec.selected(d)
    codes_a, codes_b = (unpack_fields(np, s["values"], codec.bits, count) for s in (sa, sb))
    unsigned = np.isnan(scales_a)[codec._chunk_of(np, d)]
    sign = 1 << (codec.bits - 1)
    return np.array_equal(np.where(unsigned, codes_a & ~sign, codes_a), np.where(unsigned, codes_b & ~sign, codes_b))


@pytest.mark.parametrize(
    "params", [{}, {"chunk": 64, "k": 64, "bits": 8}, {"chunk": 100, "k": 8, "bits": 3}, {"chunk": 333, "k": 1, "bits": 1}],
    ids=["defaults", "whole-chunk", "k8-3bits", "array-code"],
)
def test_topks_cuda_kernels_give_the_numpy_bits(params, xp):
    """topk on cupy (its CUDA kernels, but for k 1 of 333: the array code) against numpy (the C loops where built) at
    awkward lengths, with NaN, +-inf, -0.0 and ties: every entry point, error feedback with and without decay."""
    if xp is np:
        pytest.skip("numpy is the reference; cupy and a GPU are needed")
    from mpiopt.kernels import _codecs_cuda

    codec = create("topk", **params)
    assert _codecs_cuda.takes_topk(codec.chunk, codec.k, codec.bits, codec.index_bits, (xp.zeros(1, np.float32),), xp.zeros(1, np.uint8)) == (codec.k != 1)
    for d in (1, 7, 257, 5000, 10001):
        for special in ("", "non-finite", "ties"):
            with_numpy, with_cupy = _everything(codec, d, special), _everything(codec, d, special, xp)
            for i, (a, b) in enumerate(zip(with_numpy, with_cupy)):
                assert _same_bits_but_nans(codec, d, a, b), (d, special, i)


@pytest.mark.parametrize(
    "name, params", [(name, {"chunk": chunk}) for name in ("int8", "int4", "fp4", "sign") for chunk in (64, 200, 4096)] + [("none", {}), ("bf16", {})],
)
def test_dense_cuda_kernels_give_the_numpy_bits(name, params, xp):
    """The dense codecs on cupy (their CUDA kernels) against numpy (the C loops where built) at awkward lengths, with
    NaN, +-inf, -0.0 and ties: every entry point, error feedback with and without decay."""
    if xp is np:
        pytest.skip("numpy is the reference; cupy and a GPU are needed")
    from mpiopt.kernels import _codecs_dense_cuda

    codec = create(name, **params)
    assert _codecs_dense_cuda.takes_dense(fused._KINDS[name], fused._chunk(codec), (xp.zeros(1, np.float32),), xp.zeros(1, np.uint8))
    for d in (1, 7, 257, 5000, 10001):
        for special in ("", "non-finite", "ties"):
            with_numpy, with_cupy = _everything(codec, d, special), _everything(codec, d, special, xp)
            for i, (a, b) in enumerate(zip(with_numpy, with_cupy)):
                assert _same_bits_but_nans(codec, d, a, b), (d, special, i)


@pytest.mark.parametrize("name", list(CODECS))
def test_same_bits_on_every_array_module(name, xp):
    d = 10001
    codec = create(name, chunk=1024) if name not in ("none", "bf16") else create(name)
    x = _vector(d, seed=3)
    payload = codec.encode(xp.asarray(x))
    assert np.array_equal(to_numpy(payload), codec.encode(x))
    decoded = codec.decode(payload, d)
    assert np.array_equal(to_numpy(decoded), codec.decode(codec.encode(x), d))
    stack = xp.stack([payload, payload])
    assert np.array_equal(to_numpy(codec.aggregate(stack, d)), codec.aggregate(np.stack([codec.encode(x)] * 2), d))
