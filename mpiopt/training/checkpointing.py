"""Checkpoints of a training run: what is saved, what a resume checks and restores, and stop signals.

A checkpoint (:mod:`mpiopt.checkpoint`) after step ``s`` holds rank 0's
model, and per rank: its flat parameters, the algorithm's state (DaSGD's
snapshot and in-flight sum included: nothing is completed early, so the
trajectory is the one without checkpoints), its model buffers (BatchNorm
statistics differ between ranks) and its torch RNG state (dropout).  The data
order and augmentation need no state: the sampler and the augmentation
generator are functions of the step.  A resumed run continues with step
``s + 1`` and reaches bitwise the same state as a run that never stopped.
The root attributes also carry the metrics' running totals
(:data:`COUNTERS`: training seconds, bytes sent), so a resumed run's
``wall_seconds`` and ``bytes_sent_total`` continue instead of restarting at 0.

The asynchronous algorithms (``async_msgd``, ``async_lsgd``) run in segments
(:func:`mpiopt.training.loop.train`): one ``run`` until the next multiple of
``checkpoint_every`` of each worker's steps, which returns quiescent, so a
segment boundary is their step boundary: ``step`` counts each worker's steps,
and the algorithm's state holds the rest (on rank 0 the server's: version
counter, staleness histogram, LSGD's book with the leaders and the workers'
latest uploads).  A resumed run starts from exactly the saved parameters and
continues the version counter and each worker's step numbers (hence its data
order); the arrivals' order is timing's, so it is bitwise the uninterrupted
run only at world size 1, where the runtime is deterministic.

Another world size: a checkpoint written by ``P`` ranks resumes on ``M``
where the algorithm has a rule (:mod:`mpiopt.algorithms.resize`; the
asynchronous algorithms have none).  New rank ``r`` takes old rank ``r %
P``'s parameters and model buffers; the algorithm state moves by the rule
(copied, redistributed or reset, named in a warning); a rank that existed
before keeps its torch RNG state, a new one keeps its fresh seed.  The step
counter continues, and the data order with it: step ``s + 1`` of the
``M``-rank sampler, whose epochs are shorter or longer than the ``P``-rank
one's, so samples are not tracked across the change.

Signals: SIGTERM or SIGUSR1 arriving at any rank sets a flag; at every step
(or segment) boundary the ranks take a one-byte vote on a communicator of their own
(its bytes are not the algorithm's), and on a positive vote every rank saves
a checkpoint and :class:`Interrupted` is raised: ``mpiopt train`` exits with
:data:`EXIT_INTERRUPTED` (75, ``EX_TEMPFAIL``), which the Slurm templates
requeue with ``--resume auto``.
"""

from __future__ import annotations

import os
import signal
import warnings
from dataclasses import asdict
from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch

from ..algorithms.resize import hyperparameter_differences, resize_states, source_rank
from ..checkpoint import Checkpoint, CheckpointError, checkpoint_path, find_latest, load_checkpoint, save_checkpoint
from ..comm import OtherRankError, Topology
from ..metrics import versions
from ..torch import DistributedOptimizer
from .config import TrainConfig, UsageError
from .optimizers import inner_state, load_inner_state, optimizer_keywords

__all__ = ["Checkpointer", "Interrupted", "EXIT_INTERRUPTED", "STOP_SIGNALS", "COUNTERS"]

#: Exit code of ``mpiopt train`` stopped by a signal after writing a checkpoint (``EX_TEMPFAIL``).
EXIT_INTERRUPTED = 75
#: Signals that make a run checkpoint and stop at the next step boundary.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: Running totals of the metrics saved as root attributes (rank 0's) and restored by a resume.
COUNTERS = ("wall_seconds", "bytes_sent_total")


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
    """Saves and restores one run's checkpoints; catches stop signals (collective calls).

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
        #: The metrics' running totals (:data:`COUNTERS`) the resumed run starts from; zeros without a resume.
        self.counters: Dict[str, float] = {"wall_seconds": 0.0, "bytes_sent_total": 0}
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
        """The root attributes of the checkpoint after ``step`` (:func:`save_checkpoint` adds ``world_size``).

        ``counters``: the metrics' running totals (:data:`COUNTERS`) at that step.
        """
        return {
            **{name: counters[name] for name in COUNTERS if counters is not None},
            "step": step,
            "epoch": step / self.batches_per_epoch,
            "algorithm": self.algorithm,
            # The learning rate too: a resume with another --lr is a change of hyperparameters like any other; so are
            # the inner optimizer, its keywords and the settings around it.
            "hyperparameters": {"lr": self._base_lr(), **self.opt.algorithm.hyperparameters(), **self._optimizer_settings()},
            "num_groups": self.topology.num_groups,
            "group_size": self.topology.group.size,
            "model_signature": model_signature(self.model),
            "config": asdict(self.config),
            "versions": versions(),
        }

    def _base_lr(self) -> float:
        """The run's learning rate before any schedule (a schedule's rate at the step is state, not a setting)."""
        group = self.opt.param_groups[0]
        return float(group.get("initial_lr", group["lr"]))

    def _optimizer_settings(self) -> Dict[str, Any]:
        config = self.config
        if not (config.optimizer or config.clip_grad_norm or config.warmup_steps):
            return {}  # checkpoints of runs without them compare as before
        return {"optimizer": {
            "name": config.optimizer, "keywords": optimizer_keywords(config),
            "lr": config.lr if config.optimizer else None, "no_decay_on": config.no_decay_on,
            "clip_grad_norm": config.clip_grad_norm, "warmup_steps": config.warmup_steps,
        }}

    def save(self, step: int, counters: Optional[Mapping[str, float]] = None) -> str:
        """Write the checkpoint after ``step`` (collective); returns its path.  ``counters``: see :meth:`attrs`."""
        model = {name: _numpy(t) for name, t in self.model.state_dict().items()} if self.topology.rank == 0 else None
        rank_state = {
            "params": _numpy(self.opt.flat_params),
            "algorithm": self.opt.algorithm.state_dict(),
            **({"inner": inner_state(self.opt.inner)} if self.opt.inner is not None else {}),
            "buffers": {name: _numpy(b) for name, b in self.model.named_buffers()},
            "rng": {"torch": torch.get_rng_state().numpy().copy()},
            "step": step,
        }
        path = checkpoint_path(self.directory, step)
        return save_checkpoint(path, self.topology.world, model=model, rank_state=rank_state, attrs=self.attrs(step, counters),
                               keep=self.config.keep_checkpoints)

    def after_step(self, step: int, last: bool, counters: Optional[Mapping[str, float]] = None) -> Optional[str]:
        """At the boundary after ``step``: checkpoint when due, then stop if any rank received a signal.

        ``counters``: the metrics' running totals to save with it (:data:`COUNTERS`).

        Raises
        ------
        Interrupted
            On every rank, after the checkpoint, when a stop signal arrived at any rank.
        """
        if not self.enabled:
            return None
        vote = self._vote
        vote[0] = self._received or 0
        self.topology.control.vote(vote)  # the highest signal number any rank received
        every = self.config.checkpoint_every
        path = None
        if vote[0] or last or (every and step % every == 0):
            path = self.save(step, counters)
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

        Also sets :attr:`counters` from the checkpoint.  On another world
        size the state is moved by the algorithm's rule (module docstring),
        with a warning naming what was redistributed or reset.

        Raises
        ------
        UsageError
            On every rank alike: an unreadable file, or a checkpoint of
            another algorithm, model, hyperparameters (unless
            ``override_hyperparameters``), or ranks at different steps, or
            of another world size where the algorithm has no rule; the
            message names the mismatch and both values.  The signal handlers
            are restored first (:meth:`close`).
        """
        if not self.config.resume:
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
        try:
            ckpt = load_checkpoint(path, world, allow_world_size_change=True)
        except CheckpointError as err:
            raise UsageError(f"--resume: {err}") from None
        saved, here = ckpt.attrs, self.attrs(0)
        checks = [("algorithm", "algorithm"), ("model signature", "model_signature")]
        if ckpt.world_size == world.size:  # on another world size the groups change with it (see _resized)
            checks += [("number of groups (--group-size)", "num_groups"), ("size of rank 0's group (--group-size)", "group_size")]
        for what, key in checks:
            if saved.get(key) != here[key]:
                raise UsageError(f"--resume {path}: the checkpoint's {what} is {saved.get(key)!r}, this run's {here[key]!r}")
        if not self.config.override_hyperparameters:
            differences = hyperparameter_differences(
                self.algorithm, _parsed_keywords(saved["hyperparameters"]), here["hyperparameters"], ckpt.world_size, world.size)
            if differences:
                raise UsageError(
                    f"--resume {path}: the checkpoint's hyperparameters differ from this run's "
                    f"(--override-hyperparameters keeps this run's): {'; '.join(differences)}"
                )
        states = ckpt.rank_states
        steps = [int(s["step"]) for s in states] if states is not None else world.allgather_obj(int(ckpt.rank_state["step"]))
        if len(set(steps)) > 1 or steps[0] != int(saved["step"]):
            raise UsageError(f"--resume {path}: the ranks' states are at different steps {steps}; the file says step {saved['step']}")
        state = ckpt.rank_state if states is None else self._resized(ckpt)
        load = self.opt.algorithm.load_state_dict
        try:  # a state may fail on some ranks only (the asynchronous server's, a leader's): decide together
            self.topology.decide(lambda: load(state["algorithm"], override_hyperparameters=self.config.override_hyperparameters),
                                 "resume", catch=(ValueError,))
        except (ValueError, OtherRankError) as err:
            raise UsageError(f"--resume {path}: {err}") from None
        load_inner_state(self.opt.inner, state.get("inner"))
        with torch.no_grad():
            self.opt.flat_params.copy_(torch.from_numpy(state["params"]))
            for name, buffer in self.model.named_buffers():
                buffer.copy_(torch.from_numpy(state["buffers"][name]))
        if state["rng"] is not None:
            torch.set_rng_state(torch.from_numpy(state["rng"]["torch"]))
        self.counters = {name: saved.get(name, self.counters[name]) for name in COUNTERS}
        if world.rank == 0:
            print(f"resuming from {path} after step {steps[0]}", flush=True)
        return steps[0]

    def _resized(self, ckpt: Checkpoint) -> Dict[str, Any]:
        """This rank's state from a checkpoint of another world size (module docstring); warns on rank 0."""
        world, old = self.topology.world, ckpt.world_size
        mine = ckpt.rank_states[source_rank(world.rank, old)]
        try:
            (algorithm,), notes = resize_states(
                self.algorithm, [s["algorithm"] for s in ckpt.rank_states], world.size,
                self.opt.algorithm.hyperparameters(), ranks=[world.rank],
            )
        except ValueError as err:  # the same states on every rank: every rank refuses alike
            raise UsageError(f"--resume {ckpt.path}: written by {old} ranks, this job has {world.size}: {err}") from None
        if world.rank == 0:
            moved = "".join(f"\n  {note}" for note in notes) or " nothing but copies"
            warnings.warn(
                f"--resume {ckpt.path}: written by {old} ranks, resuming on {world.size}. Parameters and model buffers: "
                f"new rank r takes old rank r % {old}'s. {self.algorithm} state:{moved}\n"
                "The data order continues at the next step of this world's sampler (its epochs differ).",
                stacklevel=2,
            )
        rng = ckpt.rank_states[world.rank]["rng"] if world.rank < old else None  # a new rank keeps its fresh seed
        # The inner optimizer's state follows the parameters it moved (identical on every rank where the exchanged
        # gradient is what it steps on).
        return {"algorithm": algorithm, "params": mine["params"], "buffers": mine["buffers"], "rng": rng, "inner": mine.get("inner")}


def _parsed_keywords(hyperparameters: Mapping[str, Any]) -> Mapping[str, Any]:
    """A checkpoint's hyperparameters with its optimizer's keywords as :func:`optimizer_keywords` gives them now.

    Checkpoints from before that function kept ``betas=0.9,0.95`` as the text
    ``"0.9,0.95"``: parsed, they compare equal to this run's ``[0.9, 0.95]``.
    """
    optimizer = hyperparameters.get("optimizer")
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("keywords"), dict):
        return hyperparameters
    keywords = optimizer_keywords(TrainConfig(optimizer=optimizer.get("name"), hyperparameters={optimizer.get("name") or "": optimizer["keywords"]}))
    return {**hyperparameters, "optimizer": {**optimizer, "keywords": keywords}}
