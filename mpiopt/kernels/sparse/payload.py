"""The sparse wire format: k (index, value) pairs of a length-d vector as one uint8 payload.

The format (pairs or bitmap) depends only on (k, d), so with a fixed k every payload has the same size (one
Allgather, not Allgatherv).  Layout: docs/internals-kernels.md, "Sparse vectors".
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

import numpy as np

from ...arrays import to_numpy
from .._backend import C_FLOATS, check_array, check_count
from ..signs import pack_bits, packed_nbytes, unpack_bits
from .index_sets import _MAX_LENGTH, _check_indices, _sparsec

__all__ = ["payload_format", "payload_header", "encoded_nbytes", "encode", "decode", "read_headers"]

_FORMATS = ("pairs", "bitmap")  # position = the code in the payload header
_HEADER_BYTES = 8


@functools.lru_cache(maxsize=256)  # called several times a step with the same (k, d)
def payload_format(k: int, d: int) -> str:
    """The smaller encoding of k of d entries: ``"pairs"`` (8k bytes) or ``"bitmap"`` (ceil(d/8) + 4k bytes); ties to pairs."""
    d = check_count("d", d, 0, _MAX_LENGTH)
    k = check_count("k", k, 0, d)
    return "pairs" if 4 * k <= packed_nbytes(d) else "bitmap"


def payload_header(k: int, d: int) -> np.ndarray:
    """The 8 bytes every payload of k of d entries starts with: its format's code and k, two native uint32 (as
    :func:`encode` writes them and :func:`decode` reads them)."""
    return np.array([_FORMATS.index(payload_format(k, d)), k], np.uint32).view(np.uint8)


def _value_type(dtype: Any) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in C_FLOATS:
        raise TypeError(f"dtype must be float32 or float64 (the payload's value type), got {dtype}")
    return dtype


@functools.lru_cache(maxsize=256)
def encoded_nbytes(k: int, d: int, dtype: Any = np.float32) -> int:
    """Bytes of :func:`encode`'s payload for k of d entries: ``8 + s k + min(4k, ceil(d / 8))``, ``s`` the value size."""
    index_bytes = 4 * k if payload_format(k, d) == "pairs" else packed_nbytes(d)
    return _HEADER_BYTES + _value_type(dtype).itemsize * k + index_bytes


def encode(indices: Any, values: Any, d: int, out: Any = None, dtype: Any = np.float32, check_indices: bool = True) -> Any:
    """Encode k (index, value) pairs of a length-d vector in the smaller format, optionally into ``out``.

    ``check_indices=False`` skips the uniqueness and order check for indices a checked call just returned.
    """
    d = check_count("d", d, 0, _MAX_LENGTH)
    xp = check_array("values", values, ndim=1, kinds="f", dtype=_value_type(dtype))
    if check_indices:
        _check_indices("indices", indices, d)
    else:
        check_array("indices", indices, ndim=1, kinds="iu")
    k = values.shape[0]
    if indices.shape != (k,):
        raise ValueError(f"indices must match values' shape ({k},), got {indices.shape}")
    nbytes = encoded_nbytes(k, d, values.dtype)
    if out is None:
        out = xp.empty(nbytes, dtype=xp.uint8)
    else:
        check_array("out", out, ndim=1, kinds="u", dtype=np.uint8)
        if out.shape != (nbytes,):
            raise ValueError(f"out must have shape ({nbytes},) = encoded_nbytes({k}, {d}, {values.dtype}), got {out.shape}")
    fmt = payload_format(k, d)
    header = out[:_HEADER_BYTES].view(xp.uint32)
    header[0], header[1] = _FORMATS.index(fmt), k
    value_end = _HEADER_BYTES + values.dtype.itemsize * k
    out[_HEADER_BYTES:value_end].view(values.dtype)[...] = values
    index_part = out[value_end:]
    if fmt == "pairs":
        index_part.view(xp.int32)[...] = indices
    elif xp is np and _sparsec is not None and indices.dtype == np.int32 and indices.flags.c_contiguous:
        _sparsec.bitmap_set(indices, k, d, index_part)  # no d-byte mask
    else:
        mask = xp.zeros(d, dtype=bool)
        mask[indices] = True
        index_part[...] = pack_bits(xp, mask)
    return out


def read_headers(payloads: Any) -> np.ndarray:
    """Every row's header of ``payloads`` (rows of :func:`encode`'s bytes), on the host: one copy for all rows."""
    return to_numpy(payloads[:, :_HEADER_BYTES])


def decode(payload: Any, d: int, dtype: Any = np.float32, indices_out: Any = None, header: Any = None) -> Tuple[Any, Any]:
    """``(indices, values)`` of a payload of :func:`encode`, as views into it (the bitmap's indices into ``indices_out``).

    ``header``: the payload's first 8 bytes as a numpy array, where the caller has read them already (a GPU
    payload's header costs a wait for the device; :func:`read_headers` reads every row's at once).
    ``ValueError`` when the payload is not one ``encode`` makes for this ``d`` and ``dtype``.
    """
    d = check_count("d", d, 0, _MAX_LENGTH)
    xp = check_array("payload", payload, ndim=1, kinds="u", dtype=np.uint8)
    dtype = _value_type(dtype)
    size = payload.shape[0]
    if size < _HEADER_BYTES:
        raise ValueError(f"payload must have at least {_HEADER_BYTES} bytes (the header), got {size}")
    header = to_numpy(payload[:_HEADER_BYTES]) if header is None else header
    code, k = (int(v) for v in np.ascontiguousarray(header, dtype=np.uint8).view(np.uint32))
    valid = code < len(_FORMATS) and k <= d
    if not (valid and _FORMATS[code] == payload_format(k, d) and size == encoded_nbytes(k, d, dtype)):
        raise ValueError(f"payload of {size} bytes (format code {code}, k = {k}) is not an encoding for d = {d} with {dtype} values")
    value_end = _HEADER_BYTES + dtype.itemsize * k
    values = payload[_HEADER_BYTES:value_end].view(dtype)
    index_part = payload[value_end:]
    if _FORMATS[code] == "pairs":
        return index_part.view(xp.int32), values
    if indices_out is not None:
        check_array("indices_out", indices_out, ndim=1, kinds="i", dtype=np.int32)
        if indices_out.shape[0] < k or not indices_out.flags.c_contiguous:
            raise ValueError(f"indices_out must be C-contiguous with at least k = {k} entries, got shape {indices_out.shape}")
    if xp is np and _sparsec is not None and index_part.flags.c_contiguous:
        indices = np.empty(k, dtype=np.int32) if indices_out is None else indices_out[:k]
        marked = _sparsec.bitmap_indices(index_part, d, indices)  # no d-element unpacking
    else:
        found = xp.flatnonzero(unpack_bits(xp, index_part, d))
        marked = found.shape[0]
        indices = found.astype(xp.int32) if indices_out is None else indices_out[: min(k, marked)]
        if indices_out is not None:
            indices[...] = found[: min(k, marked)]
    if marked != k:
        raise ValueError(f"payload bitmap marks {marked} entries, its header says k = {k}")
    return indices, values
