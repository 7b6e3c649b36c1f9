"""The codecs' optional fused loops: the C loops (``mpiopt/kernels/_codecsc.c`` and its ``_codecs_*.c``) for numpy, and
for cupy their CUDA twins (``mpiopt/kernels/_codecs_cuda.py``, ``_codecs_dense_cuda.py``); the array code's bits, one
visit per chunk.

Each function returns whether a fused loop did the work (C-contiguous float32 and a chunk it takes); the caller
runs its array code otherwise.  Tests set :data:`enabled` to False to compare the two.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ..kernels import _codecs_cuda, _codecs_dense_cuda
from ..kernels._backend import load_extension
from ..kernels.threads import get_num_threads

__all__ = ["enabled", "available", "encode", "decode"]

_codecsc = load_extension("_codecsc", 2)
#: False runs the array code everywhere (the tests' reference).
enabled = True
# The C loops' codec numbers.
_KINDS = {"int8": 0, "int4": 1, "fp4": 2, "sign": 3, "none": 4, "bf16": 5, "topk": 6}


def _chunk(codec: Any) -> int:
    return getattr(codec, "chunk", 4096)


def available(codec: Any, feedback: bool = False) -> bool:
    """Whether the fused loops take ``codec`` (its name, and a chunk whose parts own whole bytes; sign: numpy's sum
    order): the C loops where they were built, the CUDA kernels for cupy arrays (each may still say no).

    ``feedback``: whether they also do error feedback's fold and update (not ``none`` and ``bf16``).
    """
    kind = _KINDS.get(codec.name)
    if not enabled or kind is None or (feedback and codec.name in ("none", "bf16")):
        return False
    chunk = _chunk(codec)
    return kind in (0, 4, 5, 6) or (kind in (1, 2) and chunk % 2 == 0) or (kind == 3 and chunk % 8 == 0 and chunk <= 8192)


def _f32(a: Any) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous


def _topk(codec: Any) -> Tuple[int, int, int, float, float, Any]:
    """TopkCodec's (k, bits, index_bits, first level, level spacing, float32 table of the decoded units)."""
    levels = codec.levels
    first, spacing = (float(levels[0]), float(levels[1] - levels[0])) if levels.shape[0] > 1 else (0.0, 1.0)
    table = np.concatenate([levels, -levels]).astype(np.float32)  # code = sign << (bits - 1) | level index
    return codec.k, codec.bits, codec.index_bits, first, spacing, table


def encode(codec: Any, e: Any, payload: Any, x: Any = None, beta: float = 1.0, feedback: bool = False) -> bool:
    """``e = e * beta + x`` (unless ``x`` is None), ``e``'s payload, and with ``feedback`` ``e -= decode(payload)``.

    ``bf16``: the payload only; ``none``: never (numpy's copy is the copy).
    """
    if not available(codec, feedback or x is not None) or codec.name == "none":
        return False
    if not isinstance(payload, np.ndarray):
        if codec.name == "topk":
            return _codecs_cuda.topk_encode(e, x, float(beta), payload, codec.chunk, *_topk(codec), feedback)
        return _codecs_dense_cuda.dense_encode(_KINDS[codec.name], e, x, float(beta), payload, _chunk(codec), feedback)
    if _codecsc is None or not _f32(e) or not (x is None or _f32(x)):
        return False
    if codec.name == "topk":
        k, bits, index_bits, first, spacing, table = _topk(codec)
        _codecsc.topk_encode(e, x, float(beta), payload, codec.chunk, k, bits, index_bits, first, spacing, table, feedback,
                             get_num_threads())
    else:
        _codecsc.encode(_KINDS[codec.name], e, x, float(beta), payload, _chunk(codec), feedback, get_num_threads())
    return True


def decode(codec: Any, payloads: Any, out: Any, add: bool = False, divisor: float = 1.0, counts: Any = None) -> bool:
    """``out`` (= or +=) the sum of the decoded rows of ``payloads`` (1-D: one row) in order, then ``/= divisor``.

    ``counts`` (``topk`` only; int32, ``d``): also each entry's senders, at least 1, and ``out`` their mean
    (numpy's ``out /= counts``); neither ``add`` nor a divisor with it.
    """
    if not available(codec) or (counts is not None and (codec.name != "topk" or counts.dtype != np.int32 or not counts.flags.c_contiguous)):
        return False
    rows = 1 if payloads.ndim == 1 else payloads.shape[0]
    if not isinstance(payloads, np.ndarray):
        if codec.name != "topk":
            return _codecs_dense_cuda.dense_decode(_KINDS[codec.name], payloads, rows, out, _chunk(codec), add, float(divisor))
        k, bits, index_bits, _, _, table = _topk(codec)
        return _codecs_cuda.topk_decode(payloads, rows, out, codec.chunk, k, bits, index_bits, table, add, float(divisor), counts)
    if _codecsc is None or not _f32(out) or not (counts is None or isinstance(counts, np.ndarray)):
        return False
    if codec.name == "topk":
        k, bits, index_bits, _, _, table = _topk(codec)
        _codecsc.topk_decode(payloads, rows, out, codec.chunk, k, bits, index_bits, table, add, float(divisor), counts, get_num_threads())
        return True
    _codecsc.decode(_KINDS[codec.name], payloads, rows, out, _chunk(codec), add, float(divisor), get_num_threads())
    return True
