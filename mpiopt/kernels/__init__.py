"""Pure array kernels for the compressed algorithms and the local update: no MPI, numpy and cupy alike, same bits.

Fused C loops (numpy) and CUDA kernels (cupy) give the bits of the array code.  Sign and sparse conventions,
and the bit contract: docs/internals-kernels.md.
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
