"""``DistributedOptimizer``: any mpiopt algorithm behind the ``torch.optim.Optimizer`` interface.

The parameters move into one contiguous flat buffer, each parameter a view
into it, and each ``.grad`` a view into a second one, so ``backward()``
accumulates straight into it; the algorithm reads and updates them in place
through zero-copy numpy (CPU) or cupy (CUDA) views: the torch layer adds no
copy and no math to a step.  Rank 0's parameters are broadcast at
construction.

- ``inner=torch.optim.AdamW(...)`` (any optimizer over the same parameters)
  replaces the built-in SGD update: ``sgd``, ``topk``, ``regtopk`` write the
  exchanged gradient into ``.grad`` and step it; ``easgd``, ``lsgd``,
  ``dasgd``, ``diloco``, ``streaming_diloco`` step it on this rank's
  gradient, then pull, average or take the outer step; ``signum`` and the
  asynchronous algorithms refuse it.  Its groups and state are this
  optimizer's.  Each algorithm's rule with it: its ``inner_rule`` (also
  in ``mpiopt train --help``).
- Without it, each parameter group may set the built-in update's ``lr``,
  ``momentum``, ``dampening``, ``nesterov``, ``weight_decay`` (read at every
  ``step()``, so schedulers that cycle them work); other keys are refused
  naming the group and the key.
- ``synchronize()`` completes a gradient exchange early and leaves it in
  ``.grad`` to clip or unscale; the next ``step()`` does not exchange again.
  For the parameter-averaging algorithms clipping clips this rank's own
  gradient.
- ``overlap`` (``sgd``'s default at more than one rank, as in DDP) exchanges
  the gradient in buckets during ``backward()``; ``overlap=False`` for a loop
  that must change this rank's own gradient before it is sent.
- ``backward_passes_per_step=N`` accumulates N backward passes per step;
  ``torch.amp.GradScaler`` overflows are decided collectively (every rank
  skips together; :class:`mpiopt.torch.GradScaler` also keeps the ranks'
  scales equal, as under DDP); ``state_dict()`` has torch.optim's shape plus the
  algorithm's state under ``"mpiopt"`` in tensors (``torch.load``'s default reads it).

docs/torch.md has the details: the bucket order and its bitwise guarantee,
what overlap means for ``.grad`` between ``backward()`` and ``step()``,
GradScaler with overlap, and why only ``sgd`` overlaps.  The asynchronous
algorithms run through :meth:`DistributedOptimizer.run`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from ..algorithms import ASYNCHRONOUS, SYNCHRONOUS, Algorithm, StepRecord, create
from ..algorithms.local import LOCAL_SGD
from ..algorithms.schema import check_positive
from ..arrays import host_apart
from ..comm import Ledger, Topology
from ..comm.buffers import tensor_array, torch_numpy_dtype
from ..kernels.update import all_finite
from .overlap import BucketExchange
from .state import as_arrays, as_tensors

__all__ = ["DistributedOptimizer"]

_SUPPORTED_DTYPES = (torch.float32, torch.float64)
#: Keys a parameter group may carry: ours, and what schedulers add.
_GROUP_KEYS = {"params", "lr", "initial_lr"}


def _flat_buffer(total: int, like: torch.Tensor, zero: bool = False) -> torch.Tensor:
    """A flat buffer of ``total`` elements of ``like``'s dtype and device; on the host, placed by :func:`mpiopt.arrays.host_apart`."""
    if like.device.type != "cpu":
        return (torch.zeros if zero else torch.empty)(total, dtype=like.dtype, device=like.device)
    return torch.from_numpy(host_apart(total, torch_numpy_dtype(like), zero=zero))


def loss_value(loss: Any) -> Optional[float]:
    """A loss (tensor, number or None) as a Python float, detached from the graph."""
    if loss is None:
        return None
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


def _address(array: Any) -> int:
    return array.data.ptr if hasattr(array.data, "ptr") else array.ctypes.data


def _add_cost(record: StepRecord, delta: Ledger) -> StepRecord:
    """``record`` with the bytes and blocked times of a ledger delta added."""
    comm, wait = delta.blocked_seconds()
    return dataclasses.replace(
        record,
        bytes_sent=record.bytes_sent + delta.bytes_sent,
        bytes_recv=record.bytes_recv + delta.bytes_recv,
        comm_seconds=record.comm_seconds + comm,
        wait_seconds=record.wait_seconds + wait,
    )


def _check_inner(inner: Optional[torch.optim.Optimizer], algorithm: str, hyperparameters: Dict[str, Any]) -> Optional[torch.optim.Optimizer]:
    """``inner`` if it can serve as ``algorithm``'s local step; the built-in update's hyperparameters are then refused."""
    if inner is None:
        return None
    if not isinstance(inner, torch.optim.Optimizer) or isinstance(inner, DistributedOptimizer):
        raise TypeError(f"inner must be a torch.optim.Optimizer over the model's parameters, got {type(inner).__name__}")
    local = sorted(set(hyperparameters) & ({"lr"} | set(LOCAL_SGD.names())))
    if local:
        raise ValueError(
            f"{algorithm} with inner={type(inner).__name__}: {', '.join(local)} belong to the inner optimizer; set them there"
        )
    return inner


class DistributedOptimizer(torch.optim.Optimizer):
    """An mpiopt algorithm as a ``torch.optim.Optimizer`` over flat parameter and gradient buffers.

    Parameters
    ----------
    params : iterable of torch.Tensor or of dicts
        The model's parameters (or parameter groups; see the module
        docstring for what groups may set).  All must require gradients
        and share one dtype (float32 or float64) and one device.
    algorithm : str
        An mpiopt algorithm name (:func:`mpiopt.available`).
    topology : Topology, optional
        Communicators; a new ``Topology()`` over ``MPI.COMM_WORLD`` by
        default (which also installs the abort-on-error hooks).
    backward_passes_per_step : int
        Backward passes accumulated per ``step()``: their gradients add up and
        ``step()`` divides them by it before the one exchange.
    overlap : bool, optional
        Exchange the gradient in buckets while backward runs (``sgd`` only,
        where it is the default, as in torch DDP; see docs/torch.md: clip or unscale
        after ``synchronize()`` (``step()`` refuses a gradient changed after
        backward, which would not be sent), or pass ``overlap=False`` to
        change this rank's own gradient before it is sent).
    bucket_cap_mb : float
        With ``overlap``: bucket size in MiB (as DDP's ``bucket_cap_mb``).
    inner : torch.optim.Optimizer, optional
        The local update (see the module docstring);
        the built-in SGD update without one.  Its ``param_groups`` become
        this optimizer's; ``lr``, ``momentum``, ``dampening``, ``nesterov``
        and ``weight_decay`` are then refused here (set them on it).
    **hyperparameters
        The algorithm's keyword arguments (``lr``, ``momentum``, ...), with
        the papers' defaults; validated by the algorithm.

    Attributes
    ----------
    algorithm : Algorithm
        The flat-vector algorithm doing the work.
    topology : Topology
        Its communicators.
    last : StepRecord or None
        Bytes and times of the last step.
    flat_params : torch.Tensor
        The flat parameter buffer the model's parameters are views into (read-only property).

    Examples
    --------
    >>> opt = DistributedOptimizer(model.parameters(), "sgd", lr=0.1, momentum=0.9)
    >>> scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=30)
    >>> for x, y in loader:
    ...     opt.zero_grad()
    ...     loss = F.cross_entropy(model(x), y)
    ...     loss.backward()
    ...     opt.step(loss=loss)
    ...     scheduler.step()
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
        self.inner = _check_inner(inner, algorithm, hyperparameters)
        self.algorithm: Algorithm = create(algorithm, self.topology, **hyperparameters)
        self.algorithm.loss_call = "opt.step(loss=loss)"  # what a message asking for the loss tells this API's user
        if self.inner is not None:  # before anything changes: an algorithm without an inner role refuses here
            self.algorithm.use_inner(self._inner_step, type(self.inner).__name__)
        if overlap is None:  # as torch DDP: on wherever the exchange can run during backward (and there is one)
            overlap = self.algorithm.overlaps_backward and self.topology.size > 1
        if overlap and not self.algorithm.overlaps_backward:
            raise ValueError(
                f"overlap=True needs an algorithm that exchanges the gradient by Allreduce (sgd); {algorithm!r} does not "
                "(docs/torch.md says why)"
            )
        self.backward_passes_per_step = backward_passes_per_step
        self.last: Optional[StepRecord] = None
        self._frozen = False
        # The keys a group may set for the built-in update (its own lr, momentum, ...): the algorithm's defaults.
        self._local_keys: Tuple[str, ...] = ()
        if self.inner is None and self.algorithm._local_update() is not None:
            self._local_keys = tuple(k for k in self.algorithm.schema.per_group() if k != "lr")
        own = self.algorithm.hyperparameters()
        super().__init__(params, {"lr": self.algorithm.lr, **{k: own[k] for k in self._local_keys}})
        self._frozen = True
        if self.inner is not None:  # its groups are ours: schedulers and clipping see one set of groups
            self._adopt_groups(self.inner)
        self._params: List[torch.nn.Parameter] = [p for group in self.param_groups for p in group["params"]]
        self._check_groups()
        self._flat_params, self._flat_grads = self._flatten()
        self._param_views = [p.data for p in self._params]
        self._grad_views = [p.grad for p in self._params]
        self._params_array = tensor_array(self._flat_params)
        self._grads_array = tensor_array(self._flat_grads)
        if self.inner is not None:
            self.algorithm.inner.grad_buffer = self._grads_array  # where torch's optimizer reads the gradient
        if self._local_keys:  # each group a contiguous slice of the flat buffer, in order
            sizes = [sum(p.numel() for p in group["params"]) for group in self.param_groups]
            self.algorithm.use_groups([(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))])
        world = self.topology.world
        world.agree(
            {"algorithm": algorithm, "shapes": [list(p.shape) for p in self._params], "dtype": str(self._flat_params.dtype)},
            what="model passed to DistributedOptimizer",
        )
        world.Bcast(self._flat_params, root=0)
        self.algorithm.setup(self._params_array)
        self._hand_groups()
        self._verdict = np.zeros(3)  # GradScaler: overflow somewhere, largest scale, -smallest scale
        self._warned_scales = False
        self._own_finite = True  # whether this rank's gradient was finite when synchronize() skipped the exchange
        self._exchange: Optional[BucketExchange] = None
        self._synchronized: Optional[Tuple[Any, Ledger]] = None  # (exchanged gradient or None: skipped, its cost)
        if overlap:
            self._flat_total = _flat_buffer(self._flat_grads.numel(), self._flat_grads)  # the buckets' sums over the world
            self._total_array = tensor_array(self._flat_total)
            self._exchange = BucketExchange(
                self._params, self._grad_views, self._flat_grads, self._total_array, world, backward_passes_per_step,
                bucket_cap_mb * 2**20,
            )

    @property
    def flat_params(self) -> torch.Tensor:
        """The flat parameter buffer: one 1-D tensor, in parameter order, that every parameter is a view into.

        Read-only as an attribute (the views depend on this very tensor); its
        values may be read and written in place (``opt.flat_params.copy_(x)``
        sets the model's parameters), as a checkpoint restore does.
        """
        return self._flat_params

    # With an inner optimizer its groups and state are this optimizer's, read through (its load_state_dict replaces
    # the list, so a reference taken once would go stale).
    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        inner = self.__dict__.get("inner")
        return inner.param_groups if inner is not None and self.__dict__.get("_adopted") else self.__dict__["_own_groups"]

    @param_groups.setter
    def param_groups(self, groups: List[Dict[str, Any]]) -> None:
        self.__dict__["_own_groups"] = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        inner = self.__dict__.get("inner")
        return inner.state if inner is not None and self.__dict__.get("_adopted") else self.__dict__["_own_state"]

    @state.setter
    def state(self, state: Any) -> None:
        self.__dict__["_own_state"] = state

    # -- construction -------------------------------------------------------------------------
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Only during construction: the flat buffers cannot grow afterwards."""
        if self._frozen:
            raise RuntimeError("DistributedOptimizer: parameters cannot be added after construction (the flat buffer is fixed)")
        super().add_param_group(param_group)

    def _adopt_groups(self, inner: torch.optim.Optimizer) -> None:
        """Share ``inner``'s parameter groups (the same list), after checking that they hold our parameters."""
        ours = [p for group in self.param_groups for p in group["params"]]
        theirs = [p for group in inner.param_groups for p in group["params"]]
        if {id(p) for p in ours} != {id(p) for p in theirs} or len(ours) != len(theirs):
            # Equal counts are the usual mistake (an optimizer over a copy of the model): "4 against 4" would read as no difference.
            differs = (f"the same number of parameters ({len(ours)}) but other tensors (was it created over a copy of the model?)"
                       if len(theirs) == len(ours) else f"{len(theirs)} parameters against {len(ours)}")
            raise ValueError(
                f"inner optimizer {type(inner).__name__} holds other parameters than DistributedOptimizer's: {differs}; "
                "create it over the same parameters, e.g. inner=torch.optim.AdamW(model.parameters())"
            )
        self.defaults = inner.defaults
        self._adopted = True

    def _inner_step(self, params: Any, grad: Any) -> None:
        """The inner optimizer's step: ``grad`` is the parameters' ``.grad`` buffer (the algorithm wrote it there)."""
        self.inner.step()

    def _check_groups(self) -> None:
        if not self._params:
            raise ValueError("DistributedOptimizer got no parameters")
        if self.inner is not None:  # the groups are the inner optimizer's, with its hyperparameters
            self._check_tensors()
            return
        name = self.algorithm.name
        for i, group in enumerate(self.param_groups):
            extra = sorted(set(group) - _GROUP_KEYS - set(self._local_keys))
            if extra:
                why = (f"{name}'s built-in update takes {', '.join(('lr',) + self._local_keys)} per group; "
                       "for another optimizer's keywords give inner=" if self._local_keys else
                       f"{name} takes one set of hyperparameters for all parameters; pass them to DistributedOptimizer")
                raise ValueError(f"parameter group {i} sets {extra}: {why}")
        self._hand_groups()
        self._check_tensors()

    def _hand_groups(self) -> None:
        """The groups' learning rates (and the built-in update's per-group settings) to the algorithm, for the next step."""
        if self.inner is not None:  # the rates are the inner optimizer's, per group as it likes: the first is recorded
            self.algorithm.lr = float(self.param_groups[0]["lr"])
            return
        if not self._local_keys:
            self.algorithm.lr = self._group_lr()
            return
        values = []
        for i, group in enumerate(self.param_groups):
            lr = float(group["lr"])
            if not (lr >= 0 and math.isfinite(lr)):  # 0 is a scheduler's warm-up start or end
                raise ValueError(f"parameter group {i}: learning rate must be a finite number >= 0, got {lr!r}")
            values.append({"lr": lr, **{k: group[k] for k in self._local_keys}})
        if self.algorithm.num_params is not None:
            self.algorithm.set_group_values(values)
        self.algorithm.lr = values[0]["lr"]  # what records report

    def _check_tensors(self) -> None:
        kinds = sorted({(str(p.dtype), str(p.device)) for p in self._params})
        if len(kinds) > 1:
            raise ValueError(f"all parameters must share one dtype and device; got {kinds}")
        for i, p in enumerate(self._params):
            if not p.requires_grad:
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) does not require grad: leave frozen parameters out")
        dtype = self._params[0].dtype
        if dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"parameters must be float32 or float64, got {dtype} (keep float32 master weights; use torch.autocast for lower precision)"
            )

    def _flatten(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Move the parameters into one flat buffer and make every parameter and gradient a view."""
        first = self._params[0]
        total = sum(p.numel() for p in self._params)
        flat = _flat_buffer(total, first)
        grads = _flat_buffer(total, first, zero=True)
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                view = flat[offset : offset + n].view_as(p)
                view.copy_(p)
                p.data = view
                p.grad = grads[offset : offset + n].view_as(p)
                offset += n
        return flat, grads

    # -- torch.optim interface ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffer in place; ``set_to_none`` is ignored (the views must stay).

        With ``overlap``, after a backward pass without a ``step()`` the
        exchange that backward started is first completed (the other ranks
        start the same collectives) and discarded.
        """
        if self._exchange is not None and self._exchange.pending:
            self._exchange.start_rest()
            self._exchange.finish()
        self._synchronized = None  # an exchanged gradient not stepped on is dropped with the rest
        self._flat_grads.zero_()
        self._check_views(keep_replaced_grads=False)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Complete the gradient exchange now and leave the exchanged gradient in every parameter's ``.grad``.

        For the gradient-exchanging algorithms (``sgd``, ``topk``, ``regtopk``):
        ``torch.nn.utils.clip_grad_norm_`` after it clips what every rank
        shares, as under torch DDP, and the next :meth:`step` applies
        ``.grad`` without exchanging again (Horovod's ``synchronize``).
        ``easgd``, ``lsgd``, ``dasgd``, ``diloco`` and ``streaming_diloco``
        exchange parameters after the local step: there, clipping between
        ``backward()`` and ``step()`` clips this rank's own gradient, and
        ``synchronize()`` raises ``TypeError``.  A non-finite gradient on any
        rank leaves a non-finite ``.grad`` on every rank (a GradScaler then
        skips the step everywhere); ``topk`` and ``regtopk`` need
        ``scaler.unscale_(opt)`` before it (see docs/torch.md).

        Raises
        ------
        RuntimeError
            When called twice without a :meth:`step` in between.
        TypeError
            For an algorithm that exchanges no gradient (see above).
        """
        if self._synchronized is not None:
            raise RuntimeError("synchronize() was called twice without step(): the exchanged gradient is in .grad already")
        if self.algorithm.inner_role != "gradient":
            raise TypeError(
                f"{self.algorithm.name} exchanges parameters after the local step, not gradients: there is nothing to "
                "synchronize before step() (clipping .grad clips this rank's own gradient)"
            )
        changed = self._exchange is not None and self._exchange.changed_since_backward()
        replaced = self._check_views(keep_replaced_grads=True)
        self._refuse_changes_after_sending(changed or replaced)
        ledger = self.topology.ledger
        before = ledger.snapshot()
        if self._exchange is not None:  # the buckets backward started: their sums, then the mean into .grad
            self._exchange.start_rest()
            before = self._exchange.finish()  # the ledger when the first bucket left
            torch.div(self._flat_total, self.topology.size, out=self._flat_grads)
            exchanged = self._grads_array
        else:
            if self.backward_passes_per_step > 1:
                self._flat_grads.div_(self.backward_passes_per_step)
            # A non-finite gradient has every rank skip the exchange, to be judged in step(): a GradScaler's
            # unscale_ and step between here and there may call it an overflow (skip), else nan_policy decides.
            exchanged = self.algorithm.exchange(self._params_array, self._grads_array, skip_non_finite=True)
            if exchanged is None:  # as a sum of them would be, the exchanged gradient is not finite on any rank
                self._own_finite = all_finite(self._grads_array)  # (a pass on this path only) whose it was, for step()
                self._flat_grads.fill_(math.nan)  # so every rank's GradScaler finds the overflow, as under DDP
            elif exchanged is not self._grads_array:
                self._grads_array[...] = exchanged
        self._synchronized = (None if exchanged is None else self._grads_array, ledger.since(before))

    def _step_synchronized(self, loss: Any) -> Any:
        """``step()`` after :meth:`synchronize`: the local update with ``.grad`` as it is now."""
        exchanged, cost = self._synchronized
        self._synchronized = None
        skip, inverse_scale, _ = self._grad_scaler_verdict()
        if inverse_scale is not None:  # the scaler unscales only now: the exchange ran on the scaled gradient
            self._refuse_a_scaled_exchange()
        if skip:
            return self._skipped(loss)
        if exchanged is None and self.algorithm.nan_policy == "raise":  # not an overflow: end the job, naming the ranks
            self.algorithm.name_non_finite_ranks(self._own_finite)
        if inverse_scale is not None:
            self._flat_grads.mul_(inverse_scale)
        record = self.algorithm.step_exchanged(self._params_array, exchanged, loss=loss_value(loss))
        self.last = _add_cost(record, cost)
        return loss

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, loss: Any = None) -> Any:
        """Exchange and update: one step of the algorithm on the flat buffers.

        Parameters
        ----------
        closure : callable, optional
            Re-evaluates the model (forward and backward) and returns the loss.
        loss : tensor or float, optional
            This rank's training loss of the step (LSGD elects its leaders by
            it; recorded by every algorithm).  Taken from the closure's value
            when a closure is given.

        Returns
        -------
        The loss (the closure's value, or ``loss``).
        """
        if self.algorithm.protocol == ASYNCHRONOUS:
            raise TypeError(f"{self.algorithm.name} is asynchronous: train with opt.run(compute_fn, steps), not step()")
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        changed = self._synchronized is None and self._exchange is not None and self._exchange.changed_since_backward()
        replaced = self._check_views(keep_replaced_grads=True)
        if self._synchronized is None:
            self._refuse_changes_after_sending(changed or replaced)
        self._hand_groups()
        if self._synchronized is not None:
            return self._step_synchronized(loss)
        if self._exchange is None:
            skip, inverse_scale, _ = self._grad_scaler_verdict()
            if skip:
                return self._skipped(loss)  # some rank's scaled gradients overflowed: every rank skips
            if inverse_scale is not None:
                self._flat_grads.mul_(inverse_scale)
            if self.backward_passes_per_step > 1:
                self._flat_grads.div_(self.backward_passes_per_step)
            self.last = self.algorithm.step(self._params_array, self._grads_array, loss=loss_value(loss))
            return loss
        return self._step_overlapped(loss)

    def _step_overlapped(self, loss: Any) -> Any:
        """``step()`` after a backward pass that has started the exchange: finish it, then the local update."""
        exchange, ledger = self._exchange, self.topology.ledger
        exchange.start_rest()  # before any other collective: every rank starts the same ones in the same order
        if getattr(self, "found_inf", None) is not None and getattr(self, "grad_scale", None) is None:
            exchange.finish()
            raise RuntimeError(
                "scaler.unscale_(opt) changed the gradients while overlap=True was sending them: call opt.synchronize() "
                "before scaler.unscale_(opt) (the exchanged gradient is then in .grad, to unscale and clip), or create the "
                "optimizer with overlap=False"
            )
        skip, inverse_scale, same_scale = self._grad_scaler_verdict()
        before = exchange.finish()
        if skip:
            return self._skipped(loss)
        if inverse_scale is not None:
            if same_scale:
                self._flat_total.mul_(inverse_scale)  # a power of two commutes with the sum, bitwise
            else:  # the scalers diverged (an overflow on some ranks only): the scaled sums mean nothing
                self._flat_grads.mul_(inverse_scale)
                self.topology.world.Allreduce(self._grads_array, out=self._total_array)
        exchanged = ledger.since(before)
        record = self.algorithm.step_reduced(self._params_array, self._grads_array, self._total_array, loss=loss_value(loss))
        self.last = _add_cost(record, exchanged)
        return loss

    def finish(self) -> None:
        """Complete any communication still in flight (``dasgd``'s averaging, ``streaming_diloco``'s fragments).

        Call it once training is over, before evaluating or saving the final
        model.  Mid-run it merges an exchange before its step, which changes
        the steps after it: to evaluate mid-run, evaluate a copy or the
        ranks' models as they are; :meth:`state_dict` holds an exchange in
        flight, so checkpoints need no ``finish()``.
        """
        self.algorithm.finish(self._params_array)

    def run(self, compute_fn: Callable[[int], Any], steps: Optional[int] = None, **options: Any) -> Any:
        """Train with an asynchronous algorithm (``async_msgd``, ``async_lsgd``): a collective call.

        Parameters
        ----------
        compute_fn : callable
            ``compute_fn(step) -> loss``: forward and backward of this rank's
            batch number ``step`` (counting from 0); the gradients land in the
            flat buffer, which this method zeroes before each call.  World
            rank 0 serves and never calls it (except at world size 1).
        steps : int, optional
            Gradients this rank computes.
        **options
            Passed on to the algorithm's ``run`` (``seconds=`` for
            ``async_lsgd``, ``until=`` for ``async_msgd``, ...).

        Returns
        -------
        The algorithm's result record (staleness histogram, counts, ...).
        On return the model holds the final parameters.
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
        """torch.optim's shape (``state``, ``param_groups``) plus the algorithm's state under ``"mpiopt"``, its arrays
        as CPU tensors (copies), which ``torch.load`` reads with its default ``weights_only=True``."""
        groups, index = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(saved)
        return {
            "state": {} if self.inner is None else self.inner.state_dict()["state"],
            "param_groups": groups,
            "mpiopt": {"algorithm": as_tensors(self.algorithm.state_dict()), "backward_passes_per_step": self.backward_passes_per_step},
        }

    def load_state_dict(self, state_dict: Dict[str, Any], *, override_hyperparameters: bool = False) -> None:
        """Restore what :meth:`state_dict` returned, its tensors on any device, or its earlier form with numpy arrays (same
        model and algorithm; other hyperparameters only with ``override_hyperparameters``, see :meth:`Algorithm.load_state_dict <mpiopt.algorithms.base.Algorithm.load_state_dict>`)."""
        if "mpiopt" not in state_dict:
            raise ValueError("not a DistributedOptimizer state (no 'mpiopt' entry): was it saved by another optimizer?")
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                f"the state has parameter groups of sizes {[len(g['params']) for g in groups]}, "
                f"this optimizer {[len(g['params']) for g in self.param_groups]}"
            )
        saved = state_dict["mpiopt"]
        if saved["backward_passes_per_step"] != self.backward_passes_per_step:
            raise ValueError(
                f"backward_passes_per_step is {self.backward_passes_per_step}, the state has {saved['backward_passes_per_step']}"
            )
        self.algorithm.load_state_dict(as_arrays(saved["algorithm"]), override_hyperparameters=override_hyperparameters)
        if self.inner is not None:  # its state and groups, in torch.optim's own format
            self.inner.load_state_dict({"state": state_dict["state"], "param_groups": groups})
            return
        for group, stored in zip(self.param_groups, groups):
            group.update({k: v for k, v in stored.items() if k != "params"})

    # -- helpers ------------------------------------------------------------------------------
    def _group_lr(self) -> float:
        rates = {float(group["lr"]) for group in self.param_groups}
        if len(rates) > 1:
            raise ValueError(f"parameter groups have different learning rates {sorted(rates)}: mpiopt algorithms take one")
        lr = rates.pop()
        if not (lr >= 0 and math.isfinite(lr)):  # 0 is a scheduler's warm-up start or end
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr!r}")
        return lr

    def _check_views(self, keep_replaced_grads: bool) -> bool:
        """One pass over the parameters: each still lives in the flat buffer, and each gradient is its view again.

        A gradient the user replaced is copied into the view (``keep_replaced_grads``)
        or dropped; one set to None becomes the zeroed view.  Returns whether
        a replaced gradient was copied in, or one that backward had sent (overlap) set to None.
        """
        replaced = False
        for index, (p, param_view, grad_view) in enumerate(zip(self._params, self._param_views, self._grad_views)):
            if p.data_ptr() != param_view.data_ptr():
                raise RuntimeError(
                    "a parameter no longer lives in the optimizer's flat buffer (moved with .to()/.cuda() or replaced "
                    "after DistributedOptimizer was created): create the optimizer after moving the model"
                )
            if p.grad is not grad_view:
                if p.grad is None or not keep_replaced_grads:
                    grad_view.zero_()
                    # set to None after backward took it (not a parameter left out of this backward)
                    replaced |= p.grad is None and self._exchange is not None and self._exchange.finished(index)
                else:
                    grad_view.copy_(p.grad)
                    replaced = True
                p.grad = grad_view
        return replaced

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

    def _skipped(self, loss: Any) -> Any:
        """Record a step every rank skipped (a GradScaler overflow somewhere) and return its loss."""
        self.last = StepRecord(self.algorithm.steps, loss_value(loss), 0, 0, 0.0, 0.0, 0.0, skipped=True)
        return loss

    def agree_on_overflow(self, found_inf_per_device: Dict[Any, torch.Tensor]) -> None:
        """Make a GradScaler check's overflow flags every rank's maximum, in place (a collective call).

        :class:`mpiopt.torch.GradScaler` calls it, so that its scale backs
        off and grows on every rank together, as under torch DDP.
        """
        if self._synchronized is not None:  # unscale_ after synchronize(): the exchange ran on the scaled gradient
            self._refuse_a_scaled_exchange()
        flags = list(found_inf_per_device.values())
        self._verdict[:] = (max((float(flag) for flag in flags), default=0.0), 0.0, 0.0)
        self.topology.control.vote(self._verdict)
        for flag in flags:
            flag.fill_(self._verdict[0])

    def _grad_scaler_verdict(self) -> Tuple[bool, Optional[torch.Tensor], bool]:
        """With ``GradScaler.step(opt)``, decided together: (skip, inverse scale, every rank has the same scale).

        Any rank's overflow makes every rank skip, so no rank is left waiting
        in a collective the others skipped.  The inverse scale is None when
        there is nothing to unscale (no scaler, or ``scaler.unscale_(opt)``
        done already).
        """
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False, None, True
        scale = getattr(self, "grad_scale", None)
        value = 0.0 if scale is None else float(scale)
        self._verdict[:] = (1.0 if float(found_inf) > 0 else 0.0, value, -value)
        self.topology.control.vote(self._verdict)
        inverse = None if scale is None else scale.double().reciprocal().float().to(self._flat_grads.dtype)
        same_scale = bool(self._verdict[1] == -self._verdict[2])
        if not same_scale and not self._warned_scales:
            self._warned_scales = True
            warnings.warn(
                "the ranks' GradScalers have different scales (an earlier overflow on some ranks only backed off those "
                "ranks' scales): use mpiopt.torch.GradScaler, whose overflow checks agree across the ranks as under torch "
                "DDP" + (
                    "; until the scales agree each step sends the gradient twice" if self._exchange is not None else ""),
                stacklevel=4,
            )
        return bool(self._verdict[0]), inverse, same_scale
