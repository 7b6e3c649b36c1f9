"""Unsigned fields of ``width`` bits packed end to end, on top of the kernels' bit packing (field ``j`` at bits ``[j w, (j + 1) w)``).

Little-endian bit order as :func:`mpiopt.kernels.pack_bits`: 4-bit fields put element ``2i`` in the low nibble of byte ``i``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from ..kernels._backend import block_length, cached, take_rows
from ..kernels.signs import pack_bits, unpack_bits

# Bytes per look-up block: a 128 KiB index temporary, in cache.
_BLOCK = 1 << 14

__all__ = ["fields_nbytes", "pack_fields", "unpack_fields", "pack_nibbles", "unpack_nibbles"]


def fields_nbytes(count: int, width: int) -> int:
    """Bytes that ``count`` fields of ``width`` bits take: ``ceil(count * width / 8)``."""
    return -(-count * width // 8)


def pack_fields(xp: ModuleType, values: Any, width: int, out: Any) -> Any:
    """Pack unsigned ``values`` (each below ``2**width``) into ``out`` (``fields_nbytes`` bytes)."""
    bits = xp.empty((values.shape[0], width), dtype=bool)
    for bit in range(width):  # one pass per bit position: count-sized temporaries only
        bits[:, bit] = (values >> bit) & 1
    out[...] = pack_bits(xp, bits.ravel())
    return out


def unpack_fields(xp: ModuleType, packed: Any, width: int, count: int) -> Any:
    """The ``count`` fields of ``width`` bits that ``packed`` holds, as int64; a 2-D ``packed`` (rows of bytes): each row's."""
    if packed.ndim == 1:
        bits = unpack_bits(xp, packed, count * width).view(xp.uint8)
    else:
        bits = xp.unpackbits(packed.ravel(), bitorder="little").reshape(packed.shape[0], -1)[:, : count * width]  # cupy: no axis
    bits = bits.reshape(*packed.shape[:-1], count, width)
    values = xp.zeros(bits.shape[:-1], dtype=xp.int64)
    for bit in range(width):
        values |= bits[..., bit].astype(xp.int64) << bit
    return values


def pack_nibbles(xp: ModuleType, codes: Any, out: Any) -> Any:
    """Pack 4-bit ``codes`` (uint8, values below 16; overwritten) two per byte into ``out`` (``ceil(n / 2)`` bytes)."""
    n = codes.shape[0]
    half = n // 2
    codes[1 : 2 * half : 2] <<= 4
    xp.bitwise_or(codes[0 : 2 * half : 2], codes[1 : 2 * half : 2], out=out[:half])
    if n % 2:
        out[half] = codes[n - 1]
    return out


def _pair_table(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """(256, 2) table: row b holds the values of byte b's low and high nibble."""
    byte = np.arange(256)
    return np.stack([values[byte & 15], values[byte >> 4]], axis=1).astype(dtype)


def unpack_nibbles(xp: ModuleType, packed: Any, nibble_values: np.ndarray, key: str, out: Any) -> Any:
    """``out[j] = nibble_values[nibble j of packed]``: one table look-up per byte (two values), no code temporary."""
    n = out.shape[0]
    half = n // 2
    dtype = np.dtype(out.dtype)
    table = cached(xp, ("nibble_pairs", key, dtype.str), lambda: _pair_table(nibble_values, dtype))
    pairs = out[: 2 * half].reshape(half, 2)
    block = block_length(xp, _BLOCK, half)
    for start in range(0, half, block):  # blocks bound the look-up's index temporary (numpy widens uint8 to intp)
        take_rows(table, packed[start : min(start + block, half)], pairs[start : start + block])
    if n % 2:
        out[n - 1 :] = table[packed[half : half + 1], 0]
    return out
