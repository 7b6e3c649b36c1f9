"""One Top-k / RegTop-k worker's step and the aggregation of every worker's payload: array code, no MPI.

The algorithms (:mod:`mpiopt.algorithms.topk`) run one :class:`SparseWorker`
per rank around an Allgather; the single-process simulator
(:mod:`mpiopt.sim.topk`) runs N of them around a table of payloads.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, Optional

import numpy as np

from ...arrays import array_module, empty_apart
from .._backend import check_count
from ..update import all_finite
from .aggregation import divide_at, merge_sorted_rows, scatter_add, settle_aggregate, subtract_scaled_at, union_of_sorted, zero_at
from .feedback import error_feedback, feedback_select, fused_feedback_available, take_and_zero
from .payload import decode, encode, encoded_nbytes, read_headers
from .regtopk import regtopk_scores, regtopk_sent_factors, unsent_factor
from .device import DeviceTopkWorkspace
from .device_aggregation import DeviceAggregation
from .selection import TopkWorkspace, topk_indices

__all__ = ["SparseWorker", "SparseAggregate", "aggregate_payloads"]


class SparseWorker:
    """One worker's half of a step, no communication: select, keep the rest as error, encode.

    Used by :class:`TopK` / :class:`RegTopK` on each rank and by the
    single-process simulator :func:`mpiopt.sim.topk.simulate` for each of
    its workers.

    Parameters
    ----------
    sparsifier : Sparsifier
        What to send (:class:`~mpiopt.algorithms.topk.Sparsifier`: ``count(d)``, ``regularized``, ``mu``, ``q``).
    like : array
        A float32 or float64 vector of the parameters' length, dtype and
        array module (numpy or cupy); only those are used.
    n_workers : int
        ``N`` (RegTop-k's weight ``w = 1/N``).

    Attributes
    ----------
    k, num_params, payload_nbytes : int
    error : array like ``like``
        ``e``, what this worker has not sent yet.
    sent_indices, sent_values : array or None
        RegTop-k: what this worker sent last step (int32 indices, values in
        ``like``'s dtype); None for Top-k, which does not need them.
    has_history : bool
        RegTop-k: whether ``sent_*`` hold last step's selection (False before
        the first step, when every entry ranks as in Top-k).
    """

    def __init__(self, sparsifier: Any, like: Any, n_workers: int) -> None:
        if like.dtype not in (np.float32, np.float64):
            raise TypeError(f"top-k payloads carry float32 or float64 values: the parameters must be one of those, got {like.dtype}")
        xp = array_module(like)
        self.sparsifier = sparsifier
        self.n_workers = check_count("n_workers", n_workers, 1)
        self.num_params = int(like.shape[0])
        self.k = sparsifier.count(self.num_params)
        self.payload_nbytes = encoded_nbytes(self.k, self.num_params, like.dtype)  # values in the parameters' dtype
        self.error = empty_apart(like, zero=True)
        regularized = sparsifier.regularized
        self.sent_indices = xp.zeros(self.k, dtype=xp.int32) if regularized else None
        self.sent_values = xp.zeros(self.k, dtype=like.dtype) if regularized else None
        self.has_history = False
        self._scores = empty_apart(like) if regularized else None
        # Selection and the sent values in buffers made once: a step allocates nothing k- or d-sized.
        workspace = TopkWorkspace if xp is np else DeviceTopkWorkspace.create
        self._workspace = workspace(self.num_params, self.k, like.dtype)
        self._values = xp.empty(self.k, dtype=like.dtype)
        # The fused pass scores unsent entries |a_j|: RegTop-k only where their factor is exactly 1 (the paper's q).
        self._fusable = not regularized or unsent_factor(sparsifier.mu, sparsifier.q) == 1.0
        #: Whether :meth:`compress` reads the dense G_prev every step (RegTop-k where the fused pass cannot
        #: run); otherwise G_prev comes by its non-zero entries, and the dense one only on a rare fallback.
        self.reads_dense_aggregate = regularized and not (
            self._fusable and self._workspace is not None and self._workspace.fits(self.error, self.k)
        )

    def compress(
        self, grad: Any, prev_aggregate: Any, out: Any, check_finite: bool = False, prev_support: Optional[Any] = None,
    ) -> Optional[Any]:
        """Error feedback and selection on ``grad``; the payload to send, written into ``out``.

        Parameters
        ----------
        grad : array like ``error``
            This worker's gradient ``g``.
        prev_aggregate : array like ``error``, or a callable returning it
            Last step's aggregate ``G_prev`` (read by RegTop-k only; a
            callable is called only where the dense ``G_prev`` is read).
        out : array of uint8, shape (payload_nbytes,)
            Where the payload goes (a send buffer, or one row of the
            simulator's table of payloads).
        check_finite : bool
            Also check that every element of ``grad`` is finite: in the
            pass that forms ``a = e + g`` where that pass is fused (numpy
            with the C loops), else in a pass of its own first.
        prev_support : (indices, values), optional
            ``G_prev``'s non-zero entries and values (RegTop-k): where the
            fused pass runs, read instead of the dense ``G_prev``.

        Returns
        -------
        array or None
            ``out``; None when ``check_finite`` found a non-finite element
            (nothing encoded; after the fused pass ``error`` holds ``a``, so
            this worker's state is not to be used further).
        """
        sparsifier = self.sparsifier
        if sparsifier.regularized:
            select = partial(self._select_regularized, prev_aggregate)  # the general code: the dense G_prev
        else:
            select = partial(topk_indices, k=self.k, workspace=self._workspace)
        # a = g + e; S = select(a); e <- a - a 1_S (in place; values = a on S).
        # a = g + e and the candidates in one pass where it can (RegTop-k: the sent entries' regularizers
        # first, from last step's selection and aggregate; the pass multiplies them by |a_j|)
        fused = self._fusable and fused_feedback_available(grad, self.error, self._workspace)
        sent_indices = sent_factors = None
        if fused and sparsifier.regularized and self.has_history:
            sent_indices = self.sent_indices
            sent_factors = regtopk_sent_factors(
                sent_indices, self.sent_values, None if prev_support is not None else _dense(prev_aggregate),
                self.n_workers, sparsifier.mu, sparsifier.q, self._workspace, prev_support=prev_support,
            )
            fused = sent_factors is not None
        if check_finite and not fused and not all_finite(grad):  # before error changes
            return None
        if fused:
            indices, finite = feedback_select(
                grad, self.error, self.k, self._workspace, sent_indices=sent_indices, sent_factors=sent_factors,
            )
            if check_finite and not finite:
                return None
            if indices is None:  # the candidates did not fit (or NaN came unchecked): the general selection of a
                indices = select(self.error)
            values = take_and_zero(self.error, indices, self._values)
        else:
            indices, values = error_feedback(grad, self.error, select, values_out=self._values)
        if self.sent_indices is not None:
            self.sent_indices[...] = indices
            self.sent_values[...] = values
            self.has_history = True
        # error_feedback has checked the indices.
        return encode(indices, values, self.num_params, out=out, dtype=values.dtype, check_indices=False)

    def _select_regularized(self, prev_aggregate: Any, acc: Any) -> Any:
        """RegTop-k: the k entries of largest ``tanh(|1 + delta| / mu) |a|``."""
        history = self.k if self.has_history else 0
        scores = regtopk_scores(
            acc, self.sent_indices[:history], self.sent_values[:history], _dense(prev_aggregate),
            self.n_workers, self.sparsifier.mu, self.sparsifier.q, out=self._scores, workspace=self._workspace,
        )
        return topk_indices(scores, self.k, absolute=False, workspace=self._workspace)


def _dense(aggregate: Any) -> Any:
    """An aggregate given as an array, or as a callable that returns it."""
    return aggregate() if callable(aggregate) else aggregate


class SparseAggregate(NamedTuple):
    """What :func:`aggregate_payloads` returns.

    Attributes
    ----------
    touched : array of int32
        The sorted entries that some worker sent (from the GPU's kernels:
        every worker's, unsorted, repeated where several sent one): ``G`` is
        +0.0 elsewhere.
    values : array or None
        ``G[touched]`` (a view of ``sums_out``) where the rows were merged in
        sorted order; None where they were scatter-added.
    """

    touched: Any
    values: Optional[Any]


def aggregate_payloads(
    payloads: Any, out: Any, stale: Optional[Any] = None, indices_out: Optional[Any] = None,
    union_bits: Optional[Any] = None, union_out: Optional[Any] = None, sums_out: Optional[Any] = None,
    params: Optional[Any] = None, lr: float = 0.0, write_out: bool = True, device: Optional[DeviceAggregation] = None,
) -> SparseAggregate:
    """``G = (1/N) sum_n sent_n`` from the N workers' payloads, into ``out``.

    Parameters
    ----------
    payloads : array of uint8, shape (N, nbytes)
        One payload per worker, in rank order (what ``Allgather`` returns).
    out : array, 1-D float32 or float64, length d
        Overwritten with the aggregate; its dtype is the payloads' value
        type.  Rows are added in order, so every rank (and the simulator)
        computes the same sum.
    stale : array of int, optional
        The only entries of ``out`` that may be non-zero (what the previous
        call returned): only they are cleared, instead of all d entries.
    indices_out : array of int32, shape (N, k), optional
        Where the bitmap format's indices are decoded (row n: worker n's),
        instead of new arrays each call.
    union_bits, union_out : arrays, optional
        A ``ceil(d / 8)``-byte bitmap and an int32 array of ``N k`` entries
        where the union of the sent indices is formed without allocating
        (see :func:`mpiopt.kernels.sparse.union_of_sorted`); the result is
        then a view of ``union_out``, and may be passed back as ``stale``
        (of the next call but one: ``union_out`` must not hold ``stale``).
    sums_out : array like ``out``, ``N k`` entries, optional
        With ``union_out``: the rows are merged in sorted order
        (:func:`~mpiopt.kernels.sparse.merge_sorted_rows`) instead of
        scatter-added one by one, and ``G`` is written in one walk (the same
        floats).
    params : array like ``out``, optional
        Also ``params[j] -= lr * G[j]`` where ``G`` is non-zero (the papers'
        update), in the same walk where it can.
    lr : float
        The learning rate of that update.
    write_out : bool
        False: where the rows are merged, ``G`` is only returned (``values``)
        and ``out`` is left as it was (``stale`` unread); the scatter-adding
        path writes ``out`` all the same.
    device : DeviceAggregation, optional
        Buffers for the GPU's kernels (cupy rows of its shape): the rows are
        decoded and added by them, and ``touched`` is then every row's
        indices, an entry sent by several rows listed for each
        (``indices_out``, ``union_*`` and ``sums_out`` unused).

    Returns
    -------
    SparseAggregate
        Where ``G`` is non-zero, and its values there when the merge formed them.
    """
    if device is not None and device.takes(payloads, out, params):  # the kernels decode and check the rows themselves
        return SparseAggregate(device.aggregate(payloads, out, stale, params, lr), None)
    rows = [None] * payloads.shape[0] if indices_out is None else indices_out
    # The headers: one copy (one wait for a GPU's rows), not one a row
    decoded = [decode(payload, out.shape[0], out.dtype, row, header) for payload, row, header in zip(payloads, rows, read_headers(payloads))]
    merged = None
    if union_out is not None and sums_out is not None:
        merged = merge_sorted_rows([i for i, _ in decoded], [v for _, v in decoded], out.shape[0], union_out, sums_out)
    if merged is not None:
        touched, sums = merged
        if write_out and stale is None:
            out[...] = 0
        settle_aggregate(
            out if write_out else None, touched, sums, payloads.shape[0], stale=stale, params=params, lr=lr,
        )  # sums <- G[touched]
        return SparseAggregate(touched, sums)
    if stale is None:
        out[...] = 0
    else:
        zero_at(out, stale)  # before the union below, which may overwrite stale's buffer
    for indices, values in decoded:  # one worker's indices are unique: one scatter-add per worker
        scatter_add(out, indices, values)
    touched = union_of_sorted([indices for indices, _ in decoded], out.shape[0], union_bits, union_out)
    divide_at(out, touched, payloads.shape[0])
    if params is not None:
        subtract_scaled_at(params, touched, out, lr)
    return SparseAggregate(touched, None)
