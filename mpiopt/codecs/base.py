"""The codec interface: a flat float vector to a ``uint8`` wire payload of a size known from ``d`` alone, and back.

Payloads are sections laid end to end in the order :meth:`Codec.bytes_breakdown` lists them; no header (``d``
and the codec are agreed before any exchange).  Layouts, bounds and bytes: docs/codecs.md.
"""

from __future__ import annotations

import contextlib
import numbers
from types import ModuleType
from typing import Any, Dict, Tuple

import numpy as np

from ..kernels._backend import check_array, check_count
from . import fused

__all__ = ["Codec", "Chunked", "SCALE_BYTES", "check_vector", "check_payload", "check_real"]

#: float32 per-chunk scales.
SCALE_BYTES = 4


def check_real(name: str, value: Any, low: float, high: float) -> float:
    """A real parameter in ``[low, high]`` as float; ``ValueError`` names the parameter, the range and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= value <= high:
        raise ValueError(f"{name} must be a real number in [{low}, {high}], got {value!r}")
    return float(value)


def check_vector(name: str, x: Any, d: int | None = None) -> ModuleType:
    """A 1-D float32/float64 vector (of length ``d`` when given); returns its array module."""
    xp = check_array(name, x, ndim=1, kinds="f")
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got {x.dtype}")
    if d is not None and x.shape[0] != d:
        raise ValueError(f"{name} must have length d = {d}, got {x.shape[0]}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return xp


def check_payload(name: str, payload: Any, nbytes: int, ndim: int = 1) -> ModuleType:
    """A C-contiguous uint8 array whose last axis is ``nbytes`` long; returns its array module."""
    xp = check_array(name, payload, ndim=ndim, kinds="u", dtype=np.uint8)
    if payload.shape[-1] != nbytes or not payload.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous uint8 with {nbytes} bytes per payload, got shape {tuple(payload.shape)}")
    return xp


def _quiet(xp: ModuleType):
    """numpy's floating-point warnings off: a non-finite chunk gives non-finite scales and values, by design."""
    return np.errstate(invalid="ignore", divide="ignore", over="ignore") if xp is np else contextlib.nullcontext()


class Codec:
    """Encode a flat float vector into an exact-size ``uint8`` payload, decode it, and sum many payloads.

    Subclasses set :attr:`name` and implement :meth:`bytes_breakdown`, :meth:`_encode` and :meth:`_decode`;
    :meth:`_add_decoded` may be overridden where the payload is sparse.
    """

    name = ""
    #: The parameters :func:`mpiopt.codecs.create` accepts, with their defaults.
    defaults: Dict[str, Any] = {}

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[str, str, Any], Any] = {}

    # ---- bytes -----------------------------------------------------------------------------------------------
    def bytes_breakdown(self, d: int) -> Dict[str, int]:
        """The payload's sections for a vector of ``d`` entries, in wire order: name -> bytes."""
        raise NotImplementedError

    def payload_nbytes(self, d: int) -> int:
        """Exact bytes of one payload for ``d`` entries (the sum of :meth:`bytes_breakdown`)."""
        return sum(self.bytes_breakdown(check_count("d", d, 1)).values())

    def bits_per_parameter(self, d: int) -> float:
        """``8 * payload_nbytes(d) / d``: 32 for float32."""
        return 8.0 * self.payload_nbytes(d) / d

    def params(self) -> Dict[str, Any]:
        """The parameters this codec was made with (what :func:`mpiopt.codecs.create` takes back)."""
        return {key: getattr(self, key) for key in self.defaults}

    def __repr__(self) -> str:
        args = ", ".join(f"{key}={value!r}" for key, value in self.params().items())
        return f"{type(self).__name__}({args})"

    def _sections(self, payload: Any, d: int) -> Dict[str, Any]:
        """Views of ``payload``'s sections (last axis), by name."""
        out, start = {}, 0
        for key, size in self.bytes_breakdown(d).items():
            out[key] = payload[..., start : start + size]
            start += size
        return out

    # ---- the work ----------------------------------------------------------------------------------------
    def encode(self, x: Any, out: Any = None) -> Any:
        """Encode vector ``x`` into ``out`` (uint8, ``payload_nbytes(d)``; allocated when None); returns it."""
        xp = check_vector("x", x)
        d = x.shape[0]
        nbytes = self.payload_nbytes(d)
        if out is None:
            out = xp.empty(nbytes, dtype=xp.uint8)
        if check_payload("out", out, nbytes) is not xp:
            raise TypeError("out must live where x does (numpy or cupy)")
        if fused.encode(self, x, out):
            return out
        with _quiet(xp):
            self._encode(xp, x, self._sections(out, d))
        return out

    def decode(self, payload: Any, d: int, out: Any = None) -> Any:
        """The vector of ``d`` entries that ``payload`` carries, into ``out`` (float32 when allocated); returns it."""
        d = check_count("d", d, 1)
        xp = check_payload("payload", payload, self.payload_nbytes(d))
        if out is None:
            out = xp.empty(d, dtype=xp.float32)
        check_vector("out", out, d)
        if fused.decode(self, payload, out):
            return out
        with _quiet(xp):
            self._decode(xp, self._sections(payload, d), d, out)
        return out

    def add_decoded(self, payload: Any, d: int, out: Any, weight: float = 1.0) -> Any:
        """``out += weight * decode(payload)`` (products rounded once, in ``out``'s dtype); returns ``out``."""
        d = check_count("d", d, 1)
        xp = check_payload("payload", payload, self.payload_nbytes(d))
        check_vector("out", out, d)
        if weight == 1.0 and fused.decode(self, payload, out, add=True):
            return out
        with _quiet(xp):
            self._add_decoded(xp, self._sections(payload, d), d, out, float(weight))
        return out

    def aggregate(self, payloads: Any, d: int, out: Any = None, mean: bool = False) -> Any:
        """The sum (``mean=True``: the mean) of the vectors the rows of ``payloads`` (P, nbytes) carry, into ``out``.

        Summed in row (rank) order in ``out``'s dtype: the same bits on every rank that holds the same rows.
        """
        d = check_count("d", d, 1)
        xp = check_payload("payloads", payloads, self.payload_nbytes(d), ndim=2)
        if payloads.shape[0] < 1:
            raise ValueError("payloads must hold at least one row")
        if out is None:
            out = xp.empty(d, dtype=xp.float32)
        check_vector("out", out, d)
        rows = payloads.shape[0]
        if fused.decode(self, payloads, out, divisor=rows if mean and rows > 1 else 1):
            return out
        with _quiet(xp):
            self._decode(xp, self._sections(payloads[0], d), d, out)
            for row in payloads[1:]:
                self._add_decoded(xp, self._sections(row, d), d, out, 1.0)
        if mean and payloads.shape[0] > 1:
            out /= payloads.shape[0]
        return out

    def senders_mean(self, payloads: Any, d: int, out: Any, counts: Any) -> Any:
        """Each entry's mean over the rows of ``payloads`` (P, nbytes) that send it, +0.0 where none does, into ``out``;
        ``counts`` (int32, length ``d``) is left holding ``max(senders, 1)``.  SparseLoCo's aggregate: the sum in
        row order, then ``out /= counts`` (numpy's float64 quotient); one fused pass where the loops take it."""
        d = check_count("d", d, 1)
        xp = check_payload("payloads", payloads, self.payload_nbytes(d), ndim=2)
        check_vector("out", out, d)
        if check_array("counts", counts, ndim=1, kinds="i", dtype=np.int32) is not xp or counts.shape[0] != d:
            raise ValueError(f"counts must have length d = {d} and live where payloads do, got {type(counts).__name__} of {counts.shape[0]}")
        if fused.decode(self, payloads, out, counts=counts):
            return out
        self.aggregate(payloads, d, out=out)
        self.count_senders(payloads, d, out=counts)
        xp.maximum(counts, 1, out=counts)  # no sender: the sum is 0, and stays so
        out /= counts
        return out

    def count_senders(self, payloads: Any, d: int, out: Any) -> Any:
        """``out[j]``: how many rows of ``payloads`` (P, nbytes) send entry ``j`` (every row, for a dense codec); returns ``out``."""
        d = check_count("d", d, 1)
        xp = check_payload("payloads", payloads, self.payload_nbytes(d), ndim=2)
        if check_array("out", out, ndim=1, kinds="iuf") is not xp or out.shape[0] != d:
            raise ValueError(f"out must have length d = {d} and live where payloads do, got {type(out).__name__} of {out.shape[0]}")
        self._count_senders(xp, payloads, d, out)
        return out

    # ---- for subclasses --------------------------------------------------------------------------------------
    def _count_senders(self, xp: ModuleType, payloads: Any, d: int, out: Any) -> None:
        """Dense codecs: every row sends every entry."""
        out[...] = payloads.shape[0]

    def _encode(self, xp: ModuleType, x: Any, sections: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _decode(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any) -> None:
        raise NotImplementedError

    def _add_decoded(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any, weight: float) -> None:
        """Dense codecs: decode into a reusable buffer, then one fused add."""
        decoded = self._buffer(xp, "decoded", d, out.dtype)
        self._decode(xp, sections, d, decoded)
        if weight != 1.0:
            decoded *= out.dtype.type(weight)
        out += decoded

    def _buffer(self, xp: ModuleType, role: str, n: int, dtype: Any) -> Any:
        """A reusable 1-D buffer of at least ``n`` entries (grown on demand, never shrunk); its first ``n``."""
        key = (xp.__name__, role, np.dtype(dtype).str)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < n:
            buffer = xp.empty(n, dtype=dtype)
            self._buffers[key] = buffer
        return buffer[:n]


class Chunked(Codec):
    """A codec with one float32 scale per chunk of ``chunk`` consecutive entries (the last chunk may be shorter)."""

    defaults = {"chunk": 4096}

    def __init__(self, chunk: int = 4096) -> None:
        super().__init__()
        self.chunk = check_count("chunk", chunk, 1, 2**24)

    def chunks(self, d: int) -> int:
        """How many chunks ``d`` entries make: ``ceil(d / chunk)``."""
        return -(-d // self.chunk)

    def rows(self, v: Any) -> Tuple[Any, Any]:
        """``v`` (1-D) as (whole chunks as rows ``(d // chunk, chunk)``, the ragged rest as a 1-D tail, maybe empty)."""
        whole = v.shape[0] // self.chunk * self.chunk
        return v[:whole].reshape(-1, self.chunk), v[whole:]

    def per_chunk(self, xp: ModuleType, v: Any, reduce: str) -> Any:
        """``reduce`` of every chunk of ``v``, float64 (one per chunk): 'absmax' (+0.0 and NaN without sign bits, as the
        C loops give them), or 'sum' (``v`` already ``|x|``)."""
        rows, tail = self.rows(v)
        parts = []
        if rows.shape[0]:
            if reduce == "absmax":  # two reductions, no d-sized |v| temporary; NaN propagates
                parts.append(xp.abs(xp.maximum(rows.max(axis=1), -rows.min(axis=1))).astype(xp.float64))
            else:
                parts.append(rows.sum(axis=1, dtype=xp.float64))
        if tail.shape[0]:
            if reduce == "absmax":
                parts.append(xp.abs(xp.maximum(tail.max(keepdims=True), -tail.min(keepdims=True))).astype(xp.float64))
            else:
                parts.append(tail.sum(keepdims=True, dtype=xp.float64))
        return xp.concatenate(parts)

    def write_scales(self, xp: ModuleType, scales: Any, section: Any) -> Any:
        """Round ``scales`` to float32, write them into their payload section, and return the float32 scales."""
        scales32 = scales.astype(xp.float32)
        section[...] = scales32.view(xp.uint8)
        return scales32

    @staticmethod
    def read_scales(xp: ModuleType, section: Any) -> Any:
        """The float32 scales of a payload section (a small aligned copy: payload rows need not be aligned)."""
        return section.copy().view(xp.float32)

    def scale_rows(self, out: Any, scales: Any) -> None:
        """``out`` (d) times its chunk's scale, in place."""
        rows, tail = self.rows(out)
        if rows.shape[0]:
            rows *= scales[: rows.shape[0], None].astype(out.dtype)
        if tail.shape[0]:
            tail *= scales[-1:].astype(out.dtype)
