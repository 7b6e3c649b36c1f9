"""Pure array kernels for the compressed algorithms: no MPI, numpy and cupy alike.

Every function takes numpy or cupy arrays and returns arrays of the same
module, with the same bits (the fused passes are C loops on numpy arrays and
CUDA kernels on cupy ones; cupy is imported only when a cupy array is passed).
Inputs are validated with ``TypeError``/``ValueError`` that name the argument
and the value.

Sign vectors (:mod:`~mpiopt.kernels.signs`, signSGD / Signum / majority vote):

* sign(x) = +1 for ``x >= 0`` (``-0.0`` included), -1 for ``x < 0``;
* bit order: element ``i`` is bit ``i % 8`` (least significant first) of byte
  ``i // 8`` (numpy ``bitorder="little"``), a set bit meaning +1; ``d`` signs
  take ``ceil(d / 8)`` bytes, pad bits are 0 on output and ignored on input;
* NaN: ``nan_policy="raise"`` (default) or ``"unchecked"`` (NaN packs as -1);
* majority vote: +1 where at least ``ceil(P / 2)`` of the P votes are +1, so a
  tie votes +1 (like sign(0)); computed bit-sliced on uint64 words;
* two-phase vote: :func:`chunk_bounds` and :func:`vote_chunk`.

Sparse vectors (:mod:`~mpiopt.kernels.sparse`, Top-k / RegTop-k with error
feedback):

* indices are int32, unique, sorted ascending; ties at the k-th place take the
  lowest indices; NaN ranks below every number;
* payloads (:mod:`~mpiopt.kernels.sparse.payload`): 8-byte header, the
  values, then int32 indices or a bitmap (in the sign vectors' bit order),
  whichever is smaller for (k, d).
"""

from .signs import (
    chunk_bounds,
    majority_vote,
    pack_bits,
    pack_signs,
    packed_nbytes,
    sign_float,
    unpack_bits,
    unpack_signs,
    vote_chunk,
)
from .sparse import (
    decode,
    density_to_k,
    encode,
    encoded_nbytes,
    error_feedback,
    payload_format,
    regtopk_scores,
    scatter_add,
    topk_indices,
)

__all__ = [
    "chunk_bounds",
    "majority_vote",
    "pack_bits",
    "pack_signs",
    "packed_nbytes",
    "sign_float",
    "unpack_bits",
    "unpack_signs",
    "vote_chunk",
    "decode",
    "density_to_k",
    "encode",
    "encoded_nbytes",
    "error_feedback",
    "payload_format",
    "regtopk_scores",
    "scatter_add",
    "topk_indices",
]
