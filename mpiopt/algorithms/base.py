"""The algorithm protocol: one small base class over flat parameter vectors.

Every algorithm works on one contiguous 1-D float array of parameters (numpy
on CPU, cupy on GPU; a torch model's parameters are views into such a buffer).
A subclass writes its math in :meth:`Algorithm._step` and lists its state;
the base class does the rest that every algorithm needs in the same way:

- validation of the flat buffers and the cross-rank agreement check in
  :meth:`setup` (parameter count, dtype, algorithm, hyperparameters);
- the NaN/Inf policy for gradients;
- per-step accounting (:class:`StepRecord`: bytes from the ledger, time split
  into communication, waiting and the algorithm's own computation);
- ``state_dict``/``load_state_dict`` from the declared state names, checked
  against the algorithm, its hyperparameters and the world size.

Errors on one rank
------------------
A check that fails on one rank only must not leave the others waiting in a
collective.  :meth:`Algorithm.setup` decides together: ranks that disagree on
their parameters or settings, or whose allocation failed, make every rank
raise (the failed ranks their own error, the others
:class:`~mpiopt.comm.abort.OtherRankError` naming them), and the algorithm
stays not set up; should the others be stuck in a collective of the set-up
that the failed rank left, it gives up after
:data:`~mpiopt.comm.topology.VOTE_SECONDS` and ends the job as below.  A non-finite gradient under ``nan_policy="raise"`` (and
LSGD's missing loss) is found in the middle of a step, when the other ranks
may already be inside the step's collectives: deciding it together would
cost a collective on every step, so it ends the job instead
(:meth:`~mpiopt.comm.Topology.raise_or_abort`: abort with the message and
where it happened; a ``FloatingPointError`` at a world size of one or with
``Topology(abort_on_error=False)``, whose caller then owns the other ranks).
:meth:`Algorithm.load_state_dict` and the buffer checks of
:meth:`Algorithm.step` communicate nothing and raise on the calling rank
(with the abort hooks, an uncaught error there still ends the job).

Example
-------
>>> alg = mpiopt.create("sgd", topology, lr=0.1, momentum=0.9)
>>> alg.setup(params)
>>> for batch in data:
...     loss, grad = compute(params, batch)
...     alg.step(params, grad, loss=loss)
>>> alg.finish(params)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple

import numpy as np

from ..arrays import array_module, empty_apart, keep_apart, to_numpy
from ..comm import Topology
from ..comm.ledger import Call
from ..kernels.update import all_finite
from .local import InnerUpdate, LocalSGD
from .schema import Hyperparameter, Schema, choice, positive

__all__ = [
    "Algorithm", "SynchronousAlgorithm", "AsynchronousAlgorithm", "StepRecord", "SYNCHRONOUS", "ASYNCHRONOUS",
    "EVALUATED_MODELS", "BASE", "due_steps",
]

#: The two protocols: ``step`` (every rank steps together) or ``run`` (a server and workers).
SYNCHRONOUS, ASYNCHRONOUS = "synchronous", "asynchronous"
#: What a training run may evaluate (``Algorithm.evaluates``), each with its words for the help.
EVALUATED_MODELS = {
    "identical": "every rank's model (identical on all ranks)",
    "average": "the average of the ranks' models",
    "server": "the server's model",
    "leader": "the global leader's model",
}
NAN_POLICIES = ("raise", "skip")
#: The entries every algorithm takes; each class adds its own and re-defaults ``lr`` (``BASE.with_defaults(lr=...)``).
BASE = Schema(
    Hyperparameter("lr", 0.1, positive(), "learning rate (schedulers may change it between steps)", per_group=True),
    Hyperparameter("nan_policy", "raise", choice(*NAN_POLICIES), "a non-finite gradient ends the job (raise) or skips the step on every rank (skip)"),
)

#: The entries every state_dict has.
_STATE_KEYS = frozenset({"algorithm", "world_size", "steps", "lr", "hyperparameters", "arrays", "scalars"})


class _Missing:
    """A setting one side does not have, shown as ``nothing`` (unquoted, unlike a value)."""

    def __repr__(self) -> str:
        return "nothing"


_MISSING = _Missing()


def _plain(value: Any) -> Any:
    """``value`` as JSON would carry it (lists for tuples, Python numbers for numpy's), to compare a saved state with."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else repr(v)))


def hyperparameter_lines(saved: Mapping[str, Any], here: Mapping[str, Any], *, skip: Any = ()) -> List[str]:
    """``"key: saved X, here Y"`` for each key (but ``skip``) whose values differ, compared as plain data.

    Where both values are tables (the inner optimizer's settings), one line per entry that differs,
    ``"key.entry: saved X, here Y"``, not the two whole tables.
    """
    return _differing_lines(_plain(dict(saved)), _plain(dict(here)), set(skip), "")


def _differing_lines(saved: Dict[str, Any], here: Dict[str, Any], skip: set, prefix: str) -> List[str]:
    lines = []
    for k in sorted((set(saved) | set(here)) - skip):
        a, b = saved.get(k, _MISSING), here.get(k, _MISSING)
        if isinstance(a, dict) and isinstance(b, dict):
            lines += _differing_lines(a, b, set(), f"{prefix}{k}.")
        elif a != b:
            lines.append(f"{prefix}{k}: saved {a!r}, here {b!r}")
    return lines


def due_steps(period: int, steps: range, offset: int = 0) -> int:
    """How many of ``steps`` are ``offset`` modulo ``period`` (the steps at which a periodic exchange happens)."""
    if not steps:
        return 0
    return (steps[-1] - offset) // int(period) - (steps[0] - 1 - offset) // int(period)



@dataclass
class StepRecord:
    """What one ``step`` cost this rank.

    Attributes
    ----------
    step : int
        Step counter after the step (1 for the first step).
    loss : float or None
        The loss passed to ``step``.
    bytes_sent, bytes_recv : int
        Payload exchanged with other ranks during the step (ledger convention).
    comm_seconds : float
        Time blocked in blocking MPI calls.
    wait_seconds : float
        Time blocked waiting for nonblocking operations to complete.
    algo_seconds : float
        The algorithm's own computation (update, compression): the step's wall
        time less the two above.
    skipped : bool
        The step was skipped because some rank's gradient was not finite.
    """

    step: int
    loss: Optional[float]
    bytes_sent: int
    bytes_recv: int
    comm_seconds: float
    wait_seconds: float
    algo_seconds: float
    skipped: bool = False

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


class Algorithm:
    """Base class of every distributed optimizer in :mod:`mpiopt.algorithms`.

    An algorithm derives from one of the two protocols,
    :class:`SynchronousAlgorithm` (``step``) or :class:`AsynchronousAlgorithm`
    (``run``).  Subclasses set :attr:`name`, validate their hyperparameters
    in ``__init__`` (calling ``super().__init__``), allocate state in
    :meth:`_allocate`, do the math in :meth:`_step` and list their state in
    :attr:`state_arrays` and :attr:`state_scalars`.  The class attributes
    below are everything the rest of the package asks about an algorithm.

    Parameters
    ----------
    topology : Topology
        The communicators to use.
    lr : float
        Learning rate (``eta``); schedulers may change :attr:`lr` between steps.
    nan_policy : {"raise", "skip"}
        What a non-finite gradient does.  ``raise`` (default): the job is
        aborted with a message naming the rank and the step (no traffic;
        see "Errors on one rank" in the module docstring), or a
        ``FloatingPointError`` on that rank at a world size of one or with
        ``Topology(abort_on_error=False)``.  ``skip``: every rank skips the
        step together (one extra 1-byte vote per step on the control
        communicator, so the decision is collective; not in the step's bytes).  Under ``raise``, algorithms whose update reads this
        rank's gradient (:attr:`fused_gradient_check`) check it in the
        update's own pass instead of a pass of its own first; the rank that
        raises has then changed its state, so a caller that catches the
        error must reload a checkpoint (see :meth:`_checks_in_step`).
    """

    name: ClassVar[str] = ""
    #: The constructor's keywords: defaults, checks, which are per parameter group or execution knobs (:mod:`.schema`).
    schema: ClassVar[Schema] = BASE
    #: :data:`SYNCHRONOUS` or :data:`ASYNCHRONOUS`: set by the protocol classes.
    protocol: ClassVar[str] = ""
    #: Which model a training run evaluates: one of :data:`EVALUATED_MODELS`.
    evaluates: ClassVar[str] = "identical"
    #: ``mpiopt train``'s starting hyperparameters, where the papers' were chosen for other models.
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
    #: The call that passes this rank's loss, for the message of an algorithm that needs one (lsgd): a front end
    #: driving the algorithm sets its instance's to its own call (DistributedOptimizer: ``opt.step(loss=loss)``).
    loss_call: str = "step(params, grad, loss=...)"
    #: Attribute names of arrays (or None) that make up the state.
    state_arrays: ClassVar[Tuple[str, ...]] = ()
    #: Attribute names of scalars (int, float, bool, str) that make up the state.
    state_scalars: ClassVar[Tuple[str, ...]] = ()

    # -- facts about the class ---------------------------------------------------------
    @classmethod
    def default_hyperparameters(cls) -> Dict[str, Any]:
        """The schema's defaults (the papers' values), ``nan_policy`` aside."""
        defaults = cls.schema.defaults()
        defaults.pop("nan_policy", None)
        return defaults

    @classmethod
    def communication(
        cls,
        d: int,
        ranks: int,
        hyper: Optional[Mapping[str, Any]] = None,
        *,
        groups: Optional[Sequence[int]] = None,
        steps: Optional[range] = None,
        itemsize: int = 4,
    ) -> List[Call]:
        """The collectives of steps ``steps`` (default: step 1) over ``ranks`` ranks: the source of every byte formula.

        Parameters
        ----------
        d : int
            Parameters.
        ranks : int
            World size P.
        hyper : mapping, optional
            Hyperparameters; the class's defaults fill in what is missing.
        groups : sequence of int, optional
            Sizes of the topology's groups (default: one group of all ranks).
        steps : range, optional
            Step numbers (1 for the first step); each call's ``count`` is
            how often it happens over them.
        itemsize : int
            Bytes per parameter (4: float32).

        Returns
        -------
        list of Call
            Empty at one rank (nothing crosses a wire).

        Raises
        ------
        ValueError
            Groups that do not add up to ``ranks``, or an algorithm that
            declares no plan (an asynchronous one).
        """
        groups = [ranks] if groups is None else [int(g) for g in groups]
        if sum(groups) != ranks or min(groups) < 1:
            raise ValueError(f"groups must be positive sizes adding up to ranks ({ranks}), got {groups!r}")
        steps = range(1, 2) if steps is None else steps
        h = {**cls.default_hyperparameters(), **(hyper or {})}
        if ranks == 1:
            return []
        return cls._plan(int(d), int(ranks), h, groups, steps, itemsize)

    @classmethod
    def _plan(cls, d: int, ranks: int, hyper: Mapping[str, Any], groups: List[int], steps: range, itemsize: int) -> List[Call]:
        """The calls of :meth:`communication` (at ``ranks`` >= 2, ``hyper`` complete)."""
        raise ValueError(f"{cls.name} declares no communication plan (its traffic depends on timing: {cls.protocol})")

    @classmethod
    def plan_cycle(cls, hyper: Mapping[str, Any]) -> int:
        """Steps after which the plan repeats (an average over them is the mean step)."""
        return 1

    @classmethod
    def resize_skip(cls, saved: Mapping[str, Any], here: Mapping[str, Any], old_size: int, new_size: int) -> Tuple[str, ...]:
        """Hyperparameters that may differ when resuming ``saved`` as ``here`` on another world size."""
        return ()

    def __init__(self, topology: Topology, *, lr: float, nan_policy: str = "raise") -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be an mpiopt.Topology, got {type(topology).__name__}")
        self.topology = topology
        self.lr = float(self.schema["lr"].validate(lr))
        self.nan_policy = self.schema["nan_policy"].validate(nan_policy)
        self.steps = 0
        self.last: Optional[StepRecord] = None
        self.num_params: Optional[int] = None
        self.dtype: Optional[np.dtype] = None
        self._xp = np  # the parameters' array module, set by setup()

    # -- what subclasses provide -----------------------------------------------------
    def hyperparameters(self) -> Dict[str, Any]:
        """The hyperparameters as plain data (checked for agreement, saved in checkpoints), execution knobs aside."""
        raise NotImplementedError

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

    def use_inner(self, step: Callable[[Any, Any], None], name: str, grad_buffer: Optional[Any] = None) -> None:
        """Take the local step with the caller's optimizer, ``step(params, grad)``, instead of the built-in SGD update.

        Call before :meth:`setup`.  Where it steps depends on
        :attr:`inner_role`; ``name`` (``"AdamW"``) joins the hyperparameters,
        so every rank and every checkpoint agrees on it; ``grad_buffer`` is
        where ``step`` reads the gradient (see :class:`~mpiopt.algorithms.local.InnerUpdate`).
        The built-in update's hyperparameters (momentum, weight decay, ...)
        and ``lr`` are then the caller's optimizer's business.

        Raises
        ------
        TypeError
            For an algorithm that takes no inner optimizer (the message says why).
        RuntimeError
            After :meth:`setup`.
        """
        if self.inner_role is None:
            raise TypeError(f"{self.name} takes no inner optimizer: {self.inner_refusal}")
        if self.num_params is not None:
            raise RuntimeError(f"{self.name}: use_inner() must come before setup()")
        self._use_inner(InnerUpdate(step, name, grad_buffer))

    def _use_inner(self, inner: InnerUpdate) -> None:
        """Put ``inner`` where the local step is (``self.local`` unless the class keeps it elsewhere)."""
        self.local = inner

    def use_groups(self, bounds: Sequence[Tuple[int, int]]) -> None:
        """Parameter groups for the built-in update: contiguous ``[start, stop)`` slices of the flat buffer (before setup).

        Each group then has its own ``lr``, ``momentum``, ``dampening``,
        ``nesterov`` and ``weight_decay`` (:meth:`set_group_values`; this
        algorithm's own until then), applied by the fused update one group
        after the other.  The pulls, averages and exchanges act on the whole
        buffer as before.

        Raises
        ------
        TypeError
            For an algorithm without the built-in SGD update (``signum``, the
            asynchronous ones) or one that has an inner optimizer.
        """
        local = self._local_update()
        if local is None:
            raise TypeError(
                f"{self.name} takes one set of hyperparameters for all parameters: per-group settings ride in the "
                "built-in SGD update, which it does not use"
            )
        if self.num_params is not None:
            raise RuntimeError(f"{self.name}: use_groups() must come before setup()")
        local.set_groups(bounds)

    def set_group_values(self, values: Sequence[Mapping[str, Any]]) -> None:
        """Each group's ``lr`` and local hyperparameters for the next steps (after :meth:`use_groups`)."""
        local = self._local_update()
        if local is None or local.groups is None:
            raise RuntimeError(f"{self.name}: set_group_values() needs use_groups() first")
        local.set_group_values([dict(v) for v in values])

    def _local_update(self) -> Optional[LocalSGD]:
        """The built-in update, where this algorithm has one (``self.local``; None otherwise)."""
        local = getattr(self, "local", None)
        return local if isinstance(local, LocalSGD) and self.protocol == SYNCHRONOUS else None

    @property
    def inner(self) -> Optional[InnerUpdate]:
        """The caller's optimizer as the local step, or None for the built-in update."""
        local = getattr(self, "local", None)
        return local if isinstance(local, InnerUpdate) else None

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
        try:  # any failure must reach the other ranks
            self.topology.decide(lambda: self._allocate(params), f"{self.name} set-up", catch=(Exception,))
        except Exception:
            self._xp = np
            raise
        self.num_params = int(params.size)
        self.dtype = np.dtype(params.dtype)

    def _apply_step(self, params: Any, grad: Any, loss: Optional[float] = None) -> StepRecord:
        """One step on this rank: the checks, :meth:`_step` and the accounting."""
        if self.num_params is None:
            raise RuntimeError(f"{type(self).__name__}.setup(params) must be called before stepping")
        self._check_flat("params", params)
        self._check_flat("grad", grad)
        before = self.ledger.snapshot()
        started = time.perf_counter()
        skipped = False if self._checks_in_step() else not self._gradient_ok(grad)
        if not skipped:
            self._step(params, grad, loss)
            self.steps += 1
        self.last = self._record(before, started, loss, skipped)
        return self.last

    def finish(self, params: Any) -> None:
        """Complete anything in flight (DaSGD's averaging, asynchronous exchanges)."""
        if self.num_params is not None:
            self._finish(params)

    def state_dict(self) -> Dict[str, Any]:
        """Arrays and scalars only (host numpy copies), never a communicator.

        Besides the state (``steps``, ``lr``, ``arrays``, ``scalars``) it
        records what :meth:`load_state_dict` checks: ``algorithm``,
        ``world_size`` and ``hyperparameters``.
        """
        arrays = {}
        for key in self.state_arrays:
            value = getattr(self, key)
            arrays[key] = None if value is None else to_numpy(value).copy()
        return {
            "algorithm": self.name,
            "world_size": self.topology.size,
            "steps": self.steps,
            "lr": self.lr,
            "hyperparameters": self.hyperparameters(),
            "arrays": arrays,
            "scalars": {key: getattr(self, key) for key in self.state_scalars},
        }

    def load_state_dict(self, state: Mapping[str, Any], *, override_hyperparameters: bool = False) -> None:
        """Restore what :meth:`state_dict` returned (after :meth:`setup`; this rank alone, no communication).

        Parameters
        ----------
        state : mapping
            A :meth:`state_dict` of the same algorithm at the same world size.
            ``steps`` and ``lr`` are restored with the arrays and scalars (a
            scheduler's ``lr`` is state; set :attr:`lr` afterwards to change it).
        override_hyperparameters : bool
            Accept a state saved with other hyperparameters: this instance's
            stay in force (its state arrays must still have the saved shapes).

        Raises
        ------
        ValueError
            When the state belongs to another algorithm, or when it lacks an
            entry, was saved at another world size, with other
            hyperparameters (unless overridden) or with other array shapes:
            one error naming every difference with the saved value and this
            instance's.  Nothing is changed then.
        """
        if self.num_params is None:
            raise RuntimeError(f"{type(self).__name__}.setup(params) must be called before load_state_dict()")
        if state.get("algorithm") != self.name:
            raise ValueError(f"state is for algorithm {state.get('algorithm')!r}, not {self.name!r}")
        missing = sorted(_STATE_KEYS - set(state))
        if not missing:
            missing = sorted((set(self.state_arrays) - set(state["arrays"])) | (set(self.state_scalars) - set(state["scalars"])))
        if missing:
            raise ValueError(f"state for {self.name!r} lacks {missing}")
        differences = self._state_differences(state, override_hyperparameters)
        if differences:
            hint = "" if override_hyperparameters else " (override_hyperparameters=True keeps this instance's hyperparameters)"
            raise ValueError(
                f"state does not fit this {self.name}{hint}; saved vs here:\n" + "\n".join(f"  {line}" for line in differences)
            )
        for key in self.state_arrays:
            self._load_array(key, state["arrays"][key])
        for key in self.state_scalars:
            setattr(self, key, state["scalars"][key])
        self.steps = int(state["steps"])
        self.lr = float(state["lr"])

    def _state_differences(self, state: Mapping[str, Any], override_hyperparameters: bool) -> List[str]:
        """``"key: saved X, here Y"`` for each world size, hyperparameter and array shape that differs."""
        lines = []
        if _plain(state["world_size"]) != self.topology.size:
            lines.append(f"world_size: saved {state['world_size']!r}, here {self.topology.size!r}")
        if not override_hyperparameters:
            # Execution knobs never refuse a resume (states saved before they were told apart carry them).
            lines += [f"hyperparameter {line}" for line in hyperparameter_lines(state["hyperparameters"], self.hyperparameters(), skip=self.schema.knobs())]
        for key in self.state_arrays:
            value, current = state["arrays"][key], getattr(self, key)
            if value is not None and current is not None and tuple(np.shape(value)) != tuple(current.shape):
                lines.append(f"array {key} shape: saved {tuple(np.shape(value))}, here {tuple(current.shape)}")
        return lines

    # -- helpers for subclasses ---------------------------------------------------------
    def _load_array(self, key: str, value: Optional[np.ndarray]) -> None:
        current = getattr(self, key)
        if value is None or current is None:
            # Arrays that appear lazily (a momentum buffer) take the parameters' backend and a placement of their own.
            placed = None
            if value is not None:
                source = self._xp.asarray(value)
                placed = empty_apart(source)
                placed[...] = source
            setattr(self, key, placed)
            return
        current[...] = array_module(current).asarray(value)

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

    def _gradient_ok(self, grad: Any, skip: bool = False) -> bool:
        """Whether to take this step: False on every rank when some rank's ``grad`` is not finite under ``nan_policy``
        ``"skip"`` (or ``skip``); under ``"raise"`` this rank's non-finite gradient ends the job."""
        ok = all_finite(grad)
        if self.nan_policy == "raise" and not skip:
            if not ok:
                self._non_finite_gradient()
            return True
        return not self.topology.any(not ok)

    def name_non_finite_ranks(self, own_finite: bool) -> None:
        """End the job naming the ranks whose own gradient was not finite (``own_finite`` False), if any (a collective call).

        For a non-finite value every rank learnt of together: every rank
        raises the same error, naming the first rank at fault; returns when
        no rank was at fault.
        """
        def own_check() -> None:
            if not own_finite:
                raise self._non_finite_error()

        try:
            self.topology.decide(
                own_check, "gradient check", catch=(FloatingPointError,),
                error=lambda failures, own: own or FloatingPointError(failures[0].message),
            )
        except FloatingPointError as error:
            self.topology.raise_or_abort(error)

    def _checks_in_step(self) -> bool:
        """Whether this step's update checks the gradient in its own pass, instead of :meth:`step` in a pass before.

        Under ``nan_policy="raise"`` only (``skip`` must decide before anything
        changes, on every rank together), for algorithms that declare
        :attr:`fused_gradient_check` (their update reads this rank's own
        gradient, so the rank that finds a non-finite value is the one that
        had it; or, ``sgd``, a sum every rank holds alike, so every rank
        finds it and they name the rank at fault together).  Their ``_step`` calls :meth:`_non_finite_gradient` when the
        update reports one, before the step starts any communication (DaSGD
        may first have completed an averaging every rank started earlier).
        That rank has then applied the failing step: its parameters and
        state are not to be used further.  With more ranks and the default
        abort the job ends; where the error is raised instead (one rank, or
        ``abort_on_error=False``) a caller that catches it must reload a
        checkpoint, or use ``nan_policy="skip"`` to go on without one.
        """
        return self.fused_gradient_check and self.nan_policy == "raise"

    def _non_finite_gradient(self) -> NoReturn:
        """End the job (or raise) for this rank's non-finite gradient under ``nan_policy="raise"``."""
        self.topology.raise_or_abort(self._non_finite_error())

    def _non_finite_error(self) -> FloatingPointError:
        """The error naming this rank's non-finite gradient at the step being taken."""
        return FloatingPointError(
            f"{self.name}: non-finite gradient on rank {self.topology.rank} at step {self.steps + 1} "
            "(nan_policy='raise'; use nan_policy='skip' to skip such steps on every rank)"
        )

    def _record(self, before: Any, started: float, loss: Optional[float], skipped: bool) -> StepRecord:
        elapsed = time.perf_counter() - started
        delta = self.ledger.since(before)
        comm, wait = delta.blocked_seconds()
        return StepRecord(
            step=self.steps,
            loss=None if loss is None else float(loss),
            bytes_sent=delta.bytes_sent,
            bytes_recv=delta.bytes_recv,
            comm_seconds=comm,
            wait_seconds=wait,
            algo_seconds=max(0.0, elapsed - comm - wait),
            skipped=skipped,
        )


class SynchronousAlgorithm(Algorithm):
    """The protocol of algorithms whose ranks step together: ``setup``, ``step`` after every gradient, ``finish``."""

    protocol: ClassVar[str] = SYNCHRONOUS

    def step(self, params: Any, grad: Any, loss: Optional[float] = None) -> StepRecord:
        """Apply one step: read ``grad``, communicate as the algorithm says, update ``params`` in place.

        Parameters
        ----------
        params, grad : array
            Flat buffers of ``num_params`` elements (same dtype as at set-up).
        loss : float, optional
            This rank's training loss for the step (needed by LSGD's leader
            election; recorded by every algorithm).

        Returns
        -------
        StepRecord
            Bytes and times of this step (also kept as :attr:`last`).
        """
        return self._apply_step(params, grad, loss)

    def exchange(self, params: Any, grad: Any, *, skip_non_finite: bool = False) -> Optional[Any]:
        """The exchange alone: the gradient every rank will apply, combined from every rank's ``grad`` (a collective call).

        For the gradient-exchanging algorithms (:attr:`inner_role` ``"gradient"``):
        ``sgd``'s mean, Top-k's and RegTop-k's aggregate (their error feedback
        advances).  The returned buffer is the algorithm's and is read by the
        next :meth:`step_exchanged`, which applies it (a caller may clip it
        in between).  None when every rank skips this step
        (``nan_policy="skip"``, or ``skip_non_finite``: a caller that decides
        about a non-finite gradient later, as the torch front end does
        where a GradScaler may yet call it an overflow, has every rank skip
        the exchange whatever the policy).

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
        self.last = self._record(before, started, loss, exchanged is None)
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
