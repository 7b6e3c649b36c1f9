"""The algorithm protocol: one small base class over flat parameter vectors, and its two protocols.

A subclass declares its schema and state and writes its math in
:meth:`Algorithm._step`; the base class, composed of one mixin per concern
(:mod:`.plan`, :mod:`.state`, :mod:`.nonfinite`, :mod:`.inner`,
:mod:`.record`), does the rest alike for every algorithm.  Errors on one
rank and how the ranks stay together: docs/failures.md.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Dict, Mapping, NoReturn, Optional, Tuple

import numpy as np

from ..arrays import array_module, keep_apart
from ..comm import Topology
from .inner import LocalStepChoice
from .islands import IslandWorkers
from .survival import Survival
from .local import LOCAL_SGD
from .nonfinite import NonFinitePolicy
from .plan import Planned, due_steps
from .record import StepRecord, record_step
from .schema import Schema, check_bool
from .state import StateDict, hyperparameter_lines
from .vocabulary import ASYNCHRONOUS, BASE, EVALUATED_MODELS, NAN_POLICIES, SYNCHRONOUS

__all__ = [
    "Algorithm", "SynchronousAlgorithm", "AsynchronousAlgorithm", "StepRecord", "SYNCHRONOUS", "ASYNCHRONOUS",
    "EVALUATED_MODELS", "BASE", "NAN_POLICIES", "due_steps", "hyperparameter_lines",
]


class Algorithm(Planned, StateDict, NonFinitePolicy, LocalStepChoice, IslandWorkers, Survival):
    """Base class of every distributed optimizer: derive from :class:`SynchronousAlgorithm` or :class:`AsynchronousAlgorithm`.

    A subclass sets :attr:`name` and :attr:`schema`, allocates state in
    :meth:`_allocate`, does the math in :meth:`_step` and lists its state in
    :attr:`state_arrays` and :attr:`state_scalars`.  The class attributes
    below are everything the rest of the package asks about an algorithm
    (docs/new-algorithm.md says which layer reads which).
    """

    name: ClassVar[str] = ""
    #: The constructor's keywords: defaults, checks, which are per parameter group or execution knobs (:mod:`.schema`).
    schema: ClassVar[Schema] = BASE
    #: :data:`SYNCHRONOUS` or :data:`ASYNCHRONOUS`: set by the protocol classes.
    protocol: ClassVar[str] = ""
    #: Which model a training run evaluates: one of :data:`EVALUATED_MODELS`.
    evaluates: ClassVar[str] = "identical"
    #: ``mpiopt train``'s starting hyperparameters, where the papers' were chosen for other models; where a class
    #: and its bases below Algorithm set none, the schema's ``training`` values (``lr``: 0.05).
    training_defaults: ClassVar[Mapping[str, Any]] = {"lr": 0.05}
    #: How each state entry moves to another world size (rules of :mod:`~mpiopt.algorithms.resize`); None: it cannot.
    resize_rules: ClassVar[Optional[Mapping[str, Any]]] = None
    #: Why a state without :attr:`resize_rules` cannot move to another world size.
    resize_refusal: ClassVar[str] = "no rule is defined for it"
    #: What a step puts on the wire, in words (d parameters, P ranks), for tables.
    wire_summary: ClassVar[str] = ""
    #: ``bench update``'s goal: the step's cost at most this many ``torch.optim.SGD(fused=True)`` steps.
    update_goal: ClassVar[Optional[float]] = None
    #: The baseline the others are measured against.
    baseline: ClassVar[bool] = False
    #: Place in listings (``available()``, ``compare``'s default, benchmarks' tables), then the name.
    listing_order: ClassVar[int] = 1000
    #: What an inner optimizer (:meth:`use_inner`) does here: ``"gradient"``, it steps on the exchanged gradient;
    #: ``"local"``, it takes each rank's local step, which the algorithm then averages or pulls; None: refused.
    inner_role: ClassVar[Optional[str]] = None
    #: Why an algorithm without an ``inner_role`` takes no inner optimizer.
    inner_refusal: ClassVar[str] = "its update is its own"
    #: With an inner optimizer, the step as an equation beside the paper's (``inner(x, g)``: its step from ``x`` on ``g``).
    inner_rule: ClassVar[str] = ""
    #: Whether the exchange is an Allreduce of the gradient that may run in buckets during backward (``step_reduced``).
    overlaps_backward: ClassVar[bool] = False
    #: Whether :meth:`exchange` keeps state in the gradient's units (error feedback): a loss scale must be undone first.
    exchange_keeps_gradient: ClassVar[bool] = False
    #: Whether :meth:`_step` can check the gradient in its update's own pass (see :meth:`_checks_in_step`).
    fused_gradient_check: ClassVar[bool] = False
    #: The hyperparameter whose value is the steps between Allreduces of the parameters (``"period"``): the plan is
    #: then one such Allreduce every that many steps unless :meth:`_plan` says otherwise (:mod:`.plan`).
    periodic_allreduce: ClassVar[Optional[str]] = None
    #: The call that passes this rank's loss, for the message of an algorithm that needs one (lsgd): a front end
    #: driving the algorithm sets its instance's to its own call (DistributedOptimizer: ``opt.step(loss=loss)``).
    loss_call: str = "step(params, grad, loss=...)"
    #: Why ``islands=True`` is refused; None where every exchange goes through :attr:`workers` (docs/islands.md).
    islands_refusal: ClassVar[Optional[str]] = "its module does not say how its exchanges run between islands"
    #: Attribute names of arrays (or None) that make up the state.
    state_arrays: ClassVar[Tuple[str, ...]] = ()
    #: Attribute names of scalars (int, float, bool, str) that make up the state.
    state_scalars: ClassVar[Tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class that sets no ``training_defaults`` (nor a base below Algorithm) takes its schema's ``training`` values."""
        super().__init_subclass__(**kwargs)
        setter = next(c for c in cls.__mro__ if "training_defaults" in c.__dict__ and "_derived_training" not in c.__dict__)
        if setter is Algorithm:
            cls.training_defaults = {e.name: e.training for e in cls.schema if e.training is not None}
            cls._derived_training = True

    @classmethod
    def resize_skip(cls, saved: Mapping[str, Any], here: Mapping[str, Any], old_size: int, new_size: int) -> Tuple[str, ...]:
        """Hyperparameters that may differ when resuming ``saved`` as ``here`` on another world size."""
        return ()

    def __init__(self, topology: Topology, **hyperparameters: Any) -> None:
        """Check every keyword against :attr:`schema`, fill in its defaults and set each as an attribute.

        ``islands``: each group of the topology (a node) is one worker, data-parallel inside (docs/islands.md); a
        layout, not a hyperparameter (checkpoints record it beside the world size).

        A name the class computes (a property: Top-k's ``k``, LSGD's rule
        values) is left to it; every value is in :attr:`_values` for the class
        to hand on.  Cross-field checks belong after ``super().__init__``.
        """
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be an mpiopt.Topology, got {type(topology).__name__}")
        self.topology = topology
        self.islands = check_bool("islands", hyperparameters.pop("islands", False))
        self._given = {**hyperparameters, "islands": self.islands}  # to make it again on the survivors of a lost rank
        self._values = self.schema.complete(hyperparameters, what=self.name or type(self).__name__)
        for name, value in self._values.items():
            if not isinstance(getattr(type(self), name, None), property):
                setattr(self, name, value)
        self._check_islands()
        self._check_survival()
        if self.islands:  # the island's mean gradient is a sum the torch front end can make during backward
            self.overlaps_backward = True
        self.steps = 0
        self.last: Optional[StepRecord] = None
        self.num_params: Optional[int] = None
        self.dtype: Optional[np.dtype] = None
        self._xp = np  # the parameters' array module, set by setup()

    # -- what subclasses provide -----------------------------------------------------
    def hyperparameters(self) -> Dict[str, Any]:
        """The schema's entries as plain data (checked for agreement, saved in checkpoints): ``lr``, ``nan_policy`` and
        execution knobs aside; an inner optimizer's name stands for the built-in update's entries."""
        inner = self.inner
        names = [e.name for e in self.schema if e.name not in BASE and not e.execution and not (inner and e.name in LOCAL_SGD)]
        return {**{name: getattr(self, name) for name in names}, **(inner.hyperparameters() if inner else {})}

    def execution(self) -> Dict[str, Any]:
        """The execution knobs' values (the schema's ``execution`` entries, kept as attributes of the same name)."""
        return {name: getattr(self, name) for name in self.schema.knobs()}

    def _allocate(self, params: Any) -> None:
        """Allocate state for ``params`` (called once by :meth:`setup`)."""

    def _step(self, params: Any, grad: Any, loss: Optional[float]) -> None:
        """The update rule: change ``params`` in place."""
        raise NotImplementedError

    def _finish(self, params: Any) -> None:
        """Complete any communication still in flight."""

    # -- the protocol ------------------------------------------------------------------
    @property
    def ledger(self):
        """What this rank sent and received (shared by the topology's communicators)."""
        return self.topology.ledger

    def setup(self, params: Any) -> None:
        """Check the flat parameter buffer, check that all ranks agree, allocate state (a collective call).

        Raises
        ------
        SetupMismatchError
            On every rank, when ranks differ in their parameter buffers
            (count, dtype, or one that is not a flat float array), algorithm
            or hyperparameters.
        TypeError, ValueError, OtherRankError
            On every rank, when the buffer is unfit on every rank alike, or
            when the allocation failed on some rank: that rank raises its
            error, the others :class:`~mpiopt.comm.abort.OtherRankError`.
            The algorithm is then left not set up.
        """
        try:
            self._check_flat("params", params)
            buffer: Dict[str, Any] = {"num_params": int(params.size), "dtype": str(params.dtype)}
            unfit = None
        except (TypeError, ValueError) as err:
            buffer, unfit = {"params": f"{type(err).__name__}: {err}"}, err
        self.topology.world.agree(
            {
                "algorithm": self.name,
                **buffer,
                "lr": self.lr,
                "nan_policy": self.nan_policy,
                "islands": self.islands,
                "hyperparameters": self.hyperparameters(),
                # Knobs are not mathematics, but some shape the collectives (pipeline chunks): ranks agree on them too.
                "execution": self.execution(),
            },
            what=f"{self.name} set-up",
        )
        if unfit is not None:
            raise unfit  # the same on every rank: they agreed
        self._xp = array_module(params)  # subclasses allocate with it
        keep_apart(params)  # their state arrays are streamed beside it
        self._setup_islands(params)
        try:  # any failure must reach the other ranks
            self.topology.decide(lambda: self._allocate(params), f"{self.name} set-up", catch=(Exception,))
        except Exception:
            self._xp = np
            raise
        self.num_params = int(params.size)
        self.dtype = np.dtype(params.dtype)
        if self.topology.joining:  # started in a lost rank's place: the survivors' state, not ours
            self._take_state(params, None, 0)

    def _apply_step(self, params: Any, grad: Any, loss: Optional[float] = None, *, reduced: Optional[Any] = None,
                    island_mean: bool = False) -> StepRecord:
        """One step on this rank: the worker's gradient (:meth:`worker_gradient` unless ``island_mean``), the checks,
        :meth:`_step` and the accounting."""
        if self.num_params is None:
            raise RuntimeError(f"{type(self).__name__}.setup(params) must be called before stepping")
        self._check_flat("params", params)
        self._check_flat("grad", grad)
        before = self.ledger.snapshot()
        started = time.perf_counter()
        if not island_mean:
            grad = self.worker_gradient(grad, reduced)
        with self._rollback_point(params):
            skipped = False if self._checks_in_step() else not self._gradient_ok(grad)
            if not skipped:
                self._step(params, grad, loss)
                self.steps += 1
        self.last = record_step(self.ledger, before, started, self.steps, loss, skipped)
        return self.last

    def finish(self, params: Any) -> None:
        """Complete anything in flight (DaSGD's averaging, asynchronous exchanges)."""
        if self.num_params is not None:
            self._finish(params)

    def _check_flat(self, what: str, arr: Any) -> None:
        if not hasattr(arr, "ndim") or not hasattr(arr, "dtype"):
            raise TypeError(f"{what} must be a 1-D numpy or cupy array, got {type(arr).__name__}")
        if arr.ndim != 1 or not arr.flags.c_contiguous:
            raise ValueError(f"{what} must be a contiguous 1-D array, got shape {arr.shape}")
        if array_module(arr).dtype(arr.dtype).kind != "f":
            raise TypeError(f"{what} must be a floating-point array, got dtype {arr.dtype}")
        if self.num_params is not None and (arr.size != self.num_params or arr.dtype != self.dtype):
            raise ValueError(
                f"{what} has {arr.size} elements of {arr.dtype}; set-up was {self.num_params} of {self.dtype}"
            )


class SynchronousAlgorithm(Algorithm):
    """The protocol of algorithms whose ranks step together: ``setup``, ``step`` after every gradient, ``finish``."""

    protocol: ClassVar[str] = SYNCHRONOUS

    def step(self, params: Any, grad: Any, loss: Optional[float] = None, *, island_mean: bool = False) -> StepRecord:
        """Apply one step: read ``grad``, communicate as the algorithm says, update ``params`` in place.

        Parameters
        ----------
        params, grad : array
            Flat buffers of ``num_params`` elements (same dtype as at set-up).
        loss : float, optional
            This rank's training loss for the step (needed by LSGD's leader
            election; recorded by every algorithm).
        island_mean : bool
            With islands: ``grad`` is the island's mean already (:meth:`worker_gradient`), not this rank's own.

        Returns
        -------
        StepRecord
            Bytes and times of this step (also kept as :attr:`last`).
        """
        return self._apply_step(params, grad, loss, island_mean=island_mean)

    def step_reduced(self, params: Any, grad: Any, total: Any, loss: Optional[float] = None) -> StepRecord:
        """:meth:`step` on a sum of ``grad`` that the caller made over :attr:`reduced_over` (``total``, left unchanged).

        With islands, the island's sum (the torch front end's buckets during backward); ``sgd`` overrides it for the
        world's.  TypeError where :attr:`reduced_over` is None.
        """
        if not self.islands:
            raise TypeError(f"{self.name} takes no summed gradient (its exchange is not a sum of gradients); call step()")
        return self._apply_step(params, grad, loss, reduced=total)

    def exchange(self, params: Any, grad: Any, *, skip_non_finite: bool = False, reduced: Optional[Any] = None) -> Optional[Any]:
        """The exchange alone: the gradient every rank will apply, combined from every rank's ``grad`` (a collective call).

        For the gradient-exchanging algorithms (:attr:`inner_role` ``"gradient"``):
        ``sgd``'s mean, Top-k's and RegTop-k's aggregate (their error feedback
        advances).  The returned buffer is the algorithm's and is read by the
        next :meth:`step_exchanged`, which applies it (a caller may clip it
        in between).  None when every rank skips this step
        (``nan_policy="skip"``, or ``skip_non_finite``: a caller that decides
        about a non-finite gradient later, as the torch front end does
        where a GradScaler may yet call it an overflow, has every rank skip
        the exchange whatever the policy).  With islands the exchange is of
        the island's mean (of ``reduced``, the island's sum, where the caller
        made it).

        Raises
        ------
        TypeError
            For an algorithm that exchanges parameters after the local step.
        """
        if self.inner_role != "gradient":
            raise TypeError(
                f"{self.name} exchanges parameters after the local step, not gradients: there is no exchanged gradient "
                "before the step (clip the local gradient instead)"
            )
        if self.num_params is None:
            raise RuntimeError(f"{type(self).__name__}.setup(params) must be called before exchange()")
        self._check_flat("params", params)
        self._check_flat("grad", grad)
        grad = self.worker_gradient(grad, reduced)
        with self._rollback_point(params):
            if not self._gradient_ok(grad, skip=skip_non_finite):
                return None
            return self._exchange(params, grad)

    def step_exchanged(self, params: Any, exchanged: Optional[Any], loss: Optional[float] = None) -> StepRecord:
        """The local update with what :meth:`exchange` returned (perhaps changed since): the rest of a :meth:`step`."""
        before, started = self.ledger.snapshot(), time.perf_counter()
        if exchanged is not None:
            self._check_flat("exchanged", exchanged)
            self.local.apply(params, exchanged, self.lr)
            self.steps += 1
        self.last = record_step(self.ledger, before, started, self.steps, loss, exchanged is None)
        return self.last

    def _exchange(self, params: Any, grad: Any) -> Any:
        """:meth:`exchange`'s communication (the gradient-exchanging algorithms say how)."""
        raise NotImplementedError


class AsynchronousAlgorithm(Algorithm):
    """The protocol of algorithms with a server and workers: ``setup``, then ``run(params, worker_fn, ...)``.

    A worker's steps (and the server's updates) happen inside :meth:`run`,
    which drives them; there is no ``step`` to call.
    """

    protocol: ClassVar[str] = ASYNCHRONOUS
    evaluates: ClassVar[str] = "server"
    inner_refusal: ClassVar[str] = "a server applies its workers' gradients with its own update rule"
    resize_refusal: ClassVar[str] = "the server's and the leaders' state belong to one layout of server and workers"
    survival_refusal: ClassVar[Optional[str]] = (
        "its server does not drop a lost worker (one that does mixes in ServerSurvival): run it with on_failure='abort'"
    )
    islands_refusal: ClassVar[Optional[str]] = (
        "its workers trade whole vectors with a server rank at their own pace, while an island's ranks must step together"
    )

    @classmethod
    def server_messages(cls, d: int, itemsize: int = 4) -> Optional[Tuple[float, ...]]:
        """Bytes the server receives and sends per update, one after the other (the cost model's); None: not modelled."""
        return None

    def run(self, params: Any, worker_fn: Any, steps: Optional[int] = None, **options: Any) -> Any:
        """Train asynchronously on every rank of the world (a collective call)."""
        raise NotImplementedError

    def step(self, params: Any, grad: Any, loss: Optional[float] = None) -> NoReturn:
        """Not for an asynchronous algorithm: its steps happen inside :meth:`run`."""
        raise RuntimeError(
            f"{self.name} is asynchronous: its steps happen inside run(params, worker_fn, ...), which drives them; call run()"
        )
