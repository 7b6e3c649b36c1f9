"""Packed sign vectors and the bit-sliced majority vote.

For signSGD, Signum and their majority vote (Bernstein et al., ICML 2018 and
ICLR 2019): each worker packs ``sign(m_i)`` into bits, the packed vectors are
exchanged, and ``V = sign(sum_i sign(m_i))`` is computed on the packed words.

Conventions, the same in every function here and on every backend:

* **sign**: +1 for ``x >= 0`` (``+0.0`` and ``-0.0`` included, as in the ICLR
  experiments), -1 for ``x < 0``.
* **bit order**: element ``i`` is bit ``i % 8`` (least significant first) of
  byte ``i // 8``, i.e. numpy's ``bitorder="little"``; a set bit means +1.  A
  vector of ``d`` signs takes ``ceil(d / 8)`` bytes (:func:`packed_nbytes`).
* **pad bits**: the ``8 * ceil(d / 8) - d`` bits after the last sign are 0 in
  every output and ignored in every input, so they never affect a vote.
* **NaN**: the sign of NaN is undefined.  ``nan_policy="raise"`` (default)
  raises ``ValueError``, at the price of a ``max()`` over each block of ``x``
  while it is in cache; ``nan_policy="unchecked"`` skips that for callers that
  have already checked finiteness (the algorithms do, collectively), and a NaN
  then packs as -1 (bit 0), because ``NaN >= 0`` is false.
* **vote**: the majority of ``P`` packed vectors is +1 where at least half of
  the votes are +1 (``count >= ceil(P / 2)``): a tie, possible for even ``P``,
  votes +1, consistent with sign(0) = +1.  ``P = 1`` returns the input.
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
    """Bytes that ``d`` packed signs take: ``ceil(d / 8)``, rounded up to a multiple of ``align``.

    Parameters
    ----------
    d : int
        Number of signs (>= 0).
    align : int, optional
        Round up to a multiple of this many bytes.  ``align=8`` (whole uint64
        words) sizes rows that :func:`majority_vote` reads without a copy.

    Returns
    -------
    int
    """
    d = check_count("d", d, 0)
    align = check_count("align", align, 1)
    nbytes = -(-d // 8)
    return -(-nbytes // align) * align


def pack_bits(xp: ModuleType, mask: Any) -> Any:
    """Pack a boolean vector into bytes in this package's bit order.

    Parameters
    ----------
    xp : module
        numpy or cupy (the module of ``mask``).
    mask : array of bool, shape (n,)

    Returns
    -------
    array of uint8, shape (ceil(n / 8),)
        Bit ``i % 8`` of byte ``i // 8`` is ``mask[i]``; pad bits are 0.
    """
    # view(): cupy returns an empty input as is (bool), not as uint8.
    return xp.packbits(mask, bitorder="little").view(xp.uint8)


def unpack_bits(xp: ModuleType, packed: Any, count: int) -> Any:
    """Inverse of :func:`pack_bits`.

    Parameters
    ----------
    xp : module
        numpy or cupy (the module of ``packed``).
    packed : array of uint8, shape (ceil(count / 8),)
    count : int
        Number of bits to return.

    Returns
    -------
    array of bool, shape (count,)
    """
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
    """Whether fused passes pack, update and apply the signs of arrays like ``x`` (no scratch needed).

    True for C-contiguous float32/float64 arrays: numpy ones when
    ``mpiopt.kernels._signsc`` was built (C loops), cupy ones wherever the
    CUDA kernels compiled (:mod:`~mpiopt.kernels._cuda`).
    """
    return c_loop_takes(_signsc, x) or _cuda.takes(x)


def pack_signs(x: Any, out: Any = None, nan_policy: str = "raise") -> Any:
    """Pack the signs of ``x`` into bits (+1 for ``x >= 0``, little bit order).

    On the CPU one C loop (``mpiopt.kernels._signsc``, when it was built),
    on a GPU one CUDA kernel (float32/float64), packs and checks for NaN
    straight into ``out``; otherwise the array code works through ``x`` in
    cache-sized blocks, so the NaN check reads each block from cache, not
    from memory a second time.  All give the same bits.

    Parameters
    ----------
    x : array, 1-D floating, length d
        numpy or cupy.
    out : array of uint8, shape (ceil(d / 8),), optional
        Where to write the result (e.g. this rank's row of a send buffer).
    nan_policy : {"raise", "unchecked"}
        See the module docstring.

    Returns
    -------
    array of uint8, shape (ceil(d / 8),)
        Bit ``i % 8`` of byte ``i // 8`` is 1 where ``x[i] >= 0``; pad bits are 0.

    Raises
    ------
    ValueError
        ``x`` contains NaN and ``nan_policy="raise"`` (``out`` is then partly written).
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
    """Signum's momentum step and the packing of its signs: ``m <- beta m + (1 - beta) g``, ``out <- signs of m``.

    The numpy passes ``m *= beta``, ``scratch = g * (1 - beta)``, ``m += scratch``,
    ``pack_signs(m, out)`` (``beta`` and ``1 - beta``, computed in float64, in
    ``m``'s dtype; NaN unchecked: it packs as -1), with the same roundings; on
    the CPU one C loop (``mpiopt.kernels._signsc``), on a GPU one CUDA kernel,
    does them in one pass.

    Parameters
    ----------
    momentum : array, 1-D floating, C-contiguous
        ``m``, updated in place.
    grad : array like ``momentum``
        ``g``; left unchanged.
    beta : float
        The momentum factor.
    out : array of uint8, shape (ceil(d / 8),)
        Where the packed signs go (pad bits 0).
    scratch : array like ``momentum``, optional
        Where the numpy passes put ``(1 - beta) g`` (a new array otherwise).

    Returns
    -------
    array
        ``out``.

    Raises
    ------
    TypeError, ValueError
        Arrays of other dtypes or shapes, ``out`` not C-contiguous, arrays
        that overlap, or ``beta`` outside ``[0, 1)``.
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
    """Expand ``ceil(d / 8)`` packed bytes into ``d`` signs +1/-1.

    One gather of 8-element rows from a 256-row table (``table[packed]``), so
    each output element is written once.

    Parameters
    ----------
    packed : array of uint8, shape (ceil(d / 8),)
        Pad bits are ignored.
    d : int
        Number of signs.
    dtype : dtype-like, optional
        Floating or signed integer type of the result (default float32).
    out : array, shape (d,), C-contiguous, of ``dtype``, optional
        Where to write the result.

    Returns
    -------
    array of ``dtype``, shape (d,)
        +1 where the bit is set, -1 where it is not.
    """
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
    """``x <- x * decay - lr * s`` in place, ``s`` the ``d = len(x)`` signs that ``packed`` holds.

    The numpy passes ``s = unpack_signs(packed)``, ``x *= decay`` (skipped when
    ``decay == 1``), ``s *= lr``, ``x -= s``, with the same roundings (``lr``
    and ``decay`` in ``x``'s dtype); on the CPU one C loop
    (``mpiopt.kernels._signsc``), on a GPU one CUDA kernel, does them in one
    pass over ``x``.

    Parameters
    ----------
    packed : array of uint8, shape (ceil(d / 8),)
    x : array, 1-D floating, C-contiguous
        Updated in place.
    lr, decay : float
    scratch : array like ``x``, optional
        Where the numpy passes put ``s`` (a new array otherwise).

    Returns
    -------
    array
        ``x``.
    """
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
    """``sign(x)`` as +1/-1 in ``x``'s dtype, with this module's convention (+1 for ``x >= 0``).

    Defined as ``unpack_signs(pack_signs(x))``, so the dense and the packed
    paths of an algorithm cannot disagree on any input.

    Parameters
    ----------
    x : array, 1-D floating
    out : array like ``x``, C-contiguous, optional
    nan_policy : {"raise", "unchecked"}
        See the module docstring.

    Returns
    -------
    array like ``x``
    """
    packed = pack_signs(x, nan_policy=nan_policy)
    return unpack_signs(packed, x.shape[0], dtype=x.dtype, out=out)


class _Scratch:
    """Reusable bit planes of one length for the adder tree.

    A block's temporaries are taken from here and given back when consumed,
    so every block after the first allocates nothing: no allocator calls, no
    page faults, and the planes stay in cache.  Planes not taken from here
    (the input rows) are never given back, so they are never written.
    """

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
    """Add the bit planes of one weight (plus a constant all-ones plane if ``one``); return the carries.

    The carries are planes of the next weight; there are
    ``(len(planes) + one) // 2`` of them.  The sum bit left at this weight is
    not computed: :func:`_at_least` needs only the carries.  A full adder turns
    three planes into one of this weight and one carry in five bitwise
    operations; the last three (or fewer) planes need only their carry.
    """
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
    """Bitwise ``count >= threshold``, count being the number of rows with the bit set.

    With ``b = len(rows).bit_length()`` and ``offset = 2**b - threshold``:
    ``count >= threshold`` exactly where ``count + offset`` reaches ``2**b``.
    So the offset's bits enter the carry-save adder tree as constant planes and
    only the carries up to weight ``2**b`` are computed (bit-sliced counting
    and comparison in one pass: 23 operations per word for 8 rows).  The
    result is a scratch plane (or, for one row, that row).
    """
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
    """Majority of ``P`` packed sign vectors, computed on the packed words.

    The rows are read as uint64 words and counted bit-sliced (a carry-save
    adder tree over bit planes), then compared with ``ceil(P / 2)`` bit-sliced;
    no row is ever unpacked.  A tie (even ``P``) votes +1.  On the CPU this
    runs in one fused C loop (``mpiopt.kernels._signsc``) when it was built,
    else in numpy operations block by block; both give the same bits.

    Parameters
    ----------
    packed_stack : array of uint8, shape (P, m), m >= ceil(d / 8)
        Row ``p`` holds voter ``p``'s packed signs (from :func:`pack_signs`);
        bytes beyond ``ceil(d / 8)`` and pad bits are ignored.  When ``m`` is
        ``packed_nbytes(d, align=8)`` and the array is C-contiguous the words
        are read in place; otherwise a padded copy is made.
    d : int
        Number of signs per vector.
    out : array of uint8, shape (ceil(d / 8),), optional
        Where to write the result.

    Returns
    -------
    array of uint8, shape (ceil(d / 8),)
        The packed majority; pad bits are 0.
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
    """Split ``nbytes`` packed bytes into ``parts`` contiguous chunks aligned to 8-byte words.

    For the two-phase vote: rank ``q`` receives chunk ``q`` of every rank's
    packed vector (Alltoall), votes on it with :func:`vote_chunk`, and the
    voted chunks are gathered (Allgather).  The concatenated chunk votes equal
    :func:`majority_vote` over the whole vectors.

    Parameters
    ----------
    nbytes : int
        Length of the packed vectors, ``packed_nbytes(d)``.
    parts : int
        Number of chunks (ranks), >= 1.

    Returns
    -------
    numpy.ndarray of int64, shape (parts, 2)
        ``[start, stop)`` byte offsets, in order and covering ``[0, nbytes)``.
        Word counts differ by at most one between chunks, every start is a
        multiple of 8, and some chunks are empty when there are fewer words
        than parts.
    """
    nbytes = check_count("nbytes", nbytes, 0)
    parts = check_count("parts", parts, 1)
    nwords = -(-nbytes // 8)
    edges = np.minimum(8 * (np.arange(parts + 1, dtype=np.int64) * nwords // parts), nbytes)
    return np.stack([edges[:-1], edges[1:]], axis=1)


def vote_chunk(chunk_stack: Any, d: int, start: int, stop: int, out: Any = None) -> Any:
    """Majority vote on bytes ``[start, stop)`` of ``P`` packed vectors of ``d`` signs.

    :func:`majority_vote` with the number of signs that the chunk holds, so the
    pad bits of the last chunk are handled as in the whole vector.

    Parameters
    ----------
    chunk_stack : array of uint8, shape (P, m), m >= stop - start
        Row ``p``: bytes ``[start, stop)`` of voter ``p``'s packed vector.
        Extra bytes (e.g. padding to a common Alltoall block) are ignored.
    d : int
        Number of signs in the whole vector.
    start, stop : int
        The chunk's byte offsets, a row of :func:`chunk_bounds`.
    out : array of uint8, shape (stop - start,), optional

    Returns
    -------
    array of uint8, shape (stop - start,)
    """
    d = check_count("d", d, 0)
    start = check_count("start", start, 0)
    stop = check_count("stop", stop, start, packed_nbytes(d))
    signs_in_chunk = max(0, min(8 * stop, d) - 8 * start)  # the last chunks may end in pad bits
    return majority_vote(chunk_stack, signs_in_chunk, out=out)
