"""Checkpoints of a synchronous training run: what is saved, what a resume checks and restores, and stop signals.

A checkpoint (:mod:`mpiopt.checkpoint`) after step ``s`` holds rank 0's
model, and per rank: its flat parameters, the algorithm's state (DaSGD's
snapshot and in-flight sum included: nothing is completed early, so the
trajectory is the one without checkpoints), its model buffers (BatchNorm
statistics differ between ranks) and its torch RNG state (dropout).  The data
order and augmentation need no state: the sampler and the augmentation
generator are functions of the step.  A resumed run continues with step
``s + 1`` and reaches bitwise the same state as a run that never stopped.

Signals: SIGTERM or SIGUSR1 arriving at any rank sets a flag; at every step
boundary the ranks take a one-byte MAX vote on a communicator of their own
(its bytes are not the algorithm's), and on a positive vote every rank saves
a checkpoint and :class:`Interrupted` is raised: ``mpiopt train`` exits with
:data:`EXIT_INTERRUPTED` (75, ``EX_TEMPFAIL``), which the Slurm templates
requeue with ``--resume auto``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import asdict
from typing import Any, Dict, Optional

import numpy as np
import torch

from ..checkpoint import CheckpointError, checkpoint_path, find_latest, load_checkpoint, save_checkpoint
from ..comm import MAX, Ledger, Topology
from ..metrics import versions
from ..torch import DistributedOptimizer
from .config import TrainConfig, UsageError

__all__ = ["Checkpointer", "Interrupted", "EXIT_INTERRUPTED", "STOP_SIGNALS"]

#: Exit code of ``mpiopt train`` stopped by a signal after writing a checkpoint (``EX_TEMPFAIL``).
EXIT_INTERRUPTED = 75
#: Signals that make a run checkpoint and stop at the next step boundary.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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


class Checkpointer:
    """Saves and restores one synchronous run's checkpoints; catches stop signals (collective calls).

    Parameters
    ----------
    config : TrainConfig
        ``checkpoint_every``, ``checkpoint_dir``, ``keep_checkpoints``,
        ``resume`` and ``override_hyperparameters`` are used.
    algorithm : str
        The run's algorithm.
    topology : Topology
        Communicators; checkpoints are collective over ``topology.world``.
    model : torch.nn.Module
        The model, whose parameters ``opt`` holds.
    opt : DistributedOptimizer
        The optimizer (set up).
    out_dir : str
        The run's folder: checkpoints go to ``OUT/checkpoints`` unless
        ``config.checkpoint_dir`` says otherwise.
    batches_per_epoch : int
        For the ``epoch`` attribute.
    """

    def __init__(
        self,
        config: TrainConfig,
        algorithm: str,
        topology: Topology,
        model: torch.nn.Module,
        opt: DistributedOptimizer,
        out_dir: str,
        batches_per_epoch: int,
    ) -> None:
        self.config, self.algorithm, self.topology = config, algorithm, topology
        self.model, self.opt, self.batches_per_epoch = model, opt, batches_per_epoch
        self.directory = config.checkpoint_dir or os.path.join(out_dir, "checkpoints")
        self.enabled = bool(config.checkpoint_every or config.resume)
        self._received: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self._votes = None
        if self.enabled:
            world = topology.world
            # Votes on a communicator of their own, with a ledger of their own: the algorithm's byte counts stay its own.
            self._votes = world.Split(0, world.rank, "signals")
            self._votes.ledger = Ledger()
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._received = signum  # only a flag: the ranks act on it together at the next step boundary

    def close(self) -> None:
        """Restore the previous signal handlers and free the vote communicator."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self._votes is not None:
            self._votes.Free()
            self._votes = None

    # -- saving ---------------------------------------------------------------------------------
    def attrs(self, step: int) -> Dict[str, Any]:
        """The root attributes of the checkpoint after ``step`` (:func:`save_checkpoint` adds ``world_size``)."""
        return {
            "step": step,
            "epoch": step / self.batches_per_epoch,
            "algorithm": self.algorithm,
            "hyperparameters": self.opt.algorithm.hyperparameters(),
            "num_groups": self.topology.num_groups,
            "group_size": self.topology.group.size,
            "model_signature": model_signature(self.model),
            "config": asdict(self.config),
            "versions": versions(),
        }

    def save(self, step: int) -> str:
        """Write the checkpoint after ``step`` (collective); returns its path."""
        model = {name: _numpy(t) for name, t in self.model.state_dict().items()} if self.topology.rank == 0 else None
        rank_state = {
            "params": _numpy(self.opt._flat_params),
            "algorithm": self.opt.algorithm.state_dict(),
            "buffers": {name: _numpy(b) for name, b in self.model.named_buffers()},
            "rng": {"torch": torch.get_rng_state().numpy().copy()},
            "step": step,
        }
        path = checkpoint_path(self.directory, step)
        if self.topology.rank == 0:
            os.makedirs(self.directory, exist_ok=True)
        return save_checkpoint(path, self.topology.world, model=model, rank_state=rank_state, attrs=self.attrs(step),
                               keep=self.config.keep_checkpoints)

    def after_step(self, step: int, last: bool) -> Optional[str]:
        """At the boundary after ``step``: checkpoint when due, then stop if any rank received a signal.

        Raises
        ------
        Interrupted
            On every rank, after the checkpoint, when a stop signal arrived at any rank.
        """
        if not self.enabled:
            return None
        vote = np.array([self._received or 0], dtype=np.uint8)
        self._votes.Allreduce(vote, op=MAX)
        every = self.config.checkpoint_every
        path = None
        if vote[0] or last or (every and step % every == 0):
            path = self.save(step)
        if vote[0]:
            raise Interrupted(step, path, int(vote[0]))
        return path

    # -- resuming -------------------------------------------------------------------------------
    def resume_path(self) -> Optional[str]:
        """The checkpoint to resume from: ``config.resume``, or for ``auto`` the newest valid one (None: none)."""
        if self.config.resume != "auto":
            return self.config.resume
        path = find_latest(self.directory) if self.topology.rank == 0 else None  # warns about invalid files once
        return self.topology.world.bcast_obj(path, root=0)

    def resume(self) -> int:
        """Restore the state of ``config.resume`` (collective); the step it was saved after (0: nothing to resume).

        Raises
        ------
        UsageError
            On every rank alike: an unreadable file, or a checkpoint of
            another algorithm, world size, model, hyperparameters (unless
            ``override_hyperparameters``), or ranks at different steps; the
            message names the mismatch and both values.
        """
        if not self.config.resume:
            return 0
        path = self.resume_path()
        world = self.topology.world
        if path is None:
            if world.rank == 0:
                print(f"--resume auto: no checkpoint in {self.directory}; starting from step 0", flush=True)
            return 0
        try:
            ckpt = load_checkpoint(path, world)
        except CheckpointError as err:
            raise UsageError(f"--resume: {err}") from None
        saved, here = ckpt.attrs, self.attrs(0)  # another world size: load_checkpoint refused it, naming both
        checks = [("algorithm", "algorithm"), ("model signature", "model_signature")]
        if not self.config.override_hyperparameters:
            checks.append(("hyperparameters", "hyperparameters"))
        for what, key in checks:
            if saved.get(key) != here[key]:
                hint = " (--override-hyperparameters keeps this run's)" if key == "hyperparameters" else ""
                raise UsageError(f"--resume {path}: the checkpoint's {what} is {saved.get(key)!r}, this run's {here[key]!r}{hint}")
        steps = world.allgather_obj(int(ckpt.rank_state["step"]))
        if len(set(steps)) > 1 or steps[0] != int(saved["step"]):
            raise UsageError(f"--resume {path}: the ranks' states are at different steps {steps}; the file says step {saved['step']}")
        state = ckpt.rank_state
        try:
            self.opt.algorithm.load_state_dict(state["algorithm"], override_hyperparameters=self.config.override_hyperparameters)
        except ValueError as err:  # every rank holds the same kind of state: it fails alike
            raise UsageError(f"--resume {path}: {err}") from None
        with torch.no_grad():
            self.opt._flat_params.copy_(torch.from_numpy(state["params"]))
            for name, buffer in self.model.named_buffers():
                buffer.copy_(torch.from_numpy(state["buffers"][name]))
        torch.set_rng_state(torch.from_numpy(state["rng"]["torch"]))
        if world.rank == 0:
            print(f"resuming from {path} after step {steps[0]}", flush=True)
        return steps[0]
