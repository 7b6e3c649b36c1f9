"""Packed sign vectors and the bit-sliced majority vote, for signSGD and Signum (Bernstein et al. 2018, 2019).

sign is +1 for ``x >= 0``; bit ``i % 8`` of byte ``i // 8``; pad bits 0; a tie votes +1.  Conventions, NaN
policy and how the vote counts: docs/internals-kernels.md, "Sign vectors".
"""

from __future__ import annotations

import numbers
from types import ModuleType
from typing import Any, List, Set, Tuple

import numpy as np

from . import _cuda
from ._backend import C_FLOATS, block_length, c_loop_takes, cached, check_array, check_count, load_extension, take_rows
from .threads import get_num_threads

# The optional fused C loops (setup.py); the numpy code below gives the same bits.
_signsc = load_extension("_signsc", 1)

__all__ = [
    "packed_nbytes",
    "pack_bits",
    "unpack_bits",
    "pack_signs",
    "unpack_signs",
    "apply_signs",
    "momentum_signs",
    "fused_signs_available",
    "sign_float",
    "majority_vote",
    "chunk_bounds",
    "vote_chunk",
]

_NAN_POLICIES = ("raise", "unchecked")
_NAN_MESSAGE = "x contains NaN, whose sign is undefined (nan_policy='unchecked' packs NaN as -1)"
# The dtypes the C loops read (native byte order).
# Signs packed per block: 4 MiB of float32, a multiple of 8 so blocks end on
# whole bytes; as fast as one pass over x, without its d-byte boolean temporary
# (docs/benchmarks-kernels.md, "Design measurements").
_PACK_BLOCK = 1 << 20
# 128 KiB per bit plane: fewer, longer numpy calls than L2-sized blocks while the
# planes of one block stay in the L3 cache (docs/benchmarks-kernels.md, "Design measurements").
_VOTE_BLOCK_WORDS = 16384


def packed_nbytes(d: int, align: int = 1) -> int:
    """Bytes that ``d`` packed signs take: ``ceil(d / 8)``, rounded up to a multiple of ``align`` (8: whole uint64 words)."""
    d = check_count("d", d, 0)
    align = check_count("align", align, 1)
    nbytes = -(-d // 8)
    return -(-nbytes // align) * align


def pack_bits(xp: ModuleType, mask: Any) -> Any:
    """Pack a boolean vector into ``ceil(n / 8)`` bytes in this package's bit order (pad bits 0)."""
    # view(): cupy returns an empty input as is (bool), not as uint8.
    return xp.packbits(mask, bitorder="little").view(xp.uint8)


def unpack_bits(xp: ModuleType, packed: Any, count: int) -> Any:
    """Inverse of :func:`pack_bits`: ``count`` booleans."""
    return xp.unpackbits(packed, bitorder="little")[:count].view(bool)


def _output(xp: ModuleType, out: Any, shape: Tuple[int, ...], dtype: Any) -> Any:
    """A new array, or the caller's ``out`` after checking that it fits (C-contiguous, so views of it alias it)."""
    if out is None:
        return xp.empty(shape, dtype=dtype)
    check_array("out", out, ndim=len(shape), kinds="fiu", dtype=dtype)
    if out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous with shape {shape}, got shape {tuple(out.shape)}")
    return out


def fused_signs_available(x: Any) -> bool:
    """Whether fused passes (C loop or CUDA kernel) pack, update and apply the signs of arrays like ``x``."""
    return c_loop_takes(_signsc, x) or _cuda.takes(x)


def pack_signs(x: Any, out: Any = None, nan_policy: str = "raise") -> Any:
    """Pack the signs of ``x`` into ``ceil(d / 8)`` bytes (bit set where ``x[i] >= 0``; pad bits 0), optionally into ``out``.

    ``nan_policy="raise"`` raises ``ValueError`` on NaN (``out`` then partly written); ``"unchecked"`` packs NaN as -1.
    """
    xp = check_array("x", x, ndim=1, kinds="f")
    if nan_policy not in _NAN_POLICIES:
        raise ValueError(f"nan_policy must be one of {_NAN_POLICIES}, got {nan_policy!r}")
    d = x.shape[0]
    out = _output(xp, out, (packed_nbytes(d),), np.uint8)
    if fused_signs_available(x):
        # One pass into ``out``: no boolean temporary, and the NaN check comes free.
        if xp is np:
            nan = _signsc.pack_signs(x, d, x.dtype.itemsize, out, get_num_threads())
        else:
            nan = _cuda.pack_signs(x, out, check_nan=nan_policy == "raise")  # reading the answer waits for the device
        if nan and nan_policy == "raise":
            raise ValueError(_NAN_MESSAGE)
        return out
    block = block_length(xp, _PACK_BLOCK, d)
    nonnegative = xp.empty(min(block, d), dtype=bool)
    for start in range(0, d, block):
        values = x[start : start + block]
        # max() propagates NaN: one look answers "any NaN?" exactly.
        if nan_policy == "raise" and bool(xp.isnan(values.max())):
            raise ValueError(_NAN_MESSAGE)
        mask = xp.greater_equal(values, 0, out=nonnegative[: values.shape[0]])
        out[start // 8 : start // 8 + packed_nbytes(values.shape[0])] = pack_bits(xp, mask)
    return out


def momentum_signs(momentum: Any, grad: Any, beta: float, out: Any, scratch: Any = None) -> Any:
    """Signum's ``m <- beta m + (1 - beta) g`` in place and ``out <- signs of m``, in one pass where fused; returns ``out``.

    The bits of the numpy passes (docs/internals-kernels.md); NaN unchecked.  ``scratch`` serves the array code.
    ``TypeError``/``ValueError`` for mismatched or overlapping arrays or ``beta`` outside ``[0, 1)``.
    """
    xp = check_array("momentum", momentum, ndim=1, kinds="f")
    check_array("grad", grad, ndim=1, kinds="f", dtype=momentum.dtype)
    d = momentum.shape[0]
    if grad.shape != momentum.shape:
        raise ValueError(f"grad must have momentum's shape {momentum.shape}, got {grad.shape}")
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 <= beta < 1:
        raise ValueError(f"beta must be a number in [0, 1), got {beta!r}")
    out = _output(xp, out, (packed_nbytes(d),), np.uint8)
    if xp is np and (np.may_share_memory(momentum, grad) or np.may_share_memory(momentum, out) or np.may_share_memory(grad, out)):
        raise ValueError("momentum, grad and out must not overlap")
    beta = float(beta)
    arrays = (momentum, grad, out)
    if fused_signs_available(momentum) and all(a.flags.c_contiguous for a in arrays):
        if xp is np:
            _signsc.momentum_signs(momentum, grad, d, momentum.dtype.itemsize, beta, out, get_num_threads())
        else:
            _cuda.momentum_signs(momentum, grad, beta, out)
        return out
    scalar = momentum.dtype.type  # beta and 1 - beta in the dtype, as the C loop has them
    momentum *= scalar(beta)
    scratch = xp.multiply(grad, scalar(1.0 - beta), out=scratch)
    momentum += scratch
    return pack_signs(momentum, out=out, nan_policy="unchecked")


def _sign_table(dtype: np.dtype) -> np.ndarray:
    """(256, 8) table: row b holds the 8 signs (+1/-1) that byte b encodes."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return (2 * bits.astype(np.int8) - 1).astype(dtype)


def unpack_signs(packed: Any, d: int, dtype: Any = np.float32, out: Any = None) -> Any:
    """Expand ``ceil(d / 8)`` packed bytes into ``d`` signs +1/-1 of ``dtype`` (default float32), optionally into ``out``."""
    d = check_count("d", d, 0)
    xp = check_array("packed", packed, ndim=1, kinds="u", dtype=np.uint8)
    if packed.shape[0] != packed_nbytes(d):
        raise ValueError(f"packed must have ceil(d / 8) = {packed_nbytes(d)} bytes for d = {d}, got {packed.shape[0]}")
    dtype = np.dtype(dtype)
    if dtype.kind not in "fi":
        raise TypeError(f"dtype must be a floating or signed integer type, got {dtype}")
    out = _output(xp, out, (d,), dtype)
    if xp is np and _signsc is not None and dtype in C_FLOATS and packed.flags.c_contiguous:
        _signsc.unpack_signs(packed, d, dtype.itemsize, out)  # no intp index temporary (take's)
        return out
    table = cached(xp, ("sign_table", dtype.str), lambda: _sign_table(dtype))
    whole = d // 8
    take_rows(table, packed[:whole], out[: 8 * whole].reshape(whole, 8))
    if d > 8 * whole:
        out[8 * whole :] = table[packed[whole:]][0, : d - 8 * whole]
    return out


def apply_signs(packed: Any, x: Any, lr: float, decay: float = 1.0, scratch: Any = None) -> Any:
    """``x <- x * decay - lr * s`` in place, ``s`` the signs ``packed`` holds; one pass where fused, same bits; returns ``x``."""
    xp = check_array("x", x, ndim=1, kinds="f")
    if check_array("packed", packed, ndim=1, kinds="u", dtype=np.uint8) is not xp:
        raise TypeError(f"packed must be a {xp.__name__} array like x, got {type(packed).__name__}")
    d = x.shape[0]
    if packed.shape != (packed_nbytes(d),):
        raise ValueError(f"packed must have ceil(d / 8) = {packed_nbytes(d)} bytes for d = {d}, got {packed.shape[0]}")
    if fused_signs_available(x) and packed.flags.c_contiguous:
        if xp is np:
            _signsc.apply_signs(packed, d, x.dtype.itemsize, x, float(lr), float(decay), get_num_threads())
        else:
            _cuda.apply_signs(packed, x, float(lr), float(decay))
        return x
    step = unpack_signs(packed, d, dtype=x.dtype, out=scratch)
    if decay != 1.0:
        x *= decay
    step *= lr
    x -= step
    return x


def sign_float(x: Any, out: Any = None, nan_policy: str = "raise") -> Any:
    """``sign(x)`` as +1/-1 in ``x``'s dtype: ``unpack_signs(pack_signs(x))``, so dense and packed paths always agree."""
    packed = pack_signs(x, nan_policy=nan_policy)
    return unpack_signs(packed, x.shape[0], dtype=x.dtype, out=out)


class _Scratch:
    """Reusable bit planes for the adder tree: after the first block nothing is allocated; input rows are never written."""

    def __init__(self, xp: ModuleType, length: int) -> None:
        self.xp, self.length = xp, length
        self._free: List[Any] = []
        self._owned: Set[int] = set()

    def take(self) -> Any:
        """A plane to overwrite."""
        if self._free:
            return self._free.pop()
        plane = self.xp.empty(self.length, dtype=self.xp.uint64)
        self._owned.add(id(plane))
        return plane

    def give(self, *planes: Any) -> None:
        """Planes no longer needed (input rows are ignored)."""
        self._free.extend(plane for plane in planes if id(plane) in self._owned)


def _carries(planes: List[Any], one: int, scratch: _Scratch) -> List[Any]:
    """Add the bit planes of one weight (plus an all-ones plane if ``one``); return the carries (the sum bit is not needed)."""
    xp = scratch.xp
    level = list(planes)
    carries = []
    while len(level) + one > 3:
        a, b, c = level.pop(), level.pop(), level.pop()
        partial = xp.bitwise_xor(a, b, out=scratch.take())
        carry = xp.bitwise_and(a, b, out=scratch.take())
        scratch.give(a, b)
        both = xp.bitwise_and(partial, c, out=scratch.take())
        carry |= both
        partial ^= c
        scratch.give(both, c)
        level.append(partial)
        carries.append(carry)
    if len(level) == 3:  # majority of three
        a, b, c = level
        carry = xp.bitwise_and(a, b, out=scratch.take())
        either = xp.bitwise_xor(a, b, out=scratch.take())
        either &= c
        carry |= either
        scratch.give(either, a, b, c)
        carries.append(carry)
    elif len(level) == 2:  # a + b (+ 1) carries where both (either) are set
        add = xp.bitwise_or if one else xp.bitwise_and
        carries.append(add(level[0], level[1], out=scratch.take()))
        scratch.give(*level)
    elif len(level) == 1 and one:  # a + 1 carries where a is set
        carries.append(level[0])
    else:
        scratch.give(*level)
    return carries


def _at_least(rows: List[Any], threshold: int, scratch: _Scratch) -> Any:
    """Bitwise ``count >= threshold`` over ``rows``, the threshold's offset folded into the adder tree as constant planes."""
    width = len(rows).bit_length()
    offset = (1 << width) - threshold
    level = rows
    for i in range(width):
        level = _carries(level, offset >> i & 1, scratch)
    # Weight 2**i receives floor((P + offset mod 2**i) / 2**i) planes: exactly one at 2**b.
    (result,) = level
    return result


def _as_words(xp: ModuleType, stack: Any, nbytes: int) -> Any:
    """The first ``ceil(nbytes / 8)`` uint64 words of every row: a view when rows are whole words, else a padded copy."""
    nwords = -(-nbytes // 8)
    if stack.shape[1] == 8 * nwords and stack.strides[1] == 1 and stack.strides[0] % 8 == 0:
        return stack.view(xp.uint64)
    padded = xp.zeros((stack.shape[0], 8 * nwords), dtype=xp.uint8)
    padded[:, :nbytes] = stack[:, :nbytes]
    return padded.view(xp.uint64)


def majority_vote(packed_stack: Any, d: int, out: Any = None) -> Any:
    """Majority of ``P`` packed sign vectors (rows of ``packed_stack``), computed bit-sliced on uint64 words; a tie votes +1.

    Rows of ``packed_nbytes(d, align=8)`` bytes, C-contiguous, are read in place; others are copied padded.
    Returns ``ceil(d / 8)`` bytes, pad bits 0.
    """
    d = check_count("d", d, 0)
    xp = check_array("packed_stack", packed_stack, ndim=2, kinds="u", dtype=np.uint8)
    voters, width = packed_stack.shape
    nbytes = packed_nbytes(d)
    if voters < 1 or width < nbytes:
        raise ValueError(f"packed_stack must have shape (P >= 1, m >= {nbytes}) for d = {d}, got {packed_stack.shape}")
    out = _output(xp, out, (nbytes,), np.uint8)
    threshold = (voters + 1) // 2  # ceil(P / 2): a tie votes +1
    if xp is np and _signsc is not None and packed_stack.flags.c_contiguous:
        # Rows read in place at any alignment, the result written straight into out.
        _signsc.vote(packed_stack, voters, width, nbytes, threshold, out)
    elif _cuda.takes_bytes(packed_stack) and out.flags.c_contiguous:
        _cuda.vote(packed_stack, voters, nbytes, threshold, out)  # one kernel, the C loop's bits
    else:
        whole = nbytes // 8
        _vote_words(xp, _as_words(xp, packed_stack[:, : 8 * whole], 8 * whole), threshold, out[: 8 * whole].view(xp.uint64))
        if whole < -(-nbytes // 8):  # a ragged last word, from a tiny padded copy
            tail = xp.empty(1, dtype=xp.uint64)
            _vote_words(xp, _as_words(xp, packed_stack[:, 8 * whole : nbytes], nbytes - 8 * whole), threshold, tail)
            out[8 * whole :] = tail.view(xp.uint8)[: nbytes - 8 * whole]
    if d % 8:
        out[-1:] &= (1 << d % 8) - 1  # pad bits of the inputs may be anything
    return out


def _vote_words(xp: ModuleType, words: Any, threshold: int, voted_words: Any) -> None:
    """The vote in array operations, block by block (numpy without the C loop, and cupy)."""
    nwords = words.shape[1]
    block = block_length(xp, _VOTE_BLOCK_WORDS, nwords)
    scratch = _Scratch(xp, block)
    for start in range(0, nwords, block):
        rows = list(words[:, start : start + block])
        if rows[0].shape[0] != scratch.length:  # the last, shorter block
            scratch = _Scratch(xp, rows[0].shape[0])
        result = _at_least(rows, threshold, scratch)
        voted_words[start : start + block] = result
        scratch.give(result)


def chunk_bounds(nbytes: int, parts: int) -> np.ndarray:
    """``(parts, 2)`` ``[start, stop)`` offsets splitting ``nbytes`` packed bytes into word-aligned chunks (two-phase vote).

    Word counts differ by at most one; some chunks are empty when there are fewer words than parts.
    """
    nbytes = check_count("nbytes", nbytes, 0)
    parts = check_count("parts", parts, 1)
    nwords = -(-nbytes // 8)
    edges = np.minimum(8 * (np.arange(parts + 1, dtype=np.int64) * nwords // parts), nbytes)
    return np.stack([edges[:-1], edges[1:]], axis=1)


def vote_chunk(chunk_stack: Any, d: int, start: int, stop: int, out: Any = None) -> Any:
    """Majority vote on bytes ``[start, stop)`` of ``P`` packed vectors of ``d`` signs (the last chunk's pad bits as the whole's).

    Extra bytes of a row (padding to a common Alltoall block) are ignored.
    """
    d = check_count("d", d, 0)
    start = check_count("start", start, 0)
    stop = check_count("stop", stop, start, packed_nbytes(d))
    signs_in_chunk = max(0, min(8 * stop, d) - 8 * start)  # the last chunks may end in pad bits
    return majority_vote(chunk_stack, signs_in_chunk, out=out)
