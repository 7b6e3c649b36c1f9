"""Top-k sparsification with error feedback, and RegTop-k.

Bereyhi et al., "Regularized Top-k: A Bayesian Framework for Gradient Sparsification" (arXiv:2501.05633, 2025):
each rank sends its k largest ``g + e`` (RegTop-k: regularised by the last aggregate) by Allgather; the rest stays in ``e``.
Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from ..arrays import array_module, empty_apart
from ..comm import Topology
from ..comm.ledger import Call
from ..kernels import density_to_k, encoded_nbytes, packed_nbytes, payload_format
from ..kernels.sparse import check_indices
from ..kernels.update import reads_support
from ..kernels.sparse.device_aggregation import DeviceAggregation
from ..kernels.sparse.worker import SparseAggregate, SparseWorker, aggregate_payloads
from .base import BASE, SynchronousAlgorithm
from .local import LOCAL_SGD, LocalSGD, LocalStepState
from .schema import Hyperparameter, Schema, check_positive, optional, positive
from .registry import register
from .resize import COPY, MEAN, NO_HISTORY, ZERO

__all__ = ["TopK", "RegTopK", "Sparsifier", "SparseWorker", "SparseAggregate", "aggregate_payloads", "DEFAULT_DENSITY"]

#: Density used when neither ``k`` nor ``density`` is given: the papers'
#: ResNet-18 / CIFAR-10 setting (0.1 %).
DEFAULT_DENSITY = 0.001


def check_density(name: str, value: Any) -> float:
    """A fraction in ``(0, 1]``, as a float (``density_to_k`` reads an int as a count: density=1 would send one entry)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


#: Top-k's keywords (RegTop-k adds mu and q).
TOPK = BASE.with_defaults(lr=0.01) + Schema(
    Hyperparameter("k", None, optional(positive(integer=True)), "entries each rank sends per step (give k or density)"),
    Hyperparameter("density", None, optional(check_density), f"or the fraction sent, in (0, 1] (neither: {DEFAULT_DENSITY})"),
) + LOCAL_SGD


@dataclass(frozen=True)
class Sparsifier:
    """What every worker sends: how many entries, ranked how.

    Raises
    ------
    ValueError, TypeError
        Naming the argument and its value.
    """

    k: Optional[int] = None
    density: Optional[float] = None
    mu: Optional[float] = None
    q: float = 1e8

    def __post_init__(self) -> None:
        if self.k is not None and self.density is not None:
            raise ValueError(f"give k or density, not both; got k={self.k!r} and density={self.density!r}")
        if self.k is not None:
            check_positive("k", self.k, integer=True)
        else:
            density = DEFAULT_DENSITY if self.density is None else self.density
            object.__setattr__(self, "density", check_density("density", density))
        if self.mu is not None:
            object.__setattr__(self, "mu", float(check_positive("mu", self.mu)))
        object.__setattr__(self, "q", float(check_positive("q", self.q)))

    @property
    def regularized(self) -> bool:
        """RegTop-k (True) or Top-k."""
        return self.mu is not None

    def count(self, d: int) -> int:
        """k for vectors of ``d`` entries.

        Raises
        ------
        ValueError
            ``k > d``.
        """
        if self.k is not None:
            if self.k > d:
                raise ValueError(f"k must be <= the number of parameters ({d}), got k={self.k}")
            return self.k
        return density_to_k(d, self.density)

    def hyperparameters(self) -> Dict[str, Any]:
        out = asdict(self)
        if not self.regularized:
            del out["mu"], out["q"]
        return out


class _SparseSGD(LocalStepState, SynchronousAlgorithm):
    """Top-k / RegTop-k with error feedback over its workers (docs/algorithm-notes.md)."""

    fused_gradient_check = True  # error feedback's pass over g checks it
    # Islands: every rank of an island selects the same global top k of the island's mean; only the payload's bytes
    # are sliced along the rails, so the selection stays the worker's (docs/islands.md).
    islands_refusal = None
    inner_role = "gradient"
    exchange_keeps_gradient = True  # the error feedback: what was not sent, in the units it was sent in
    inner_rule = ("a_i = g_i + e_i, e_i <- a_i - a_i 1_S_i; G = (1/N) sum_i a_i 1_S_i into .grad; x <- inner(x, G)  "
                  "(the paper: x <- x - eta G, inner = SGD)")
    training_defaults = {"lr": 0.05, "density": 0.01, "momentum": 0.9}
    wire_summary = "8k bytes (or bitmap + values) + 8-byte header sent, (P-1) times that received"

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        k = Sparsifier(k=hyper.get("k"), density=hyper.get("density")).count(d)
        return [Call("allgather", encoded_nbytes(k, d), ranks, len(steps))]  # every rank's encoded payload

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        super().__init__(topology, **hyperparameters)
        self.sparsifier = Sparsifier(**{f.name: self._values[f.name] for f in fields(Sparsifier) if f.name in self._values})
        self.local = LocalSGD.from_values(self._values)
        # With momentum or weight decay the step on G is LocalSGD's dense update; otherwise the papers' sparse one.
        self._dense = bool(self.local.momentum or self.local.weight_decay)
        self.worker: Optional[SparseWorker] = None
        self._aggregate: Optional[Any] = None  # G, dense: this step's, and RegTop-k's G_prev in the next
        # The steps read G only where it is non-zero: the dense copy is written when asked for (the aggregate property)
        self._latest: Optional[SparseAggregate] = None  # this step's G where non-zero, while its buffers hold it
        self._aggregate_written = True  # whether self._aggregate holds this step's G
        self._payload: Optional[Any] = None  # this rank's payload (the Allgather's send buffer)
        self._payloads: Optional[Any] = None  # every rank's payload, (P, nbytes)
        self._touched: Optional[Any] = None  # where G is non-zero (None: unknown, e.g. after a resume)
        self._indices: Optional[Any] = None  # the decoded indices of bitmap payloads, (P, k)

    def hyperparameters(self) -> Dict[str, Any]:
        return {**self.sparsifier.hyperparameters(), **self.local.hyperparameters()}

    def _use_inner(self, inner: Any) -> None:
        super()._use_inner(inner)
        self._dense = True  # the inner optimizer steps on the dense aggregate G

    def use_groups(self, bounds: Any) -> None:
        super().use_groups(bounds)
        self._dense = True  # the groups' momentum and decay may change: the update reads G through the local step

    @property
    def k(self) -> Optional[int]:
        """Entries each rank sends per step (known after :meth:`setup`)."""
        return None if self.worker is None else self.worker.k

    @property
    def payload(self) -> Optional[Any]:
        """The bytes this rank sent in the last step (:func:`mpiopt.kernels.decode` reads them)."""
        return self._payload

    @property
    def aggregate(self) -> Optional[Any]:
        """``G`` of the last step, the same on every rank.

        The steps read ``G`` where it is non-zero only, and leave the dense
        vector to its first read after a step (one pass over it).
        """
        if not self._aggregate_written:  # the steps leave it to here (one pass over d, when asked)
            self._aggregate[...] = 0
            self._aggregate[self._latest.touched] = self._latest.values
            self._touched = self._latest.touched
            self._aggregate_written = True
        return self._aggregate

    # -- state: the worker's buffers, exposed under stable names ---------------------------
    @property
    def error(self) -> Optional[Any]:
        return None if self.worker is None else self.worker.error

    @property
    def sent_indices(self) -> Optional[Any]:
        return None if self.worker is None else self.worker.sent_indices

    @property
    def sent_values(self) -> Optional[Any]:
        return None if self.worker is None else self.worker.sent_values

    @property
    def has_history(self) -> bool:
        return self.worker is not None and self.worker.has_history

    @has_history.setter
    def has_history(self, value: bool) -> None:
        self.worker.has_history = bool(value)

    # -- the algorithm ----------------------------------------------------------------------
    def _allocate(self, params: Any) -> None:
        xp = array_module(params)
        workers = self.workers.size
        self.worker = SparseWorker(self.sparsifier, params, workers)
        self.local.allocate(params)
        self._aggregate = empty_apart(params, zero=True)
        self._payload = xp.empty(self.worker.payload_nbytes, dtype=xp.uint8)
        self._payloads = xp.empty((workers, self.worker.payload_nbytes), dtype=xp.uint8)
        # On a GPU the rows are decoded and added by kernels (one wait for the device), with buffers of their own.
        self._device_aggregation = None if xp is np else DeviceAggregation.create(workers, self.worker.k, params.size)
        self._indices = self._union_bits = self._unions = self._sums = None
        self._union_slot = 0  # the union buffer that does not hold self._touched
        if self._device_aggregation is None:
            bitmaps = payload_format(self.worker.k, self.worker.num_params) == "bitmap"
            # Bitmap payloads' indices are decoded here each step (pairs payloads' are read in place).
            self._indices = xp.empty((workers, self.worker.k), dtype=xp.int32) if bitmaps else None
            # Where the union of the sent indices is formed and kept as the next step's stale entries: two
            # buffers used in turn, as a step's union must not overwrite the stale entries it clears.
            self._union_bits = xp.empty(packed_nbytes(params.size), dtype=xp.uint8)
            union = min(params.size, workers * self.worker.k)
            self._unions = xp.empty((2, union), dtype=xp.int32)
            self._sums = xp.empty(union, dtype=params.dtype)  # per union entry, the workers' sum
        # A dense update that cannot read G's non-zero entries alone (at most P k: the union buffers' length)
        # reads all of it, as does RegTop-k's general selection; otherwise the dense G is written only when
        # asked for (the aggregate property), since writing it costs a pass over d where clearing costs P k.
        self._reads_support = self._dense and self.inner is None and len(self.local.groups or [0]) == 1 and reads_support(params, None if self._sums is None else (self._unions[0], self._sums))
        self._write_out = (self._dense and not self._reads_support) or self.worker.reads_dense_aggregate

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        # Without momentum and weight decay the paper's rule, x <- x - lr G where G is non-zero, rides in the aggregation.
        self._exchange_payloads(grad, check_finite=self._checks_in_step(), params=None if self._dense else params)
        if self._dense:  # x <- x - lr G with momentum / decay, from G's non-zero values where the loop reads only those
            self.local.apply(params, self._aggregate, self.lr, grad_support=self._latest if self._reads_support else None)

    def _exchange_payloads(self, grad: Any, check_finite: bool, params: Optional[Any]) -> None:
        """Compress, Allgather and aggregate: G of this step (and ``x <- x - lr G`` on ``params`` where given)."""
        # RegTop-k's G_prev: its non-zero entries where the last step kept them, the dense G (written when
        # first read: the aggregate property) where the worker's general code reads it.
        sent = self.worker.compress(
            grad, lambda: self.aggregate, out=self._payload, check_finite=check_finite, prev_support=self._latest,
        )
        if sent is None:
            self._non_finite_gradient()  # before the Allgather
        self.workers.Allgather(self._payload, self._payloads)
        # G = (1/N) sum_n sent_n, non-zero on at most P k entries; the update on params in the same walk
        # gives the dense update's floats.
        aggregate = aggregate_payloads(
            self._payloads, out=self._aggregate, stale=self._touched, indices_out=self._indices,
            union_bits=self._union_bits, union_out=None if self._unions is None else self._unions[self._union_slot], sums_out=self._sums,
            params=params, lr=self.lr, write_out=self._write_out, device=self._device_aggregation,
        )
        self._union_slot ^= 1  # the next union goes to the other buffer
        self._latest = None if aggregate.values is None else aggregate
        self._aggregate_written = self._write_out or aggregate.values is None
        self._touched = aggregate.touched if self._aggregate_written else None

    def _exchange(self, params: Any, grad: Any) -> Any:
        self._exchange_payloads(grad, check_finite=False, params=None)
        return self.aggregate  # dense: the caller applies (and may clip) it

    def load_state_dict(self, state: Any, *, override_hyperparameters: bool = False) -> None:
        sent = state.get("arrays", {}).get("sent_indices")
        mine = None if self.worker is None else self.worker.sent_indices
        if mine is not None and state.get("scalars", {}).get("has_history") and getattr(sent, "shape", None) == mine.shape \
                and np.dtype(sent.dtype).kind in "iu":  # other shapes and dtypes: the base class names them
            # The step indexes with them unchecked (the GPU's kernels, too): a bad file is refused here, nothing loaded.
            check_indices("the state's sent_indices", sent, self.num_params)
        super().load_state_dict(state, override_hyperparameters=override_hyperparameters)
        self._touched = None  # the restored G may be non-zero anywhere
        self._latest, self._aggregate_written = None, True


@register
class TopK(_SparseSGD):
    """Top-k sparsified SGD with error feedback (docs/algorithms.md "Top-k with error feedback").

    Notes
    -----
    Parameters are float32 or float64; the payload carries the values in
    that dtype, so the sent values and the error buffer add up to ``g + e``
    exactly.  State: ``error`` and the momentum buffer.
    """

    name = "topk"
    listing_order = 50
    schema = TOPK
    state_arrays = ("error", "momentum_buffer")
    # The residuals still owed are (1/P) sum e: the mean on every new rank keeps them; momentum of G is the same everywhere.
    resize_rules = {"error": MEAN, "momentum_buffer": COPY}
    update_goal = 2.5


@register
class RegTopK(_SparseSGD):
    """RegTop-k: Top-k with error feedback, ranked by ``tanh(|1 + delta| / mu) |a|`` (Bereyhi et al.).

    Notes
    -----
    State: ``error``, ``sent_indices`` and ``sent_values`` (last step's
    selection), ``aggregate`` (last step's ``G``), ``has_history`` and the
    momentum buffer.
    """

    name = "regtopk"
    listing_order = 60
    schema = TOPK + Schema(
        Hyperparameter("mu", 5.0, positive(), "RegTop-k's temperature of the tanh in the selection score"),
        Hyperparameter("q", 1e8, positive(), "RegTop-k's Q: delta of entries not sent last step"),
    )
    state_arrays = ("error", "sent_indices", "sent_values", "aggregate", "momentum_buffer")
    state_scalars = ("has_history",)
    # As Top-k's, and last step's G is the same everywhere; what a rank sent belongs to an old rank, so the first
    # step after a resize ranks as Top-k, as the first step of a run does.
    resize_rules = {
        "error": MEAN, "aggregate": COPY, "momentum_buffer": COPY,
        "sent_indices": ZERO, "sent_values": ZERO, "has_history": NO_HISTORY,
    }
    update_goal = 3.0
