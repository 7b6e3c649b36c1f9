"""Checkpoints of a training run: what each rank saves, restoring it, and stop signals.

A checkpoint after step ``s`` holds what a resumed run needs to continue
bitwise from step ``s + 1`` (per rank: parameters, algorithm and inner
optimizer state, model buffers, RNG; the metrics' running totals).  Whether a
checkpoint may be resumed, and which state each rank takes, is
:mod:`.resume`'s decision.  A stop signal makes every rank save and stop at
the next step boundary (exit 75, requeued with ``--resume auto``).  The
details and why: docs/training-internals.md.
"""

from __future__ import annotations

import os
import signal
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch

from ..checkpoint import CheckpointError, checkpoint_path, find_latest, load_checkpoint, save_checkpoint
from ..comm import OtherRankError, Topology
from ..metrics import versions
from ..torch import DistributedOptimizer
from .config import TrainConfig, UsageError
from .optimizers import OptimizerSettings, inner_state, load_inner_state
from .resume import rank_state, workers_of

__all__ = ["CheckpointPlan", "Checkpointer", "Interrupted", "EXIT_INTERRUPTED", "STOP_SIGNALS", "COUNTERS"]

#: Exit code of ``mpiopt train`` stopped by a signal after writing a checkpoint (``EX_TEMPFAIL``).
EXIT_INTERRUPTED = 75
#: Signals that make a run checkpoint and stop at the next step boundary.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: Running totals of the metrics saved as root attributes (rank 0's) and restored by a resume.
COUNTERS = ("wall_seconds", "bytes_sent_total", "island_bytes_sent_total")


class Interrupted(Exception):
    """A stop signal arrived: every rank saved the checkpoint ``path`` after ``step`` and stopped."""

    def __init__(self, step: int, path: str, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {path}")
        self.step, self.path, self.signum = step, path, signum


def model_signature(model: torch.nn.Module) -> Dict[str, list]:
    """``state_dict`` names, shapes and dtypes, the check that a checkpoint belongs to this model."""
    return {name: [list(t.shape), str(t.dtype)] for name, t in model.state_dict().items()}


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host copy (the checkpoint must not change when training continues)."""
    return tensor.detach().cpu().numpy().copy()


def _rng_state(device: torch.device) -> Dict[str, np.ndarray]:
    """The generators a rank draws from: torch's, and on a GPU the device's too."""
    state = {"torch": torch.get_rng_state().numpy().copy()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).numpy().copy()
    return state


def _scaler_state(scaler: torch.amp.GradScaler) -> Dict[str, np.ndarray]:
    """``--precision fp16``'s scaler (its scale and growth count: a resume continues them) as numbers."""
    return {key: np.array(value) for key, value in scaler.state_dict().items()}


@dataclass(frozen=True)
class CheckpointPlan:
    """What a run's checkpoints do (``--checkpoint-every``, ``--checkpoint-dir``, ``--keep-checkpoints``, ``--resume``...).

    ``settings`` is the whole configuration, saved with each checkpoint for
    the record; ``optimizer`` is what a resume compares of ``--optimizer``.
    """

    every: Optional[int]
    directory: str
    keep: int
    resume: Optional[str]
    override_hyperparameters: bool
    settings: Mapping[str, Any]
    optimizer: OptimizerSettings

    @classmethod
    def of(cls, config: TrainConfig, out_dir: str) -> "CheckpointPlan":
        """``config``'s checkpoints for the run writing to ``out_dir`` (``OUT/checkpoints`` unless ``--checkpoint-dir``)."""
        return cls(config.checkpoint_every, config.checkpoint_dir or os.path.join(out_dir, "checkpoints"), config.keep_checkpoints,
                   config.resume, config.override_hyperparameters, asdict(config), OptimizerSettings.of(config))


class Checkpointer:
    """Saves and restores one run's checkpoints as ``plan`` says; catches stop signals (collective calls).

    ``opt`` holds ``model``'s parameters (set up); ``batches_per_epoch`` gives
    the ``epoch`` attribute.  Checkpoints are collective over ``topology.world``.
    """

    def __init__(self, plan: CheckpointPlan, algorithm: str, topology: Topology, model: torch.nn.Module, opt: DistributedOptimizer,
                 batches_per_epoch: int, scaler: Optional[torch.amp.GradScaler] = None) -> None:
        self.plan, self.algorithm, self.topology = plan, algorithm, topology
        self.model, self.opt, self.batches_per_epoch, self.scaler = model, opt, batches_per_epoch, scaler
        self.device = next(model.parameters()).device
        self.directory = plan.directory
        self.enabled = bool(plan.every or plan.resume)
        #: The metrics' running totals (:data:`COUNTERS`) the resumed run starts from; zeros without a resume.
        self.counters: Dict[str, float] = {"wall_seconds": 0.0, "bytes_sent_total": 0, "island_bytes_sent_total": 0}
        #: Whether :meth:`resume` restored a checkpoint (one after step 0 too: a respawn's hand-over after a loss in step 1).
        self.resumed = False
        self._received: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self._vote = np.zeros(1, dtype=np.uint8)  # the stop-signal vote, on the topology's control communicator
        if self.enabled:
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._received = signum  # only a flag: the ranks act on it together at the next step boundary

    def close(self) -> None:
        """Restore the previous signal handlers."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    # -- saving ---------------------------------------------------------------------------------
    def attrs(self, step: int, counters: Optional[Mapping[str, float]] = None) -> Dict[str, Any]:
        """The root attributes of the checkpoint after ``step``, with the metrics' ``counters`` (:data:`COUNTERS`)."""
        return {
            **{name: counters[name] for name in COUNTERS if counters is not None},
            "step": step,
            "epoch": step / self.batches_per_epoch,
            "algorithm": self.algorithm,
            # The learning rate too: a resume with another --lr is a change of hyperparameters like any other; so are
            # the inner optimizer, its keywords and the settings around it.
            "hyperparameters": {"lr": self._base_lr(), **self.opt.algorithm.hyperparameters(), **self.plan.optimizer.record()},
            "num_groups": self.topology.num_groups,
            "group_size": self.topology.group.size,
            # Whom the algorithm's state is kept per (islands: one worker per group): a resume moves states between them.
            **{key: value for key, value in self.opt.algorithm.worker_layout().items() if key != "worker"},
            "model_signature": model_signature(self.model),
            "precision": self.plan.settings.get("precision", "fp32"),
            "config": dict(self.plan.settings),
            "versions": versions(),
        }

    def _base_lr(self) -> float:
        """The run's learning rate before any schedule (a schedule's rate at the step is state, not a setting)."""
        group = self.opt.param_groups[0]
        return float(group.get("initial_lr", group["lr"]))

    def save(self, step: int, counters: Optional[Mapping[str, float]] = None) -> str:
        """Write the checkpoint after ``step`` (collective); returns its path.  ``counters``: see :meth:`attrs`."""
        model = {name: _numpy(t) for name, t in self.model.state_dict().items()} if self.topology.rank == 0 else None
        rank_state = {
            "params": _numpy(self.opt.flat_params),
            "algorithm": self.opt.algorithm.state_dict(),
            **({"inner": inner_state(self.opt.inner)} if self.opt.inner is not None else {}),
            "buffers": {name: _numpy(b) for name, b in self.model.named_buffers()},
            "rng": _rng_state(self.device),
            **({"scaler": _scaler_state(self.scaler)} if self.scaler is not None else {}),
            "step": step,
        }
        path = checkpoint_path(self.directory, step)
        return save_checkpoint(path, self.topology.world, model=model, rank_state=rank_state, attrs=self.attrs(step, counters),
                               keep=self.plan.keep)

    def after_step(self, step: int, last: bool, counters: Optional[Mapping[str, float]] = None) -> Optional[str]:
        """At the boundary after ``step``: checkpoint when due (with ``counters``), then stop if any rank received a signal.

        Raises :class:`Interrupted` on every rank, after the checkpoint, when a stop signal arrived at any rank.
        """
        if not self.enabled:
            return None
        vote = self._vote
        vote[0] = self._received or 0
        self.topology.control.vote(vote)  # the highest signal number any rank received
        every = self.plan.every
        path = None
        if vote[0] or last or (every and step % every == 0):
            path = self.save(step, counters)
        if vote[0]:
            raise Interrupted(step, path, int(vote[0]))
        return path

    # -- resuming -------------------------------------------------------------------------------
    def resume_path(self) -> Optional[str]:
        """The checkpoint to resume from: ``plan.resume``, or for ``auto`` the newest valid one (None: none)."""
        if self.plan.resume != "auto":
            return self.plan.resume
        path = find_latest(self.directory) if self.topology.rank == 0 else None  # warns about invalid files once
        return self.topology.world.bcast_obj(path, root=0)

    def resume(self) -> int:
        """Restore the state of ``plan.resume`` (collective); the step it was saved after (0: nothing to resume).

        Also sets :attr:`counters`.  A refusal (:func:`.resume.rank_state`) is a
        :class:`UsageError` on every rank alike, after the signal handlers are restored.
        """
        if not self.plan.resume:
            return 0
        try:
            return self._resume()
        except BaseException:
            self.close()
            raise

    def _resume(self) -> int:
        path = self.resume_path()
        world = self.topology.world
        if path is None:
            if world.rank == 0:
                print(f"--resume auto: no checkpoint in {self.directory}; starting from step 0", flush=True)
            return 0
        layout = self.opt.algorithm.worker_layout()
        try:  # a checkpoint of other workers (islands on or off, of another size) is read whole, as one of another size
            ckpt = load_checkpoint(path, world, allow_world_size_change=True, read_all=lambda attrs: workers_of(attrs) != workers_of(layout))
        except CheckpointError as err:
            raise UsageError(f"--resume: {err}") from None
        override = self.plan.override_hyperparameters
        state = rank_state(ckpt, self.attrs(0), self.algorithm, world, override_hyperparameters=override,
                           hyperparameters=self.opt.algorithm.hyperparameters(), layout=layout)
        load = self.opt.algorithm.load_state_dict
        try:  # a state may fail on some ranks only (the asynchronous server's, a leader's): decide together
            self.topology.decide(lambda: load(state["algorithm"], override_hyperparameters=override), "resume", catch=(ValueError,))
        except (ValueError, OtherRankError) as err:
            raise UsageError(f"--resume {path}: {err}") from None
        load_inner_state(self.opt.inner, state.get("inner"))
        with torch.no_grad():
            self.opt.flat_params.copy_(torch.from_numpy(state["params"]))
            for name, buffer in self.model.named_buffers():
                buffer.copy_(torch.from_numpy(state["buffers"][name]))
        if state["rng"] is not None:
            torch.set_rng_state(torch.from_numpy(state["rng"]["torch"]))
            if self.device.type == "cuda" and "cuda" in state["rng"]:  # dropout on the GPU draws from the device's generator
                torch.cuda.set_rng_state(torch.from_numpy(state["rng"]["cuda"]), self.device)
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict({key: np.asarray(value).item() for key, value in state["scaler"].items()})
        step = int(ckpt.attrs["step"])
        self.counters = {name: ckpt.attrs.get(name, self.counters[name]) for name in COUNTERS}
        self.resumed = True
        if world.rank == 0:
            print(f"resuming from {path} after step {step}", flush=True)
        return step
