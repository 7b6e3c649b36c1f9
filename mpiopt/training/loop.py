"""One training run: a model from :mod:`mpiopt.tasks` trained by a :class:`~mpiopt.torch.DistributedOptimizer`.

Every rank builds the model from the seed, steps through its shard of the
data, evaluates the model the algorithm's ``evaluates`` names, and rank 0
writes the records.  The whole walk-through: docs/training-internals.md.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..algorithms import ASYNCHRONOUS, algorithm_class
from ..asyncrt import ServerLost
from ..asyncrt.result import job_fields
from ..comm import Comm, RankLost, Topology
from ..comm.survival import INJECTION
from ..metrics import MetricsWriter, Tracer, versions
from ..tasks.images import ImageDataset
from ..tasks.models import build_model
from ..tasks.text import TextDataset
from ..torch import DistributedOptimizer, average_buffers, broadcast_module
from ..torch.optimizer import loss_value
from ..torch.threads import set_threads
from .checkpointing import COUNTERS, CheckpointPlan, Checkpointer, Interrupted
from .config import DDP, DEFAULT_EPOCHS, TrainConfig, UsageError
from .data import Batches
from .ddp import NOTES, DDPBaseline
from .device import autocast, choose_device, use_device, uses_scaler
from .optimizers import OptimizerSettings, clip, inner_optimizer, schedule
from .progress import Progress
from .survival import go_on_without_lost_ranks, report_dropped_workers, starting

__all__ = ["train"]

EVAL_BATCH = 1000
#: Per evaluated model (``Algorithm.evaluates``): whose parameters the evaluator reads, and the records' name for them.
_EVALUATED = {"identical": ("own", "rank0"), "average": ("average", "average"), "server": ("root", "rank0"), "leader": ("root", "leader")}


def _loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the classes: one per sample (images: ``(N, K)`` logits), or one per position (text: ``(B, T, V)``)."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


def _set_threads(config: TrainConfig, world: Comm) -> None:
    """Threads per rank, for torch and mpiopt's C kernels alike (:func:`mpiopt.torch.threads.set_threads`)."""
    set_threads(config.threads, world)


class _Evaluator:
    """The test-set evaluation of a run (collective): each rank a slice, sums over the ranks."""

    def __init__(self, model: torch.nn.Module, dataset: ImageDataset | TextDataset, world: Comm, source: str, precision: str) -> None:
        self.world, self.precision = world, precision
        device = next(model.parameters()).device
        self.bits_per_byte = getattr(dataset, "byte_level", False)  # byte tokens: the loss in bits per byte as well
        self.eval_batch = getattr(dataset, "eval_batch", EVAL_BATCH)
        self.x = torch.from_numpy(dataset.x_test[world.rank :: world.size]).to(device)
        self.y = torch.from_numpy(dataset.y_test[world.rank :: world.size]).to(device)
        # A second model only where another set of parameters than this rank's is evaluated.
        self.source = source
        self.copy = None if source == "own" else copy.deepcopy(model)
        self._flat = None if source == "own" else torch.empty(sum(p.numel() for p in model.parameters()), dtype=next(model.parameters()).dtype, device=device)

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, flat: Optional[torch.Tensor], train_losses: List[float]) -> Dict[str, float]:
        """Evaluate ``model`` itself (source "own"), the ranks' mean of ``flat`` ("average") or rank 0's ``flat`` ("root")."""
        average_buffers(model, self.world)
        evaluated = model
        source = self.source
        if source != "own":
            # The buffers (BatchNorm statistics) from the model; the parameters come from flat below.
            for mine, theirs in zip(self.copy.buffers(), model.buffers()):
                mine.copy_(theirs)
            if source == "average":
                self.world.Allreduce(flat, out=self._flat)
                self._flat /= self.world.size
            else:
                self._flat.copy_(flat)
                self.world.Bcast(self._flat, root=0)
            torch.nn.utils.vector_to_parameters(self._flat, self.copy.parameters())
            evaluated = self.copy
        was_training = evaluated.training
        evaluated.eval()
        sums = np.zeros(5, dtype=np.float64)  # test loss, correct, count, train loss sum, train count
        for start in range(0, len(self.y), self.eval_batch):
            x, y = self.x[start : start + self.eval_batch], self.y[start : start + self.eval_batch]
            with autocast(x.device, self.precision):
                logits = evaluated(x)
            sums[0] += float(_loss(logits, y, reduction="sum"))
            sums[1] += float((logits.argmax(-1) == y).sum())  # text: next-token accuracy over every position
            sums[2] += y.numel()
        finite = [v for v in train_losses if math.isfinite(v)]
        sums[3], sums[4] = sum(finite), len(finite)
        evaluated.train(was_training)
        self.world.Allreduce(sums)
        result = {
            "test_loss": sums[0] / max(1.0, sums[2]),
            "test_accuracy": sums[1] / max(1.0, sums[2]),
            "train_loss": sums[3] / sums[4] if sums[4] else math.nan,
        }
        if self.bits_per_byte:
            result["bits_per_byte"] = result["test_loss"] / math.log(2)
            result["perplexity"] = math.exp(min(result["test_loss"], 700.0))  # exp(700) still a float
        return result


@contextmanager
def _written_on_stop(tracer: Optional[Tracer], path: Optional[str]) -> Iterator[None]:
    """Around a run's steps: a stop signal (every rank alike) still writes the trace (a collective call)."""
    try:
        yield
    except Interrupted:
        if tracer:
            tracer.write(path)
        raise


def train(
    config: TrainConfig,
    algorithm: str,
    topology: Topology,
    dataset: ImageDataset | TextDataset,
    out_dir: str,
    *,
    stream: Optional[Any] = sys.stdout,
    on_start: Optional[Callable[[], None]] = None,
    device: Optional[str] = None,
    counted_since: Optional[float] = None,
) -> str:
    """Train ``algorithm`` on ``dataset`` (from :func:`~mpiopt.training.data.load_data`) as ``config`` says, writing to ``out_dir`` (collective).

    ``on_start`` is called once a resume was accepted (``train`` saves its
    settings then, so a refused resume leaves ``config.toml`` as it was).
    ``device``: this rank's (``"cuda:1"``); default: ``config.device`` resolved here.
    ``counted_since``: a ``time.perf_counter()`` that the run's wall time counts from, its start included (a respawn's
    resume: the replacements' join is the loss's price too); default: its first step.
    Returns the metrics file's path, on every rank (where rank 0 is lost, the survivor that takes its place reports
    every run, those before the loss too); rank 0 writes it.
    """
    world, config = topology.world, config.for_algorithm(algorithm)
    with ExitStack() as cleanup:
        with starting(topology):  # a rank lost before the first step: every survivor leaves here alike
            device = device or choose_device(config.device, config.precision, config.share_gpus, world)
            use_device(device)
            _set_threads(config, world)
            torch.manual_seed(config.seed)
            sizes = {k: v for k, v in config.gpt_sizes().items() if k != "block_size"}  # the block size is the dataset's windows'
            model = build_model(config.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes, width=config.width, dropout=config.dropout, **sizes)
            model.to(device)  # before the optimizers: their flat buffers and state are made where the parameters are
            hyper = config.algorithm_hyperparameters(algorithm)
            scaler = _scaler(algorithm, device) if uses_scaler(config.precision) else None
            inner = inner_optimizer(OptimizerSettings.of(config), model)
            opt = _optimizer(algorithm, model, topology, hyper, inner, scaler, islands=config.islands_for(algorithm))
            broadcast_module(model, topology)
            torch.manual_seed(config.seed + 1 + world.rank)  # dropout differs between ranks, reproducibly
            if world.rank == 0:
                os.makedirs(out_dir, exist_ok=True)
            world.Barrier()
            run = _Run(config, algorithm, topology, dataset, model, opt, hyper, out_dir, stream, cleanup, on_start, scaler, counted_since)
        end = run.asynchronous() if run.is_asynchronous else run.synchronous()
        return run.close_records(end)


def _scaler(algorithm: str, device: str) -> torch.amp.GradScaler:
    """``--precision fp16``'s gradient scaler: torch's for the ddp baseline, else mpiopt's (its overflow check agreed by the ranks)."""
    if algorithm == DDP:
        return torch.amp.GradScaler(torch.device(device).type)
    from ..torch import GradScaler

    return GradScaler(torch.device(device).type)


def _optimizer(algorithm: str, model: torch.nn.Module, topology: Topology, hyper: Dict[str, Any], inner: Any, scaler: Any,
               islands: bool = False) -> Any:
    """The run's optimizer (DDP's baseline or a :class:`DistributedOptimizer`, over ``inner`` if given), validated before any communication."""
    try:  # every rank fails alike
        if algorithm == DDP:
            return DDPBaseline(model, topology, optimizer=inner, scaler=scaler, **({} if inner is not None else hyper))
        return DistributedOptimizer(model.parameters(), algorithm, topology=topology, inner=inner, islands=islands, **hyper)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{algorithm}: {err}") from None


class _Totals:
    """A run's running totals (:data:`COUNTERS`: a resumed run continues the checkpoint's) and the training losses since the last evaluation."""

    def __init__(self, counters: Mapping[str, float]) -> None:
        self.wall_seconds = counters["wall_seconds"]
        self.bytes_sent_total = counters["bytes_sent_total"]
        self.island_bytes_sent_total = counters["island_bytes_sent_total"]  # of it, within the rank's island
        self.losses: List[float] = []

    def counters(self) -> Dict[str, float]:
        """The :data:`COUNTERS`, as checkpoints save them and the end record holds them."""
        return {name: getattr(self, name) for name in COUNTERS}


class _Run:
    """One :func:`train` on this rank once its model and optimizer exist: steps, evaluations, records, checkpoints.

    Files and handlers opened here close with ``cleanup``.
    """

    def __init__(
        self, config: TrainConfig, algorithm: str, topology: Topology, dataset: ImageDataset | TextDataset, model: torch.nn.Module, opt: Any,
        hyper: Dict[str, Any], out_dir: str, stream: Optional[Any], cleanup: ExitStack, on_start: Optional[Callable[[], None]],
        scaler: Optional[torch.amp.GradScaler], counted_since: Optional[float],
    ) -> None:
        self.config, self.algorithm, self.topology, self.model, self.opt, self.out_dir = config, algorithm, topology, model, opt, out_dir
        self.dataset, self.stream, self.cleanup = dataset, stream, cleanup  # a lost rank's survivors re-shard and report
        self.device, self.scaler = next(model.parameters()).device, scaler
        world = topology.world
        self.is_asynchronous = algorithm != DDP and algorithm_class(algorithm).protocol == ASYNCHRONOUS
        self.network = opt.network if algorithm == DDP else model  # the forward pass through DDP: its hooks average the gradient
        self.batches = Batches(dataset, config.batch_size, config.seed, config.augment, world, self.is_asynchronous, self.device)
        self.batches_per_epoch = self.batches.sampler.batches_per_epoch
        self.steps = config.steps or max(1, math.ceil((config.epochs or DEFAULT_EPOCHS) * self.batches_per_epoch))
        self.eval_every = config.evaluation_interval(self.steps)
        self.checkpoints = Checkpointer(CheckpointPlan.of(config, out_dir), algorithm, topology, model, opt, self.batches_per_epoch, scaler)
        cleanup.callback(self.checkpoints.close)  # signal handlers restored however the run ends
        self.start = self.applied = self.checkpoints.resume()
        self.dropped_told = 0  # the asynchronous algorithm's losses reported (survival)
        #: The ranks lost, and those that left with their island, that no process has replaced yet (respawn).
        self.unreplaced: Tuple[List[int], List[int]] = ([], [])
        if on_start is not None:
            on_start()
        reporter = world.rank == (1 if self.is_asynchronous and world.size > 1 else 0)
        self.progress = Progress(algorithm, self.steps, config.log_every or self.eval_every, stream if reporter else None, config.progress)
        self.progress.language = getattr(dataset, "byte_level", False)
        self.writer = MetricsWriter(os.path.join(out_dir, "metrics.jsonl"), truncate=not self.checkpoints.resumed) if world.rank == 0 else None
        if self.writer:
            cleanup.callback(self.writer.close)
            self.writer.write(self._run_record(hyper))
        self.tracer = Tracer(topology) if config.trace else None
        # config.trace names the main algorithm's trace; every other run of a compare writes its own into its folder.
        self.trace_path = config.trace if algorithm == config.algorithm else os.path.join(out_dir, "trace.json")
        if self.tracer:
            cleanup.callback(self.tracer.close)
        evaluates = "identical" if algorithm == DDP else algorithm_class(algorithm).evaluates
        self.source, self.evaluated_name = _EVALUATED[evaluates]
        self.evaluator = _Evaluator(model, dataset, world, self.source, config.precision)
        self.totals = _Totals(self.checkpoints.counters)
        self.respawned = counted_since is not None  # a respawn's resume: the replacements' join counts, as below
        self.totals.wall_seconds += 0.0 if counted_since is None else time.perf_counter() - counted_since
        self.uncounted_since = time.perf_counter()  # a loss before the first step (a redone closing) counts from here
        # The rate schedule acts on the groups the algorithm reads (the inner optimizer's, or DDP's optimizer's).
        groups = opt.optimizer if algorithm == DDP else opt
        self.scheduler = None if self.is_asynchronous else schedule(config.warmup_steps, groups, self.steps, self.start)

    # -- records ------------------------------------------------------------------------------
    def _run_record(self, hyper: Dict[str, Any]) -> Dict[str, Any]:
        """The metrics file's first record: the algorithm, the settings, the versions, the run's size and hosts."""
        config = self.config
        return {
            "kind": "run", "algorithm": self.algorithm, "task": f"{config.dataset}/{config.model}",
            "config": {**asdict(config), "algorithm": self.algorithm, "hyperparameters": hyper}, "world_size": self.topology.world.size,
            "hosts": self.topology.hosts, "versions": versions(), "steps": self.steps, "batches_per_epoch": self.batches_per_epoch,
            "parameters": sum(p.numel() for p in self.model.parameters()), "device": _device_name(self.device), **({"resumed_after_step": self.start} if self.checkpoints.resumed else {}),
            **({"notes": NOTES} if self.algorithm == DDP else {"worker_layout": self.opt.algorithm.worker_layout()}),
        }

    def close_records(self, end: Dict[str, Any]) -> str:
        """The end record (rank 0) and the trace; returns the metrics file's path."""
        if self.writer:
            self.writer.write({"kind": "end", "step": self.steps, **self.totals.counters(), **end})
        if self.tracer:
            self.tracer.write(self.trace_path)
        return os.path.join(self.out_dir, "metrics.jsonl")

    def _phase(self, name: str) -> ContextManager[Any]:
        """The trace's span of phase ``name``; nothing without ``--trace``."""
        return self.tracer.phase(name) if self.tracer else nullcontext()

    def _step_record(self, step: int, loss: float, compute: float, whole: float, record: Dict[str, Any]) -> Dict[str, Any]:
        """The record of one step; adds its bytes and loss to the totals."""
        self.totals.bytes_sent_total += record["bytes_sent"]
        self.totals.island_bytes_sent_total += record.get("island_bytes_sent", 0)
        self.totals.losses.append(loss)
        return {
            "kind": "step", "step": step, "epoch": step / self.batches_per_epoch, "loss": loss, "lr": self.opt.algorithm.lr,
            "compute_seconds": compute, "step_seconds": whole, "wall_seconds": self.totals.wall_seconds, "algorithm": self.algorithm,
            **record,
        }

    def _evaluate(self, step: int) -> None:
        """Evaluate the model the algorithm's ``evaluates`` names (collective); record and report it."""
        with self._phase("eval"):
            result = self.evaluator(self.model, None if self.source == "own" else self.opt.flat_params, self.totals.losses)
        self.totals.losses = []
        self.progress.accuracy, self.progress.test_loss = result["test_accuracy"], result["test_loss"]
        if self.progress.tty:  # the bar is redrawn in place: keep each evaluation as a line of its own
            quality = (f"{result['bits_per_byte']:.3f} bits per byte, perplexity {result['perplexity']:.2f}" if "bits_per_byte" in result
                       else f"test accuracy {100 * result['test_accuracy']:.1f}%")
            self.progress.note(f"eval at step {step}: {quality}, test loss {result['test_loss']:.4f}")
        if self.writer:
            self.writer.write({
                "kind": "eval", "step": step, "epoch": step / self.batches_per_epoch, "wall_seconds": self.totals.wall_seconds,
                "bytes_sent_total": self.totals.bytes_sent_total, "island_bytes_sent_total": self.totals.island_bytes_sent_total,
                "evaluated": self.evaluated_name,
                **result,
            })

    # -- the synchronous protocol ----------------------------------------------------------------
    def synchronous(self) -> Dict[str, Any]:
        """Every rank steps together: forward, backward, the algorithm's step; evaluations every ``eval_every`` steps.

        With ``--on-failure shrink`` a lost rank's survivors go on from the step it broke (:mod:`.survival`)."""
        with _written_on_stop(self.tracer, self.trace_path):
            # A respawn's hand-over after the last step (a loss broke its evaluation and checkpoint): redo them.
            step, closing = self.start, self.respawned and self.start == self.steps
            while step < self.steps or closing:
                try:
                    if closing:  # the last step stood, but a lost rank broke its evaluation and checkpoint: redo them
                        closing = self._evaluate_and_checkpoint(step)
                    else:
                        self._synchronous_step(step)
                        step += 1
                except RankLost:
                    step = go_on_without_lost_ranks(self, step - 1 if closing else step)
                    closing = step == self.steps
        self.opt.finish()
        return {"world_size": self.topology.size}

    def _synchronous_step(self, step: int) -> None:
        """Step ``step + 1``: compute, apply, record; evaluate and checkpoint when due."""
        opt = self.opt
        INJECTION.at(step + 1)
        started = self.uncounted_since = time.perf_counter()  # a lost rank's recovery counts from here (survival)
        x, y = self.batches(step)
        with self._phase("compute"):
            opt.zero_grad()
            with autocast(self.device, self.config.precision):
                loss = _loss(self.network(x), y)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        computed = time.perf_counter()
        with self._phase("algorithm"):
            self._apply(loss)
            self.applied = step + 1
            if self.scheduler is not None:
                self.scheduler.step()
        whole = time.perf_counter() - started
        self.totals.wall_seconds += whole
        self.uncounted_since = started + whole
        record = opt.last.as_dict()
        record.pop("step")
        line = self._step_record(step + 1, record.pop("loss"), computed - started, whole, record)
        if self.writer:
            self.writer.write(line)
        self._evaluate_and_checkpoint(step + 1, lambda: self.progress.update(step + 1, line["loss"], whole, self.totals.bytes_sent_total / 1e6))

    def _evaluate_and_checkpoint(self, done: int, report: Callable[[], None] = lambda: None) -> bool:
        """After step ``done``: evaluate when due, ``report()``, checkpoint; agreed by a lost rank's survivors.  False."""
        with self.topology.agreed(f"the evaluation and checkpoint after step {done}"):
            if done % self.eval_every == 0 or done == self.steps:
                self._evaluate(done)
            report()
            self.checkpoints.after_step(done, last=done == self.steps, counters=self.totals.counters())
        return False

    def _apply(self, loss: torch.Tensor) -> None:
        """Clip and step; with a scaler (``--precision fp16``) unscaled first, the step skipped on every rank after an overflow."""
        opt, scaler = self.opt, self.scaler
        if scaler is None:
            clip(self.config.clip_grad_norm, opt, self.model)
            opt.step(loss=loss)
            return
        # Unscaled before the exchange (topk's error feedback keeps what it did not send in the units sent), except where
        # backward sent the gradient already (overlap: sgd's sum, an island's mean): its sum is unscaled then (docs/torch.md).
        overlapped = self.algorithm != DDP and opt.overlap
        if overlapped:
            opt.synchronize()
        scaler.unscale_(opt.optimizer if self.algorithm == DDP else opt)
        clip(self.config.clip_grad_norm, opt, self.model, synchronized=overlapped)
        if self.algorithm == DDP:
            opt.step(loss=loss)  # the baseline steps its optimizer through the scaler
        else:
            scaler.step(opt, loss=loss)
        scaler.update()

    # -- the asynchronous protocol ---------------------------------------------------------------
    def asynchronous(self) -> Dict[str, Any]:
        """Segments of runs that end quiescent, each until the next multiple of ``--checkpoint-every`` or ``eval_every``.

        Between segments: records, evaluation, checkpoint and the stop-signal vote (docs/training-internals.md)."""
        steps, every = self.steps, self.config.checkpoint_every or self.steps
        self._log: List[Dict[str, Any]] = []  # the reporter's step records of the current segment
        self._tail: List[float] = []  # the latest losses, for the train loss of the final evaluation
        results, done = [], self.start
        with _written_on_stop(self.tracer, self.trace_path):
            while done < steps:
                first, last = done + 1, self._segment_end(done, every)
                self._last, self._ledger = time.perf_counter(), self.topology.ledger.snapshot()  # the checkpoint's time excluded
                self._log.clear()
                try:  # with --on-failure shrink a lost worker is dropped, and the phase after the segment redone
                    results.append(self.opt.run(self._compute, last - done))
                    report_dropped_workers(self, first, last)
                    done = last
                    while not self._after_segment(done):
                        report_dropped_workers(self, first, last)
                except ServerLost:
                    report_dropped_workers(self, first, last, server_lost=True)
                    raise
        self.totals.losses = self._tail
        self._evaluate(steps)
        return {"world_size": self.topology.size, **({"result": job_fields(results)} if results else {})}

    def _after_segment(self, done: int) -> bool:
        """The segment's records on every rank (rank 0 writes them, every rank checkpoints the totals), evaluation and
        checkpoint; False where a lost rank broke them (the survivors shrank: redo)."""
        world = self.topology.world
        try:
            with self.topology.agreed(f"the records, evaluation and checkpoint after step {done}"):
                records, self.totals.wall_seconds, self.totals.bytes_sent_total = world.bcast_obj(
                    (self._log, self.totals.wall_seconds, self.totals.bytes_sent_total), root=1 if world.size > 1 else 0)
                if self.writer:
                    for record in records:
                        self.writer.write(record)
                self._tail = (self._tail + [r["loss"] for r in records])[-max(1, self.steps // 10):]
                if done % self.eval_every == 0 and done < self.steps:
                    self.totals.losses = self._tail
                    self._evaluate(done)
                self.checkpoints.after_step(done, last=done == self.steps, counters=self.totals.counters())
            return True
        except RankLost:
            self.opt.algorithm.shrink()
            return False

    def _segment_end(self, done: int, every: int) -> int:
        """Where the asynchronous segment that starts at ``done`` ends: the next checkpoint or evaluation step, or the last."""
        return min(done + every - done % every, done + self.eval_every - done % self.eval_every, self.steps)

    def _compute(self, step: int) -> torch.Tensor:
        """A worker's forward and backward at ``step`` (the runtime's ``compute_fn``), recorded as a step."""
        INJECTION.at(step + 1)
        started = time.perf_counter()
        with self._phase("compute"):
            x, y = self.batches(step)
            with autocast(self.device, self.config.precision):
                loss = _loss(self.model(x), y)
            loss.backward()
        now = time.perf_counter()
        delta = self.topology.ledger.since(self._ledger)
        comm, wait = delta.blocked_seconds()
        whole = now - self._last
        self.totals.wall_seconds += whole
        # A worker applies nothing itself: the rest of its time is spent waiting for the server.
        record = {"bytes_sent": delta.bytes_sent, "bytes_recv": delta.bytes_recv, "comm_seconds": comm,
                  "wait_seconds": max(wait, whole - (now - started) - comm), "algo_seconds": 0.0}
        self._log.append(self._step_record(step + 1, loss_value(loss), now - started, whole, record))
        self.progress.update(step + 1, self._log[-1]["loss"], whole, self.totals.bytes_sent_total / 1e6)
        self._last, self._ledger = now, self.topology.ledger.snapshot()
        return loss


def _device_name(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``: the run header's record of where a rank trained."""
    return str(device) if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})"
