"""Dense codecs without scales: ``none`` (float32 as is) and ``bf16`` (bfloat16, round to nearest even)."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict

from .base import Codec

__all__ = ["NoneCodec", "BF16Codec"]


class NoneCodec(Codec):
    """float32 as is: ``4 d`` bytes; exact for float32 input (float64 input is rounded to float32 once)."""

    name = "none"

    def bytes_breakdown(self, d: int) -> Dict[str, int]:
        """``values``: ``4 d``."""
        return {"header": 0, "values": 4 * d}

    def _encode(self, xp: ModuleType, x: Any, sections: Dict[str, Any]) -> None:
        sections["values"].view(xp.float32)[...] = x

    def _decode(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any) -> None:
        out[...] = sections["values"].view(xp.float32)

    def _add_decoded(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any, weight: float) -> None:
        values = sections["values"].view(xp.float32)
        if weight == 1.0 and out.dtype == values.dtype:
            out += values  # no copy: float32 payloads add as they are
        else:
            super()._add_decoded(xp, sections, d, out, weight)


class BF16Codec(Codec):
    """bfloat16, the top 16 bits of float32 after rounding to nearest, ties to even: ``2 d`` bytes.

    Relative error at most ``2**-9`` for normal numbers; NaN stays NaN, values past bfloat16's largest become inf.
    float64 input is rounded to float32 first (two roundings).
    """

    name = "bf16"

    def bytes_breakdown(self, d: int) -> Dict[str, int]:
        """``values``: ``2 d``."""
        return {"header": 0, "values": 2 * d}

    def _encode(self, xp: ModuleType, x: Any, sections: Dict[str, Any]) -> None:
        d = x.shape[0]
        if x.dtype == xp.float32:
            bits = x.view(xp.uint32)
        else:
            bits = self._buffer(xp, "float32", d, xp.float32)
            bits[...] = x
            bits = bits.view(xp.uint32)
        rounded = self._buffer(xp, "bits", d, xp.uint32)
        # Round to nearest even on the 16 bits dropped: add 0x7FFF plus the lowest kept bit, then truncate.
        xp.right_shift(bits, 16, out=rounded)
        rounded &= 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        values = sections["values"].view(xp.uint16)
        values[...] = rounded
        if bool(xp.isnan(x.max())):  # max propagates NaN: one look; a NaN's low bits could round it to inf
            values[xp.isnan(x)] = 0x7FC0

    def _decode(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any) -> None:
        values = sections["values"].view(xp.uint16)
        if out.dtype == xp.float32:
            wide = out.view(xp.uint32)
            wide[...] = values
            wide <<= 16
        else:
            wide = self._buffer(xp, "bits", d, xp.uint32)
            wide[...] = values
            wide <<= 16
            out[...] = wide.view(xp.float32)
