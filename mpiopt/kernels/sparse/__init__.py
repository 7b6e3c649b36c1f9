"""Sparse kernels for Top-k and RegTop-k with error feedback (Bereyhi et al. 2024/2025).

One worker's step, with ``error`` the error-feedback buffer::

    indices, values = error_feedback(grad, error, lambda a: topk_indices(a, k))
    payload = encode(indices, values, d)             # exchanged (Allgather[v])
    aggregate[...] = 0
    for row in payloads:                             # every worker's payload, in rank order
        scatter_add(aggregate, *decode(row, d))
    union = union_of_sorted([decode(row, d)[0] for row in payloads], d)
    divide_at(aggregate, union, n_workers)           # G = (1/N) sum_n sent_n where some worker sent

RegTop-k ranks by :func:`regtopk_scores` instead of ``|a|``.  With the C loops,
:func:`feedback_select` makes the first line one pass over memory, and
:func:`merge_sorted_rows` with :func:`settle_aggregate` the aggregation one
merge and one walk; both give the same floats.

Modules, one job each: :mod:`.selection` (top-k), :mod:`.regtopk` (its
scores), :mod:`.feedback` (error feedback, fused with the selection),
:mod:`.payload` (the wire format), :mod:`.aggregation` (the workers'
payloads into ``G``), :mod:`.index_sets` (the index convention and the indexed C
loop), :mod:`.worker` (one worker's step and the aggregation of all payloads,
as the algorithms and the simulator run them).

Conventions:

* **indices** are int32, unique and sorted ascending everywhere (selection
  output, payloads, and what :func:`encode`, :func:`scatter_add` and
  :func:`error_feedback` accept), so ``d`` must be below ``2**31``.
* **ties**: of equal scores at the k-th place, the lowest indices are taken.
* **NaN** ranks below every number, ``-inf`` included: it is selected only
  when fewer than k entries are numbers (the algorithms check finiteness
  first; this only makes the result deterministic).
"""

from .aggregation import (
    MERGE_MAX_ROWS,
    divide_at,
    merge_sorted_rows,
    scatter_add,
    settle_aggregate,
    subtract_scaled_at,
    union_of_sorted,
    zero_at,
)
from .feedback import error_feedback, feedback_select, fused_feedback_available, take_and_zero
from .index_sets import _check_indices as check_indices
from .payload import decode, encode, encoded_nbytes, payload_format
from .regtopk import regtopk_scores, regtopk_sent_factors, unsent_factor
from .selection import FeedbackSelection, TopkWorkspace, density_to_k, topk_indices

__all__ = [
    "check_indices",
    "density_to_k",
    "TopkWorkspace",
    "topk_indices",
    "regtopk_scores",
    "error_feedback",
    "payload_format",
    "encoded_nbytes",
    "encode",
    "decode",
    "scatter_add",
    "take_and_zero",
    "unsent_factor",
    "regtopk_sent_factors",
    "fused_feedback_available",
    "feedback_select",
    "FeedbackSelection",
    "merge_sorted_rows",
    "settle_aggregate",
    "union_of_sorted",
    "zero_at",
    "divide_at",
    "subtract_scaled_at",
    "MERGE_MAX_ROWS",
]
