"""Dense codecs with one float32 scale per chunk: ``int8``, ``int4``, ``fp4`` (E3M0) and ``sign``.

Every one writes the scales first (``4 ceil(d / chunk)`` bytes), then the codes.  A chunk holding NaN or inf
gets a non-finite scale, so it decodes to non-finite values: never silently finite.  Bounds: docs/codecs.md.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict

import numpy as np

from ..kernels.signs import pack_signs, packed_nbytes, unpack_signs
from .base import SCALE_BYTES, Chunked
from .bitfields import pack_nibbles, unpack_nibbles

__all__ = ["IntCodec", "Int8Codec", "Int4Codec", "FP4Codec", "SignCodec", "E3M0_MAGNITUDES"]

#: E3M0's eight magnitudes, in units of the chunk's absmax: 0, then 2**-6 ... 2**0 (code = sign << 3 | index).
E3M0_MAGNITUDES = np.array([0.0] + [2.0**e for e in range(-6, 1)])
# |x| / absmax from which E3M0 rounds up to 2**-6 rather than down to 0 (the midpoint).
_E3M0_ZERO_EDGE = 2.0**-7


def _divide_rows(codec: Chunked, xp: ModuleType, v: Any, scales: Any, out: Any) -> Any:
    """``out = v / scale of v's chunk`` (0 scales divide by 1: their chunk is all zero)."""
    safe = xp.where(scales == 0, 1, scales).astype(out.dtype)
    rows, tail = codec.rows(v)
    out_rows, out_tail = codec.rows(out)
    if rows.shape[0]:
        xp.divide(rows, safe[: rows.shape[0], None], out=out_rows)
    if tail.shape[0]:
        xp.divide(tail, safe[-1:], out=out_tail)
    return out


class IntCodec(Chunked):
    """Symmetric integers of ``bits`` bits per chunk: ``q = rint(x / step)``, ``step = absmax / (2**(bits-1) - 1)``.

    Decoded ``q * step``: at most half a step from ``x`` (up to the float32 rounding of ``x / step``).
    """

    bits = 8

    @property
    def qmax(self) -> int:
        """The largest code magnitude: 127 (int8), 7 (int4)."""
        return 2 ** (self.bits - 1) - 1

    def bytes_breakdown(self, d: int) -> Dict[str, int]:
        """``scales``: ``4 ceil(d / chunk)``; ``values``: ``ceil(d bits / 8)``."""
        return {"header": 0, "scales": SCALE_BYTES * self.chunks(d), "values": -(-d * self.bits // 8)}

    def _encode(self, xp: ModuleType, x: Any, sections: Dict[str, Any]) -> None:
        d = x.shape[0]
        steps = self.write_scales(xp, self.per_chunk(xp, x, "absmax") / self.qmax, sections["scales"])
        t = _divide_rows(self, xp, x, steps, self._buffer(xp, "ratio", d, x.dtype))
        xp.rint(t, out=t)
        xp.clip(t, -self.qmax, self.qmax, out=t)
        if self.bits == 8:
            sections["values"].view(xp.int8)[...] = t
        else:
            codes = self._buffer(xp, "codes", d, xp.int8)
            codes[...] = t
            codes = codes.view(xp.uint8)
            codes &= 15  # two's complement nibbles
            pack_nibbles(xp, codes, sections["values"])

    def _decode(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any) -> None:
        if self.bits == 8:
            out[...] = sections["values"].view(xp.int8)
        else:
            nibbles = np.array([n if n < 8 else n - 16 for n in range(16)], dtype=np.float64)
            unpack_nibbles(xp, sections["values"], nibbles, "int4", out)
        self.scale_rows(out, self.read_scales(xp, sections["scales"]))


class Int8Codec(IntCodec):
    """int8 with a float32 absmax scale per chunk: ``d + 4 ceil(d / chunk)`` bytes."""

    name = "int8"
    bits = 8


class Int4Codec(IntCodec):
    """int4 (codes -7..7, two per byte) with a float32 absmax scale per chunk: ``ceil(d / 2) + 4 ceil(d / chunk)`` bytes."""

    name = "int4"
    bits = 4


class FP4Codec(Chunked):
    """4-bit floats E3M0 (sign, 3 exponent bits, no mantissa) in units of the chunk's absmax, two per byte.

    Magnitudes ``absmax * {0, 2**-6, ..., 2**-1, 1}``; each value goes to the nearest (ties to the larger).
    Why E3M0 rather than E2M1: docs/codecs.md.
    """

    name = "fp4"

    def bytes_breakdown(self, d: int) -> Dict[str, int]:
        """``scales``: ``4 ceil(d / chunk)``; ``values``: ``ceil(d / 2)``."""
        return {"header": 0, "scales": SCALE_BYTES * self.chunks(d), "values": -(-d // 2)}

    def _encode(self, xp: ModuleType, x: Any, sections: Dict[str, Any]) -> None:
        d = x.shape[0]
        scales = self.write_scales(xp, self.per_chunk(xp, x, "absmax"), sections["scales"])
        t = self._buffer(xp, "ratio32", d, xp.float32)
        xp.abs(x, out=t)
        _divide_rows(self, xp, t, scales, t)  # |x| / absmax in [0, 1]
        # Nearest power of two by the float32 bits: adding half the mantissa range carries into the exponent
        # exactly from 1.5 * 2**e (the midpoint of 2**e and 2**(e+1)) up.
        exponent = self._buffer(xp, "exponent", d, xp.uint32)
        xp.add(t.view(xp.uint32), 0x400000, out=exponent)
        exponent >>= 23
        index = exponent.view(xp.int32)
        index -= 127 - 7  # 2**0 -> 7, 2**-6 -> 1
        xp.clip(index, 0, 7, out=index)
        codes = self._buffer(xp, "codes", d, xp.uint8)
        codes[...] = index
        flag = self._buffer(xp, "flag", d, xp.bool_)
        # [2**-7, 1.5 * 2**-7) rounds up to 2**-6, not down to 0: the midpoint with 0 is a power of two itself.
        xp.greater_equal(t, _E3M0_ZERO_EDGE, out=flag)
        xp.maximum(codes, flag.view(xp.uint8), out=codes)
        xp.less(x, 0, out=flag)
        flag_bits = flag.view(xp.uint8)
        flag_bits <<= 3
        codes |= flag_bits
        pack_nibbles(xp, codes, sections["values"])

    def _decode(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any) -> None:
        nibbles = np.concatenate([E3M0_MAGNITUDES, -E3M0_MAGNITUDES])
        unpack_nibbles(xp, sections["values"], nibbles, "e3m0", out)
        self.scale_rows(out, self.read_scales(xp, sections["scales"]))


class SignCodec(Chunked):
    """Signs (bit set where ``x >= 0``, the kernels' packing) times the chunk's mean ``|x|``: ``ceil(d / 8) + 4 ceil(d / chunk)`` bytes.

    The mean ``|x|`` is the scale that makes ``scale * sign(x)`` closest to ``x`` in L2 for the chunk.
    """

    name = "sign"

    def bytes_breakdown(self, d: int) -> Dict[str, int]:
        """``scales``: ``4 ceil(d / chunk)``; ``signs``: ``ceil(d / 8)``."""
        return {"header": 0, "scales": SCALE_BYTES * self.chunks(d), "signs": packed_nbytes(d)}

    def _chunk_lengths(self, xp: ModuleType, d: int) -> Any:
        lengths = xp.full(self.chunks(d), self.chunk, dtype=xp.float64)
        lengths[-1] = d - (self.chunks(d) - 1) * self.chunk
        return lengths

    def _encode(self, xp: ModuleType, x: Any, sections: Dict[str, Any]) -> None:
        d = x.shape[0]
        magnitudes = xp.abs(x, out=self._buffer(xp, "abs", d, x.dtype))
        means = self.per_chunk(xp, magnitudes, "sum") / self._chunk_lengths(xp, d)
        self.write_scales(xp, means, sections["scales"])
        pack_signs(x, out=sections["signs"], nan_policy="unchecked")  # NaN: the scale is NaN too

    def _decode(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any) -> None:
        unpack_signs(sections["signs"], d, dtype=out.dtype, out=out)
        self.scale_rows(out, self.read_scales(xp, sections["scales"]))
