"""Codecs: a flat float vector to an exact-size ``uint8`` wire payload and back, with optional error feedback.

Pure array code (numpy, cupy) on the kernels; no MPI.  Aggregation is an Allgather of payloads and a local
decode-sum (:meth:`Codec.aggregate`)::

    codec = create("topk", k=64, bits=2)
    feedback = ErrorFeedback(codec, d, beta=0.95)
    payload = feedback.encode(pseudo_gradient)                   # payload_nbytes(d) bytes
    codec.aggregate(allgathered_payloads, d, out=mean, mean=True)

What each codec sends, its bounds and its bytes: docs/codecs.md.
"""

from __future__ import annotations

from typing import Any, Dict, Type

from .base import Codec
from .dense import BF16Codec, NoneCodec
from .feedback import ErrorFeedback
from .scaled import FP4Codec, Int4Codec, Int8Codec, SignCodec
from .topk import TopkCodec

__all__ = ["CODECS", "Codec", "ErrorFeedback", "create"]

#: Name -> class, in order of bytes.
CODECS: Dict[str, Type[Codec]] = {
    codec.name: codec for codec in (NoneCodec, BF16Codec, Int8Codec, Int4Codec, FP4Codec, SignCodec, TopkCodec)
}


def create(name: str, **params: Any) -> Codec:
    """The codec ``name`` with ``params`` (see each class's ``defaults``); ``ValueError`` names a bad name or parameter."""
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"unknown codec {name!r}: choose one of {', '.join(CODECS)}")
    cls = CODECS[name]
    unknown = sorted(set(params) - set(cls.defaults))
    if unknown:
        accepted = ", ".join(cls.defaults) or "none"
        raise ValueError(f"codec {name!r} has no parameter {unknown[0]!r}: its parameters are {accepted}")
    try:
        return cls(**params)
    except (TypeError, ValueError) as error:
        raise ValueError(f"codec {name!r}: {error}") from None
