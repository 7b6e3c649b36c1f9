"""``DistributedOptimizer``: any mpiopt algorithm behind the ``torch.optim.Optimizer`` interface.

The parameters and gradients are views into flat buffers (:mod:`.flat`) that
the algorithm updates in place; ``step()`` is one pipeline: finish the
exchange, the scaler's verdict, unscale, apply.  Inner optimizers, groups,
``synchronize()``, overlap, accumulation and GradScaler: docs/torch.md.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Iterable, Optional

import torch

from ..algorithms import ASYNCHRONOUS, SYNCHRONOUS, Algorithm, StepRecord, create
from ..algorithms.schema import check_positive
from ..algorithms.survival import Carried
from ..comm import Topology
from ..comm.buffers import tensor_array
from ..kernels.update import all_finite
from .flat import FlatBuffers, flat_buffer
from .groups import GroupsMixin, check_inner, check_survivable
from .survival import InnerRollback, RecoveryMixin
from .overlap import BucketExchange
from .pipeline import LOCAL, Exchanged, add_cost, loss_value, mean_over_passes
from .scaler import ScalerVote, Verdict
from .state import load_optimizer_state, on_host, optimizer_state

__all__ = ["DistributedOptimizer"]


def _address(array: Any) -> int:
    return array.data.ptr if hasattr(array.data, "ptr") else array.ctypes.data


class DistributedOptimizer(RecoveryMixin, GroupsMixin, torch.optim.Optimizer):
    """An mpiopt algorithm as a ``torch.optim.Optimizer`` over flat parameter and gradient buffers.

    Parameters
    ----------
    params : iterable of torch.Tensor or of dicts
        The model's parameters or groups, one dtype (float32 or float64) and device.
    algorithm : str
        An mpiopt algorithm name (:func:`mpiopt.available`).
    topology : Topology, optional
        Communicators; by default a new ``Topology()`` over ``MPI.COMM_WORLD``.
    backward_passes_per_step : int
        Backward passes per ``step()``: the optimizer averages them (do not divide the loss).
    overlap : bool, optional
        Sum the gradient in buckets during backward: ``sgd``'s exchange, or with ``islands=True`` the island's mean
        (the default where that sum spans more than one rank, but for exchanges that keep error feedback: docs/torch.md).
    bucket_cap_mb : float
        With ``overlap``: bucket size in MiB (DDP's ``bucket_cap_mb``).
    inner : torch.optim.Optimizer, optional
        The local update in place of the built-in SGD update; its groups become this optimizer's.
    **hyperparameters
        The algorithm's keyword arguments, validated by its schema; ``islands=True`` makes each node one worker
        (docs/islands.md).

    Examples
    --------
    >>> opt = DistributedOptimizer(model.parameters(), "sgd", lr=0.1, momentum=0.9)
    >>> for x, y in loader:
    ...     opt.zero_grad()
    ...     loss = F.cross_entropy(model(x), y)
    ...     loss.backward()
    ...     opt.step(loss=loss)
    """

    # torch.amp.GradScaler hands us the scale and the overflow flag (see step()).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        algorithm: str,
        *,
        topology: Optional[Topology] = None,
        backward_passes_per_step: int = 1,
        overlap: Optional[bool] = None,
        bucket_cap_mb: float = 25.0,
        inner: Optional[torch.optim.Optimizer] = None,
        **hyperparameters: Any,
    ) -> None:
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if overlap is not None and not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        check_positive("bucket_cap_mb", bucket_cap_mb)
        self.topology = Topology() if topology is None else topology
        if self.topology.on_failure != "abort":  # agreed on every rank: every rank refuses alike
            check_survivable(overlap)
            overlap = False
        self.inner = check_inner(inner, algorithm, hyperparameters)
        # A failed step's inner update is undone with it (survival only: a copy of its state each step).
        self._inner_rollback = InnerRollback() if self.inner is not None and self.topology.on_failure != "abort" else None
        self.algorithm: Algorithm = create(algorithm, self.topology, **hyperparameters)
        self.algorithm.loss_call = "opt.step(loss=loss)"  # what a message asking for the loss tells this API's user
        if self.inner is not None:  # before anything changes: an algorithm without an inner role refuses here
            self.algorithm.use_inner(self._inner_step, type(self.inner).__name__)
            # A replacement (on_failure="respawn") takes its survivor's inner state with the algorithm's.
            self.algorithm.carried = Carried(lambda: on_host(self.inner.state_dict()), self.inner.load_state_dict)
        alg = self.algorithm
        if overlap is None:  # as torch DDP: wherever a sum of the gradients can run during backward (over two ranks or more)
            overlap = alg.reduced_ranks > 1 and not (alg.islands and alg.exchange_keeps_gradient)
        if overlap and not alg.overlaps_backward:
            raise ValueError(
                f"overlap=True needs an algorithm that exchanges the gradient by Allreduce (sgd), or islands=True (the island's "
                f"mean is then summed in buckets); {algorithm!r} does not (docs/torch.md says why)"
            )
        #: Whether the gradient is summed in buckets during backward (over the island with islands, else the world).
        self.overlap = overlap
        self.backward_passes_per_step = backward_passes_per_step
        self.last: Optional[StepRecord] = None
        self._frozen = False
        self._local_keys = ()  # the keys a group may set for the built-in update, besides lr
        super().__init__(params, self._group_defaults())
        self._frozen = True
        if self.inner is not None:  # its groups are ours: schedulers and clipping see one set of groups
            self._adopt_groups(self.inner)
        self._check_groups()
        flat = self._flat = FlatBuffers([p for group in self.param_groups for p in group["params"]])
        self._params, self._flat_params, self._flat_grads = flat.params, flat.flat_params, flat.flat_grads
        self._grad_views, self._params_array, self._grads_array = flat.grad_views, flat.params_array, flat.grads_array
        if self.inner is not None:
            self.algorithm.inner.grad_buffer = self._grads_array  # where torch's optimizer reads the gradient
        if self._local_keys:
            self.algorithm.use_groups(self._group_slices())
        world = self.topology.world
        if not self.topology.joining:  # a replacement's survivors are in recover(): setup matches theirs
            world.agree(
                {"algorithm": algorithm, "shapes": [list(p.shape) for p in self._params], "dtype": str(self._flat_params.dtype),
                 "device": self._flat_params.device.type},  # a staged GPU buffer is other MPI calls than a host one
                what="model passed to DistributedOptimizer",
            )
            world.Bcast(self._flat_params, root=0)
        self.algorithm.setup(self._params_array)  # a replacement's: the parameters and state of a survivor
        self._hand_groups()
        self._vote = ScalerVote(self.topology.control)
        self._own_finite = True  # whether this rank's gradient was finite when synchronize() skipped the exchange
        self._exchange: Optional[BucketExchange] = None
        self._synchronized: Optional[Exchanged] = None
        if overlap:
            self._flat_total = flat_buffer(self._flat_grads.numel(), self._flat_grads)  # the buckets' sums
            self._total_array = tensor_array(self._flat_total)
            self._exchange = BucketExchange(
                self._params, self._grad_views, self._flat_grads, self._total_array, alg.reduced_over, backward_passes_per_step,
                bucket_cap_mb * 2**20, functools.partial(mean_over_passes, self._flat_grads, backward_passes_per_step),
            )

    @property
    def flat_params(self) -> torch.Tensor:
        """The flat parameter buffer every parameter is a view into (its values may be set in place, not the attribute)."""
        return self._flat_params

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Only during construction: the flat buffers cannot grow afterwards."""
        if self._frozen:
            raise RuntimeError("DistributedOptimizer: parameters cannot be added after construction (the flat buffer is fixed)")
        super().add_param_group(param_group)

    def _inner_step(self, params: Any, grad: Any) -> None:
        """The inner optimizer's step: ``grad`` is the parameters' ``.grad`` buffer (the algorithm wrote it there)."""
        if self._inner_rollback is not None and self.algorithm.may_communicate():
            self._inner_rollback.save(self.inner, self.algorithm.steps + 1)  # the step may yet be undone (survival)
        self.inner.step()

    # -- torch.optim interface ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient in place (``set_to_none`` is ignored: the views must stay).

        With overlap, an exchange backward started without a ``step()`` is first completed on every rank and dropped.
        """
        if self._exchange is not None and self._exchange.pending:
            self._exchange.start_rest()
            self._exchange.finish()
        self._synchronized = None  # an exchanged gradient not stepped on is dropped with the rest
        self._flat_grads.zero_()
        self._check_views(keep_replaced_grads=False)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Complete the gradient exchange now and leave in ``.grad`` the gradient the step applies, to clip or unscale.

        That is the exchanged gradient of ``sgd``, ``topk`` and ``regtopk``; with islands, for the algorithms that
        exchange parameters after the local step, the island's mean (its worker's gradient).  The next :meth:`step`
        applies ``.grad`` without exchanging again.  Others: ``TypeError``; twice without a step: ``RuntimeError``.
        """
        if self._synchronized is not None:
            raise RuntimeError("synchronize() was called twice without step(): the exchanged gradient is in .grad already")
        alg = self.algorithm
        if alg.inner_role != "gradient" and not alg.islands:
            raise TypeError(
                f"{alg.name} exchanges parameters after the local step, not gradients: there is nothing to "
                "synchronize before step() (clipping .grad clips this rank's own gradient)"
            )
        self._take_gradients()
        ledger = self.topology.ledger
        before, total = ledger.snapshot(), None
        if self._exchange is not None:  # the buckets backward started (each divided by the passes)
            self._exchange.start_rest()
            before = self._exchange.finish()  # the ledger when the first bucket left
            total = self._total_array
        else:
            self._mean_over_passes()
        if total is not None and not alg.islands:  # sgd: the buckets' sum over the world is its exchange
            torch.div(self._flat_total, self.topology.size, out=self._flat_grads)
            exchanged = self._grads_array
        elif alg.inner_role == "gradient":
            # A non-finite gradient has every rank skip the exchange, to be judged in step(): a GradScaler's
            # unscale_ and step between here and there may call it an overflow (skip), else nan_policy decides.
            exchanged = alg.exchange(self._params_array, self._grads_array, skip_non_finite=True, reduced=total)
            if exchanged is None:  # as a sum of them would be, the exchanged gradient is not finite on any rank
                self._own_finite = all_finite(self._grads_array)  # (a pass on this path only) whose it was, for step()
                self._flat_grads.fill_(math.nan)  # so every rank's GradScaler finds the overflow, as under DDP
        else:  # islands: the island's mean, which the worker's local step reads
            exchanged = alg.worker_gradient(self._grads_array, reduced=total, out=self._grads_array)
        if exchanged is not None and exchanged is not self._grads_array:
            self._grads_array[...] = exchanged
        self._synchronized = Exchanged("synchronized", exchanged is not None, cost=ledger.since(before))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, loss: Any = None) -> Any:
        """One step of the algorithm: finish the exchange, the scaler's verdict, unscale, apply.

        ``loss`` (or the ``closure``'s value) is this rank's training loss:
        LSGD elects its leaders by it, every algorithm records it.  Returns it.
        """
        if self.algorithm.protocol == ASYNCHRONOUS:
            raise TypeError(f"{self.algorithm.name} is asynchronous: train with opt.run(compute_fn, steps), not step()")
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._take_gradients()
        self._hand_groups()
        exchanged = self._finish_exchange()
        verdict = self._vote.verdict(self, self._flat_grads.dtype, resends=self._exchange is not None)
        if verdict.inverse_scale is not None and exchanged.kind == "synchronized":
            self._refuse_a_scaled_exchange()  # the scaler unscales only now: the exchange ran on the scaled gradient
        if verdict.skip:  # some rank's scaled gradients overflowed: every rank skips
            self.last = StepRecord(self.algorithm.steps, loss_value(loss), 0, 0, 0.0, 0.0, 0.0, skipped=True)
            return loss
        self._unscale(exchanged, verdict)
        self.last = self._apply(exchanged, loss_value(loss))
        return loss

    def _finish_exchange(self) -> Exchanged:
        """The exchange ``synchronize()`` made, or the buckets backward started (waited for), or none yet."""
        if self._synchronized is not None:
            exchanged, self._synchronized = self._synchronized, None
            return exchanged
        if self._exchange is None:
            return LOCAL
        self._exchange.start_rest()  # before any other collective: every rank starts the same ones in the same order
        if getattr(self, "found_inf", None) is not None and getattr(self, "grad_scale", None) is None:
            self._exchange.finish()
            raise RuntimeError(
                "scaler.unscale_(opt) changed the gradients while overlap=True was sending them: call opt.synchronize() "
                "before scaler.unscale_(opt) (the exchanged gradient is then in .grad, to unscale and clip), or create the "
                "optimizer with overlap=False"
            )
        return Exchanged("reduced", before=self._exchange.finish())

    def _unscale(self, exchanged: Exchanged, verdict: Verdict) -> None:
        """Undo the GradScaler's scale on what the step will read."""
        inverse = verdict.inverse_scale
        if inverse is None:
            return
        if exchanged.kind != "reduced":
            self._flat_grads.mul_(inverse)
        elif verdict.same_scale:
            self._flat_total.mul_(inverse)  # a power of two commutes with the sum, bitwise
        else:  # the scalers diverged (an overflow on some ranks only): the scaled sums mean nothing
            self._flat_grads.mul_(inverse)
            self._exchange.comm.Allreduce(self._grads_array, out=self._total_array)

    def _apply(self, exchanged: Exchanged, loss: Optional[float]) -> StepRecord:
        """The algorithm's step on what the exchange left: its whole step, or its update after the exchange."""
        if exchanged.kind in ("local", "reduced") and self.algorithm.islands:
            # .grad takes the island's mean, as DDP leaves its mean there: the local step reads it without a copy
            before = exchanged.before or self.topology.ledger.snapshot()
            if exchanged.kind == "local":
                self._mean_over_passes()
            total = self._total_array if exchanged.kind == "reduced" else None
            self.algorithm.worker_gradient(self._grads_array, reduced=total, out=self._grads_array)
            cost = self.topology.ledger.since(before)
            return add_cost(self.algorithm.step(self._params_array, self._grads_array, loss=loss, island_mean=True), cost)
        if exchanged.kind == "local":
            self._mean_over_passes()
            return self.algorithm.step(self._params_array, self._grads_array, loss=loss)
        if exchanged.kind == "reduced":  # the buckets' cost up to here: the step records its own
            cost = self.topology.ledger.since(exchanged.before)
            record = self.algorithm.step_reduced(self._params_array, self._grads_array, self._total_array, loss=loss)
            return add_cost(record, cost)
        if self.algorithm.inner_role != "gradient":  # islands: .grad holds the island's mean, which the local step reads
            record = self.algorithm.step(self._params_array, self._grads_array, loss=loss, island_mean=True)
            return add_cost(record, exchanged.cost)
        if not exchanged.finite and self.algorithm.nan_policy == "raise":  # not an overflow: end the job, naming the ranks
            self.algorithm.name_non_finite_ranks(self._own_finite)
        record = self.algorithm.step_exchanged(self._params_array, self._grads_array if exchanged.finite else None, loss=loss)
        return add_cost(record, exchanged.cost)

    def _mean_over_passes(self) -> None:
        mean_over_passes(self._flat_grads, self.backward_passes_per_step)

    def finish(self) -> None:
        """Complete communication in flight (``dasgd``, ``streaming_diloco``) once training is over.

        Mid-run it merges an exchange early, which changes the run; :meth:`state_dict` holds one in flight.
        """
        self.algorithm.finish(self._params_array)

    def run(self, compute_fn: Callable[[int], Any], steps: Optional[int] = None, **options: Any) -> Any:
        """Train with an asynchronous algorithm (``async_msgd``, ``async_lsgd``): a collective call.

        ``compute_fn(step) -> loss`` runs forward and backward of this rank's
        batch ``step`` (world rank 0 serves and never calls it, but at world
        size 1); ``steps`` gradients per rank; ``options`` go to the
        algorithm's ``run``.  Returns its result record; the model then holds
        the final parameters.
        """
        if self.algorithm.protocol == SYNCHRONOUS:
            raise TypeError(f"{self.algorithm.name} is synchronous: call step() after each backward pass")
        flat = self._params_array

        def worker_fn(params: Any, step: int, out: Any) -> float:
            if _address(params) != _address(flat):
                flat[...] = params  # the runtime's copy of the (possibly stale) parameters
            self._flat_grads.zero_()
            with torch.enable_grad():
                loss = compute_fn(step)
            out[...] = self._grads_array
            value = loss_value(loss)
            return math.nan if value is None else value

        self._check_views(keep_replaced_grads=False)
        self.algorithm.lr = self._group_lr()
        return self.algorithm.run(flat, worker_fn, steps, **options)

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim's shape plus the algorithm's state under ``"mpiopt"`` (CPU tensors: ``torch.load``'s default reads it)."""
        return optimizer_state(self)

    def load_state_dict(self, state_dict: Dict[str, Any], *, override_hyperparameters: bool = False) -> None:
        """Restore what :meth:`state_dict` returned (same model and algorithm; see :func:`.state.load_optimizer_state`)."""
        load_optimizer_state(self, state_dict, override_hyperparameters)

    # -- helpers ------------------------------------------------------------------------------
    def _check_views(self, keep_replaced_grads: bool) -> bool:
        """The flat buffers' view check (:meth:`FlatBuffers.check_views`), a gradient set to None after overlap sent it counting as changed."""
        return self._flat.check_views(keep_replaced_grads, lambda index: self._exchange is not None and self._exchange.finished(index))

    def _take_gradients(self) -> None:
        """``.grad`` back into the flat views; a gradient changed after backward sent it (overlap) is refused."""
        changed = self._synchronized is None and self._exchange is not None and self._exchange.changed_since_backward()
        replaced = self._check_views(keep_replaced_grads=True)
        if self._synchronized is None:
            self._refuse_changes_after_sending(changed or replaced)

    def _refuse_a_scaled_exchange(self) -> None:
        """Raise if the exchange that kept state in the gradient's units (Top-k's error feedback) ran on a scaled gradient."""
        if self.algorithm.exchange_keeps_gradient:
            self._synchronized = None
            raise RuntimeError(
                f"{self.algorithm.name} exchanged a loss-scaled gradient: its error feedback keeps what it did not send in "
                "the units it was sent in, which a change of scale would mix up. With a GradScaler call "
                "scaler.unscale_(opt) before opt.synchronize()"
            )

    def _refuse_changes_after_sending(self, changed: bool) -> None:
        """Raise (after completing the exchange) if ``.grad`` was ``changed`` (in place or replaced) after backward sent it."""
        if not changed or self._exchange is None or not self._exchange.pending:
            return
        self._exchange.start_rest()  # every rank starts and completes the same collectives, whatever it raises
        self._exchange.finish()
        raise RuntimeError(
            "the gradient was changed after backward() while overlap=True was sending it (clip_grad_norm_, another "
            "in-place change or a replaced .grad between backward() and step()): the change would not be sent. Call opt.synchronize() "
            "before changing it (the exchanged gradient is then in .grad, to clip), or create the optimizer with "
            "overlap=False to change this rank's own gradient before it is sent"
        )

    def agree_on_overflow(self, found_inf_per_device: Dict[Any, torch.Tensor]) -> None:
        """Make a GradScaler check's overflow flags every rank's maximum, in place (a collective call).

        :class:`mpiopt.torch.GradScaler` calls it, so that the scales back off and grow on every rank together.
        """
        if self._synchronized is not None:  # unscale_ after synchronize(): the exchange ran on the scaled gradient
            self._refuse_a_scaled_exchange()
        self._vote.agree(found_inf_per_device)
