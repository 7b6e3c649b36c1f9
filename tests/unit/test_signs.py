"""Sign packing and the bit-sliced majority vote against plain numpy references."""

import shutil

import numpy as np
import pytest

from mpiopt.arrays import to_numpy
from mpiopt.kernels import (
    chunk_bounds,
    majority_vote,
    pack_signs,
    packed_nbytes,
    sign_float,
    unpack_signs,
    vote_chunk,
)
from mpiopt.kernels import signs

SIZES = [1, 7, 8, 9, 63, 64, 65, 1000, 4097]
VOTERS = [1, 2, 3, 4, 7, 8, 15]
KINDS = ["normal", "zeros", "negative"]



def awkward(rng, d, kind):
    """float32 inputs: random, a mix of +-0.0 and +-1, or all negative."""
    if kind == "normal":
        return rng.standard_normal(d).astype(np.float32)
    if kind == "zeros":
        return rng.choice(np.array([0.0, -0.0, 1.0, -1.0], dtype=np.float32), d)
    return -rng.uniform(1e-30, 1.0, d).astype(np.float32)


def reference_signs(x):
    """+1 for x >= 0 (so for +0.0 and -0.0), -1 otherwise, as int64."""
    signs = np.ones(x.shape, dtype=np.int64)
    signs[x < 0] = -1
    return signs


def reference_pack(signs):
    """Element i to bit i % 8 of byte i // 8, one element at a time."""
    packed = np.zeros(-(-signs.shape[0] // 8), dtype=np.uint8)
    for i, s in enumerate(signs):
        if s > 0:
            packed[i // 8] |= 1 << (i % 8)
    return packed


def reference_vote(sign_rows):
    """sign of the int64 sum of the votes, a tie (sum 0) voting +1."""
    return np.where(sign_rows.sum(axis=0) >= 0, 1, -1)


def random_votes(rng, voters, d):
    """(P, d) signs +-1, with some columns forced to an exact tie when P is even."""
    signs = rng.choice(np.array([-1, 1]), (voters, d))
    if voters % 2 == 0:
        signs[:, ::3] = np.where(np.arange(voters)[:, None] < voters // 2, -1, 1)
    return signs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", SIZES)
def test_pack_bit_order_and_round_trip(xp, d, kind):
    rng = np.random.default_rng(d)
    x = awkward(rng, d, kind)
    packed = pack_signs(xp.asarray(x))
    assert packed.dtype == np.uint8 and packed.shape == (packed_nbytes(d),)
    np.testing.assert_array_equal(to_numpy(packed), reference_pack(reference_signs(x)))
    np.testing.assert_array_equal(to_numpy(unpack_signs(packed, d)), reference_signs(x))


def test_zero_and_negative_zero_are_positive(xp):
    x = xp.asarray(np.array([0.0, -0.0, -1e-45, 1e-45, -np.inf, np.inf], dtype=np.float32))
    np.testing.assert_array_equal(to_numpy(sign_float(x)), [1, 1, -1, 1, -1, 1])


@pytest.mark.parametrize("d", [1, 7, 9, 63, 65])
def test_pad_bits_are_zero_and_ignored(xp, d):
    x = np.full(d, 1.0, dtype=np.float32)  # every real bit set
    packed = to_numpy(pack_signs(xp.asarray(x)))
    assert packed[-1] >> (d % 8) == 0
    dirty = packed.copy()
    dirty[-1] |= 0xFF << (d % 8) & 0xFF  # set every pad bit
    np.testing.assert_array_equal(to_numpy(unpack_signs(xp.asarray(dirty), d)), np.ones(d))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int8])
def test_unpack_dtype_and_out(xp, dtype):
    d = 4097
    x = awkward(np.random.default_rng(1), d, "normal")
    packed = pack_signs(xp.asarray(x))
    out = xp.empty(d, dtype=dtype)
    result = unpack_signs(packed, d, dtype=dtype, out=out)
    assert result is out and result.dtype == dtype
    np.testing.assert_array_equal(to_numpy(result), reference_signs(x))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sign_float_keeps_dtype(xp, dtype):
    x = awkward(np.random.default_rng(2), 1000, "zeros").astype(dtype)
    result = sign_float(xp.asarray(x))
    assert result.dtype == dtype
    np.testing.assert_array_equal(to_numpy(result), reference_signs(x))


def test_pack_into_out(xp):
    x = xp.asarray(awkward(np.random.default_rng(3), 65, "normal"))
    out = xp.zeros(packed_nbytes(65), dtype=xp.uint8)
    assert pack_signs(x, out=out) is out
    np.testing.assert_array_equal(to_numpy(out), to_numpy(pack_signs(x)))


def test_pack_in_several_blocks(xp, monkeypatch):
    """Blocks of 16 signs (2 bytes) over 4097: a NaN in the last block is still found."""
    monkeypatch.setattr(signs, "_PACK_BLOCK", 16)
    x = awkward(np.random.default_rng(4), 4097, "zeros")
    np.testing.assert_array_equal(to_numpy(pack_signs(xp.asarray(x))), reference_pack(reference_signs(x)))
    x[-1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        pack_signs(xp.asarray(x))


def test_nan_policy(xp):
    x = xp.asarray(np.array([1.0, np.nan, -1.0, 0.0], dtype=np.float32))
    with pytest.raises(ValueError, match="NaN"):
        pack_signs(x)
    with pytest.raises(ValueError, match="NaN"):
        sign_float(x)
    # Documented: unchecked packs NaN as -1 (bit 0), since NaN >= 0 is false.
    assert to_numpy(pack_signs(x, nan_policy="unchecked")).tolist() == [0b1001]
    np.testing.assert_array_equal(to_numpy(sign_float(x, nan_policy="unchecked")), [1, -1, -1, 1])
    with pytest.raises(ValueError, match="nan_policy"):
        pack_signs(x, nan_policy="ignore")


@pytest.mark.parametrize("voters", VOTERS)
@pytest.mark.parametrize("d", SIZES)
def test_majority_vote_matches_reference(xp, d, voters):
    signs = random_votes(np.random.default_rng(d * 100 + voters), voters, d)
    stack = np.stack([reference_pack(row) for row in signs])
    voted = majority_vote(xp.asarray(stack), d)
    assert voted.dtype == np.uint8 and voted.shape == (packed_nbytes(d),)
    np.testing.assert_array_equal(to_numpy(unpack_signs(voted, d)), reference_vote(signs))


@pytest.mark.parametrize("voters", [1, 3, 8])
def test_vote_in_several_blocks(xp, voters, monkeypatch):
    """Blocks of 3 words over 65 words: the scratch planes are reused, and the last block is shorter."""
    monkeypatch.setattr(signs, "_VOTE_BLOCK_WORDS", 3)
    monkeypatch.setattr(signs, "_signsc", None)  # the numpy code's blocks (the C loop has its own)
    d = 4097
    sign_rows = random_votes(np.random.default_rng(voters), voters, d)
    stack = np.stack([reference_pack(row) for row in sign_rows])
    voted = majority_vote(xp.asarray(stack), d)
    np.testing.assert_array_equal(to_numpy(unpack_signs(voted, d)), reference_vote(sign_rows))


@pytest.mark.parametrize("voters", [2, 4, 8])
def test_tie_votes_plus_one(xp, voters):
    half = np.zeros((voters, 1), dtype=np.uint8)
    half[: voters // 2] = 1
    assert to_numpy(majority_vote(xp.asarray(half), 1)).tolist() == [1]


@pytest.mark.parametrize("d", SIZES)
def test_single_voter_returns_input(xp, d):
    packed = reference_pack(random_votes(np.random.default_rng(d), 1, d)[0])
    np.testing.assert_array_equal(to_numpy(majority_vote(xp.asarray(packed[None, :]), d)), packed)


@pytest.mark.parametrize("voters", [2, 3, 8])
@pytest.mark.parametrize("d", [1, 9, 63, 65, 1000])
def test_padding_never_affects_the_vote(xp, d, voters):
    rng = np.random.default_rng(d + voters)
    signs = random_votes(rng, voters, d)
    clean = np.stack([reference_pack(row) for row in signs])
    expected = to_numpy(majority_vote(xp.asarray(clean), d))
    if d % 8:
        assert expected[-1] >> (d % 8) == 0
    # Garbage pad bits and garbage bytes after the vector, in narrow and word-aligned rows.
    for width in (clean.shape[1] + 3, packed_nbytes(d, align=8)):
        dirty = rng.integers(0, 256, (voters, width), dtype=np.uint8)
        dirty[:, : clean.shape[1]] = clean
        if d % 8:
            dirty[:, clean.shape[1] - 1] |= 0xFF << (d % 8) & 0xFF
        np.testing.assert_array_equal(to_numpy(majority_vote(xp.asarray(dirty), d)), expected)


def test_vote_into_out(xp):
    stack = xp.asarray(np.random.default_rng(5).integers(0, 256, (3, 9), dtype=np.uint8))
    out = xp.zeros(9, dtype=xp.uint8)
    assert majority_vote(stack, 65, out=out) is out
    np.testing.assert_array_equal(to_numpy(out), to_numpy(majority_vote(stack, 65)))


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7, 8, 15])
@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 63, 64, 65, 1000])
def test_chunk_bounds_partition_whole_words(nbytes, parts):
    bounds = chunk_bounds(nbytes, parts)
    assert bounds.shape == (parts, 2)
    assert bounds[0, 0] == 0 and bounds[-1, 1] == nbytes
    np.testing.assert_array_equal(bounds[1:, 0], bounds[:-1, 1])
    assert np.all(bounds[:, 0] % 8 == 0) and np.all(bounds[:, 1] >= bounds[:, 0])
    words = -(-bounds[:, 1] // 8) - bounds[:, 0] // 8
    assert words.max() - words.min() <= 1


@pytest.mark.parametrize("voters", VOTERS)
@pytest.mark.parametrize("d", SIZES)
def test_two_phase_vote_equals_whole_vote(xp, d, voters):
    """Simulate Alltoall (rank q gets chunk q of every vector) + per-chunk vote + Allgather."""
    signs = random_votes(np.random.default_rng(d * 7 + voters), voters, d)
    stack = xp.asarray(np.stack([reference_pack(row) for row in signs]))
    bounds = chunk_bounds(packed_nbytes(d), voters)
    block = int((bounds[:, 1] - bounds[:, 0]).max())  # a common Alltoall block, zero-padded
    gathered = []
    for start, stop in bounds.tolist():
        received = xp.zeros((voters, block), dtype=xp.uint8)
        received[:, : stop - start] = stack[:, start:stop]
        gathered.append(vote_chunk(received, d, start, stop))
    np.testing.assert_array_equal(to_numpy(xp.concatenate(gathered)), to_numpy(majority_vote(stack, d)))


def test_packed_nbytes():
    assert [packed_nbytes(d) for d in (0, 1, 8, 9, 64, 65)] == [0, 1, 1, 2, 8, 9]
    assert [packed_nbytes(d, align=8) for d in (0, 1, 64, 65)] == [0, 8, 8, 16]


def test_empty_vector(xp):
    empty = xp.zeros(0, dtype=xp.float32)
    assert pack_signs(empty).shape == (0,) and pack_signs(empty).dtype == np.uint8
    assert unpack_signs(xp.zeros(0, dtype=xp.uint8), 0).shape == (0,)
    assert majority_vote(xp.zeros((3, 0), dtype=xp.uint8), 0).shape == (0,)


def test_bad_arguments_are_named(xp):
    x = xp.zeros(9, dtype=xp.float32)
    with pytest.raises(TypeError, match="x must be a numpy or cupy array, got list"):
        pack_signs([1.0, 2.0])
    with pytest.raises(TypeError, match="x must have a dtype of kind 'f'"):
        pack_signs(xp.zeros(9, dtype=xp.int32))
    with pytest.raises(ValueError, match="x must be 1-D"):
        pack_signs(xp.zeros((3, 3), dtype=xp.float32))
    with pytest.raises(ValueError, match=r"out must be C-contiguous with shape \(2,\), got shape \(3,\)"):
        pack_signs(x, out=xp.zeros(3, dtype=xp.uint8))
    with pytest.raises(ValueError, match=r"packed must have ceil\(d / 8\) = 2 bytes for d = 9, got 3"):
        unpack_signs(xp.zeros(3, dtype=xp.uint8), 9)
    with pytest.raises(TypeError, match="packed must have dtype uint8"):
        unpack_signs(xp.zeros(2, dtype=xp.int8), 9)
    with pytest.raises(TypeError, match="dtype must be a floating or signed integer type"):
        unpack_signs(xp.zeros(2, dtype=xp.uint8), 9, dtype=np.uint8)
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        unpack_signs(xp.zeros(2, dtype=xp.uint8), 9, out=xp.zeros(18, dtype=xp.float32)[::2])
    with pytest.raises(ValueError, match="d must be >= 0, got -1"):
        unpack_signs(xp.zeros(0, dtype=xp.uint8), -1)
    with pytest.raises(TypeError, match="d must be an int, got bool"):
        majority_vote(xp.zeros((2, 2), dtype=xp.uint8), True)
    with pytest.raises(ValueError, match=r"packed_stack must have shape \(P >= 1, m >= 2\)"):
        majority_vote(xp.zeros((2, 1), dtype=xp.uint8), 9)
    with pytest.raises(TypeError, match="packed must have dtype uint8, got int8"):
        signs.apply_signs(xp.zeros(2, dtype=xp.int8), x, 0.1)
    with pytest.raises(ValueError, match=r"packed must have ceil\(d / 8\) = 2 bytes for d = 9, got 3"):
        signs.apply_signs(xp.zeros(3, dtype=xp.uint8), x, 0.1)
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        chunk_bounds(8, 0)
    with pytest.raises(ValueError, match="stop must be >= 0 and <= 2, got 3"):
        vote_chunk(xp.zeros((2, 8), dtype=xp.uint8), 9, 0, 3)


@pytest.mark.parametrize("voters", [1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 33, 100])
@pytest.mark.parametrize("d", [1, 63, 64, 65, 4097, 64 * 300 + 5])
def test_c_vote_equals_numpy_vote(voters, d, monkeypatch):
    """The fused C loop (built wherever a C compiler is) gives the numpy code's bits."""
    if shutil.which("cc") or shutil.which("gcc"):
        assert signs._signsc is not None, "mpiopt.kernels._signsc was not built although a C compiler is present"
    if signs._signsc is None:
        pytest.skip("mpiopt.kernels._signsc not built (no C compiler): the numpy code runs everywhere")
    stack = np.random.default_rng([voters, d]).integers(0, 256, (voters, signs.packed_nbytes(d)), dtype=np.uint8)
    fused = majority_vote(stack, d)
    monkeypatch.setattr(signs, "_signsc", None)
    np.testing.assert_array_equal(fused, majority_vote(stack, d))


@pytest.mark.parametrize("c_loop", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [1, 7, 8, 9, 63, 65, 1001])
@pytest.mark.parametrize("decay", [1.0, 1.0 - 0.01 * 0.1])
def test_apply_signs_is_the_numpy_passes(c_loop, dtype, d, decay, monkeypatch):
    """x * decay - lr * s, rounded as the separate numpy passes round it, with NaN, +-0.0 and extremes in x."""
    if not c_loop:
        monkeypatch.setattr(signs, "_signsc", None)
    elif signs._signsc is None:
        pytest.skip("mpiopt.kernels._signsc was not built")
    rng = np.random.default_rng([d, int(decay < 1)])
    x = rng.standard_normal(d).astype(dtype)
    x[: min(d, 4)] = np.array([np.nan, 0.0, -0.0, np.finfo(dtype).max], dtype)[: min(d, 4)]
    packed = pack_signs(rng.standard_normal(d).astype(dtype))
    lr = 0.01
    expect = x.copy()
    if decay != 1.0:
        expect *= decay
    expect -= lr * unpack_signs(packed, d, dtype=dtype)
    got = signs.apply_signs(packed, x.copy(), lr, decay)
    assert got.tobytes() == expect.tobytes()
    # an independent float64 recomputation of the values (not the roundings)
    ref = x.astype(np.float64) * decay - lr * np.where(unpack_signs(packed, d, dtype=np.float64) > 0, 1.0, -1.0)
    np.testing.assert_allclose(got, ref, rtol=1e-6, equal_nan=True)


# Long enough for 3 threads' parts of at least 2**18 elements (mpiopt/kernels/_parallel.h), ragged at the end.
SPLIT_SIZE = 3 * 2**18 + 13


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("c_loop", [True, False], ids=["c", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [0, 1, 7, 8, 9, 63, 65, 1001, SPLIT_SIZE])
def test_momentum_signs_is_the_numpy_passes(d, dtype, c_loop, count, kernel_threads, monkeypatch):
    """m * beta + g * (1 - beta), each operation rounded in the dtype, and the signs of the result, bit for bit."""
    if not c_loop:
        monkeypatch.setattr(signs, "_signsc", None)
    elif signs._signsc is None:
        pytest.skip("mpiopt.kernels._signsc was not built")
    kernel_threads(count)
    rng = np.random.default_rng([d, np.dtype(dtype).itemsize])
    m, g = (rng.standard_normal(d).astype(dtype) for _ in range(2))
    special = np.array([0.0, -0.0, np.finfo(dtype).max, -np.finfo(dtype).tiny / 4, np.nan], dtype)
    m[: min(d, 5)], g[-min(d, 5) :] = special[: min(d, 5)], special[: min(d, 5)]
    g[: min(d, 2)] = -0.0  # m = +-0.0 with g = -0.0: the sum's sign decides the bit
    beta, t = 0.9, np.dtype(dtype).type
    with np.errstate(all="ignore"):
        want = m * t(beta) + g * t(1.0 - beta)
    g_before = g.copy()
    out = np.full(packed_nbytes(d), 0xFF, np.uint8)
    assert signs.momentum_signs(m, g, beta, out) is out
    assert m.tobytes() == want.tobytes() and g.tobytes() == g_before.tobytes()
    # NaN packs as -1 (nan_policy "unchecked"): a set bit is exactly m >= 0
    np.testing.assert_array_equal(out, reference_pack(np.where(want >= 0, 1, -1)))


@pytest.mark.parametrize("count", [2, 3, 7])
def test_threads_pack_and_apply_the_same_bits(count, kernel_threads):
    if signs._signsc is None:
        pytest.skip("mpiopt.kernels._signsc was not built")
    rng = np.random.default_rng(count)
    x = rng.standard_normal(SPLIT_SIZE).astype(np.float32)
    x[::5] = -0.0
    want_packed = reference_pack(reference_signs(x)) if count == 2 else pack_signs(x)
    want_x = x * np.float32(0.999) - np.float32(0.01) * unpack_signs(want_packed, SPLIT_SIZE)
    kernel_threads(count)
    np.testing.assert_array_equal(pack_signs(x), want_packed)
    for spot in (0, SPLIT_SIZE // 2, SPLIT_SIZE - 1):  # NaN in the first, a middle and the last part
        y = x.copy()
        y[spot] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            pack_signs(y)
    assert signs.apply_signs(want_packed, x, 0.01, 0.999).tobytes() == want_x.tobytes()


def test_momentum_signs_takes_beta_in_the_dtype_and_checks_it(monkeypatch):
    """A numpy float64 beta gives the C loop's bits on the numpy path too; bad beta and overlap are named."""
    rng = np.random.default_rng(3)
    m, g = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    results = []
    for c_loop in (True, False):
        if not c_loop:
            monkeypatch.setattr(signs, "_signsc", None)
        mine, out = m.copy(), np.empty(125, np.uint8)
        signs.momentum_signs(mine, g, np.float64(0.9), out)
        results.append((mine.tobytes(), out.tobytes()))
    assert results[0] == results[1]
    for bad in (1.0, -0.1, np.nan, True, "0.9"):
        with pytest.raises(ValueError, match="beta must be a number in \\[0, 1\\)"):
            signs.momentum_signs(m.copy(), g, bad, np.empty(125, np.uint8))
    with pytest.raises(ValueError, match="must not overlap"):
        signs.momentum_signs(m, m, 0.9, np.empty(125, np.uint8))
