"""Training settings: one dataclass and its validation, each algorithm's starting hyperparameters, agreement across ranks.

Every setting of ``mpiopt train`` and ``mpiopt compare`` is a field of
:class:`TrainConfig`, a flag (``--batch-size``) and a key of a TOML file
(``batch_size = 32``); :mod:`.flags` reads them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

if TYPE_CHECKING:
    from ..comm import Comm
    from ..comm.communicator import Failure

__all__ = ["agree_or_fail", "TrainConfig", "UsageError", "training_defaults", "DDP", "DEFAULT_EPOCHS", "TEXT_TARGET_LOSS"]


class UsageError(ValueError):
    """A bad setting: the message names it, its value and what is allowed."""


#: The torch DDP-on-gloo baseline (:mod:`mpiopt.training.ddp`): not an mpiopt algorithm, so opt-in by name;
#: it takes the baseline algorithm's defaults, being the same mathematics (mean-gradient SGD with momentum).
DDP = "ddp"


def training_defaults(name: str) -> Dict[str, Any]:
    """The hyperparameters ``mpiopt train`` starts ``name`` from (its class's ``training_defaults``); {} for an unknown name.

    Any of them can be overridden with ``--lr`` / ``--hp``.
    """
    from ..algorithms import algorithm_class, algorithms

    if name == DDP:
        return dict(next(cls for cls in algorithms() if cls.baseline).training_defaults)
    try:
        return dict(algorithm_class(name).training_defaults)
    except ValueError:
        return {}

DATASETS = ("digits", "cifar10", "synthetic", "text")
MODELS = ("mlp", "cnn", "resnet20", "gpt")
#: --device and --precision (mpiopt.training.device).
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")
#: The transformer's sizes (:mod:`mpiopt.tasks.gpt`): settings of ``--model gpt`` only.
GPT_SIZES = ("n_layer", "n_embd", "n_head", "block_size")
DEFAULT_EPOCHS = 20
#: The text task's default ``--target-loss`` (nats, 3.6 bits per byte): the headline comparison's target (docs/headline.md).
TEXT_TARGET_LOSS = 2.5
PROGRESS_MODES = ("auto", "bar", "lines")
#: What a lost rank does to a training run: the topology's answers, and respawn (shrink, then replacements join).
ON_FAILURE = ("abort", "shrink", "respawn")
#: ``--optimizer`` choices (:mod:`.optimizers` makes them) and ``--no-decay-on`` kinds.
OPTIMIZER_NAMES = ("sgd", "adam", "adamw")
NO_DECAY_KINDS = ("bias", "norm")


@dataclass
class TrainConfig:
    """Every setting of a training run (see ``mpiopt train --help`` for each one's meaning)."""

    algorithm: str = "sgd"
    dataset: str = "digits"
    data_dir: Optional[str] = None
    model: str = "mlp"
    width: Optional[int] = None
    n_layer: Optional[int] = None
    n_embd: Optional[int] = None
    n_head: Optional[int] = None
    block_size: Optional[int] = None
    dropout: float = 0.0
    augment: bool = False
    epochs: Optional[float] = None
    steps: Optional[int] = None
    batch_size: int = 32
    lr: Optional[float] = None
    optimizer: Optional[str] = None
    no_decay_on: Optional[str] = None
    clip_grad_norm: Optional[float] = None
    warmup_steps: Optional[int] = None
    hyperparameters: Dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    group_size: Optional[int] = None
    islands: bool = False
    on_failure: str = "abort"
    eval_every: Optional[int] = None
    target_accuracy: float = 0.9
    target_loss: Optional[float] = None
    log_every: Optional[int] = None
    progress: str = "auto"
    threads: Optional[int] = None
    device: str = "auto"
    precision: str = "fp32"
    share_gpus: bool = False
    trace: Optional[str] = None
    out: Optional[str] = None
    checkpoint_every: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    keep_checkpoints: int = 3
    resume: Optional[str] = None
    override_hyperparameters: bool = False

    def gpt_sizes(self) -> Dict[str, int]:
        """``--model gpt``'s sizes, the defaults (:data:`mpiopt.tasks.gpt.GPT_DEFAULTS`) where not given; {} for another model."""
        if self.model != "gpt":
            return {}
        from ..tasks.gpt import GPT_DEFAULTS

        return {k: GPT_DEFAULTS[k] if getattr(self, k) is None else getattr(self, k) for k in GPT_SIZES}

    def evaluation_interval(self, steps: int) -> int:
        """Steps between two evaluations of a run of ``steps`` steps: ``eval_every``, else ten evaluations a run."""
        return self.eval_every or max(1, steps // 10)

    def for_algorithm(self, algorithm: str) -> "TrainConfig":
        """These settings as ``algorithm`` trains with them.

        In ``compare``, ``--optimizer`` steps the algorithms that take an inner
        optimizer; signum and the asynchronous ones keep their own update, so
        for them the optimizer and its companions are dropped.
        """
        from ..algorithms import algorithm_class

        if not self.optimizer or algorithm == DDP or algorithm_class(algorithm).inner_role is not None:
            return self
        return dataclasses.replace(self, optimizer=None, no_decay_on=None)

    def _check_survival(self, algorithms: Sequence[str]) -> None:
        """``--on-failure shrink``: what the survivors cannot yet roll back is refused (docs/failures.md)."""
        if self.on_failure not in ON_FAILURE:
            raise UsageError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {self.on_failure!r}")
        if self.on_failure == "abort":
            return
        from ..algorithms import ASYNCHRONOUS, algorithm_class

        for name in algorithms:
            if survival_refusal(name) is not None:
                raise UsageError(f"{name} takes no --on-failure {self.on_failure}: {survival_refusal(name)}")
            if self.on_failure == "respawn" and name != DDP and algorithm_class(name).protocol == ASYNCHRONOUS:
                raise UsageError(f"{name} takes no --on-failure respawn: the replacements resume at the original size, "
                                 f"and {algorithm_class(name).resize_refusal}; --on-failure shrink drops a lost worker")
        if self.precision == "fp16":
            raise UsageError(f"--on-failure {self.on_failure} takes no --precision fp16 yet: the scaler's vote is not rolled back")

    @property
    def topology_on_failure(self) -> str:
        """What the topology does with a lost rank: respawn is the training's (shrink, then replacements join)."""
        return "shrink" if self.on_failure == "respawn" else self.on_failure

    @property
    def whole_islands(self) -> bool:
        """Whether a lost rank takes the other ranks of its group with it: under ``--islands`` in every synchronous run,
        those without islands too (lsgd's in ``compare``), so that the groups stay equal islands for the runs that
        have them.  An asynchronous server drops one lost worker alone."""
        return self.islands

    def islands_for(self, algorithm: str) -> bool:
        """Whether ``algorithm`` runs with each group one worker: ``--islands``, unless it refuses them (lsgd, the
        asynchronous ones; ddp is data-parallel over every rank)."""
        return self.islands and islands_refusal(algorithm) is None

    def given_hyperparameters(self, algorithm: str) -> Dict[str, Any]:
        """The hyperparameters the user gave ``algorithm``: the shared table, then its own (no defaults, no --lr)."""
        shared = {k: v for k, v in self.hyperparameters.items() if not isinstance(v, dict)}
        # --optimizer sgd claims the table sgd: its keys are the optimizer's, not the sgd algorithm's
        own = {} if self.optimizer == algorithm else self.hyperparameters.get(algorithm, {})
        return {**shared, **own}

    def algorithm_hyperparameters(self, algorithm: Optional[str] = None) -> Dict[str, Any]:
        """The keyword arguments for ``algorithm`` (default: this run's): defaults, shared table, its own table, --lr."""
        name = algorithm or self.algorithm
        starts = training_defaults(name)
        if self.optimizer and name != DDP:  # the rate and the local update's settings are the inner optimizer's
            from ..algorithms.local import LOCAL_SGD

            starts = {k: v for k, v in starts.items() if k != "lr" and k not in LOCAL_SGD}
        hyper = {**starts, **self.given_hyperparameters(name)}
        if self.lr is not None and not self.optimizer:
            hyper["lr"] = self.lr
        return hyper

    def validate(self, algorithms: Sequence[str]) -> None:
        """Raise :class:`UsageError` naming the first bad setting (no MPI, no file system beyond the paths)."""
        from ..algorithms import available

        self._check_types()
        known = available() + [DDP]
        for name in algorithms:
            if name not in known:
                raise UsageError(f"unknown algorithm {name!r}; choose from {', '.join(known)}")
        tables = known + ([self.optimizer] if self.optimizer else [])
        for name, value in self.hyperparameters.items():
            if isinstance(value, dict) and name not in tables:
                raise UsageError(f"hyperparameter table {name!r} names no algorithm or --optimizer; those: {', '.join(tables)}")
        self._check_optimizer(algorithms)
        if self.islands and len(algorithms) == 1 and islands_refusal(algorithms[0]) is not None:
            raise UsageError(f"{algorithms[0]} takes no --islands: {islands_refusal(algorithms[0])}")
        self._check_survival(algorithms)
        if self.seed < 0:
            raise UsageError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.override_hyperparameters and not self.resume:
            raise UsageError("--override-hyperparameters only applies with --resume")
        if self.checkpoint_dir and not (self.checkpoint_every or self.resume):
            raise UsageError("--checkpoint-dir only applies with --checkpoint-every or --resume")
        if DDP in algorithms and (self.checkpoint_every or self.resume):
            raise UsageError(f"--checkpoint-every and --resume are not supported for the {DDP} baseline (torch DDP on gloo); "
                             "train it without checkpoints")
        if self.dataset not in DATASETS:
            raise UsageError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}")
        if self.model not in MODELS:
            raise UsageError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        if self.steps is not None and self.epochs is not None:
            raise UsageError(f"give --steps or --epochs, not both (got steps={self.steps}, epochs={self.epochs})")
        _positive("steps", self.steps, integer=True)
        _positive("epochs", self.epochs)
        _positive("batch_size", self.batch_size, integer=True)
        _positive("width", self.width, integer=True)
        self._check_task()
        _positive("lr", self.lr)
        _positive("group_size", self.group_size, integer=True)
        _positive("eval_every", self.eval_every, integer=True)
        _positive("log_every", self.log_every, integer=True)
        _positive("threads", self.threads, integer=True)
        _positive("checkpoint_every", self.checkpoint_every, integer=True)
        _positive("keep_checkpoints", self.keep_checkpoints, integer=True)
        if self.device not in DEVICES:
            raise UsageError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise UsageError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.progress not in PROGRESS_MODES:
            raise UsageError(f"progress must be one of {', '.join(PROGRESS_MODES)}, got {self.progress!r}")
        if not (0.0 <= self.dropout < 1.0):
            raise UsageError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not (0.0 < self.target_accuracy <= 1.0):
            raise UsageError(f"target_accuracy must be in (0, 1], got {self.target_accuracy!r}")
        if self.target_loss is not None and not (math.isfinite(self.target_loss) and self.target_loss > 0):
            raise UsageError(f"target_loss must be a finite loss > 0, got {self.target_loss!r}")
        if self.augment and self.dataset != "cifar10":
            raise UsageError(f"augment (random crop and flip) is for 32x32 images: dataset cifar10, not {self.dataset!r}")
        if self.dataset == "cifar10" and self.data_dir is None:
            raise UsageError("dataset cifar10 needs --data-dir (the folder with data_batch_1.bin ... test_batch.bin)")
        if self.data_dir is not None and not os.path.isdir(self.data_dir):
            raise UsageError(f"data_dir {self.data_dir!r} is not a directory")
        for name in algorithms:
            self._check_hyperparameters(name)

    def _check_task(self) -> None:
        """The text task and the transformer go together; the transformer's sizes are positive and its heads divide its width."""
        if (self.dataset == "text") != (self.model == "gpt"):
            raise UsageError(f"dataset text goes with model gpt (a language model over bytes), got dataset {self.dataset!r} "
                             f"and model {self.model!r}")
        for name in GPT_SIZES:
            _positive(name, getattr(self, name), integer=True)
        if self.model != "gpt":
            given = [f"{k}={getattr(self, k)}" for k in GPT_SIZES if getattr(self, k) is not None]
            if given:
                raise UsageError(f"{', '.join(given)}: the transformer's sizes apply to model gpt only, not {self.model!r}")
            return
        if self.width is not None:
            raise UsageError(f"width applies to mlp, cnn and resnet20; model gpt takes --n-embd (got width={self.width})")
        sizes = self.gpt_sizes()
        if sizes["n_embd"] % sizes["n_head"]:
            raise UsageError(f"n_embd must be divisible by n_head, got n_embd={sizes['n_embd']} and n_head={sizes['n_head']}")

    def _check_optimizer(self, algorithms: Sequence[str]) -> None:
        """``--optimizer`` and its companions: known values, and algorithms that take them."""
        from ..algorithms import ASYNCHRONOUS, algorithm_class

        if self.optimizer is not None and self.optimizer not in OPTIMIZER_NAMES:
            raise UsageError(f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZER_NAMES)}")
        kinds = [k for k in (self.no_decay_on or "").split(",") if k]
        if any(k not in NO_DECAY_KINDS for k in kinds):
            raise UsageError(f"no_decay_on takes {', '.join(NO_DECAY_KINDS)} (comma-separated), got {self.no_decay_on!r}")
        if kinds and not self.optimizer:
            raise UsageError("--no-decay-on needs --optimizer: the built-in update takes one weight decay for all parameters")
        _positive("clip_grad_norm", self.clip_grad_norm)
        _positive("warmup_steps", self.warmup_steps, integer=True)
        own_update = [n for n in algorithms if n != DDP and algorithm_class(n).inner_role is None]
        if self.optimizer and own_update and len(own_update) == len([n for n in algorithms if n != DDP]):
            cls = algorithm_class(own_update[0])
            raise UsageError(f"{cls.name} takes no --optimizer: {cls.inner_refusal}")
        for name in algorithms:
            if name == DDP:
                continue
            cls = algorithm_class(name)
            if cls.protocol == ASYNCHRONOUS and (self.clip_grad_norm or self.warmup_steps):
                raise UsageError(f"{name} is asynchronous: --clip-grad-norm and --warmup-steps act between synchronous steps")
            if cls.protocol == ASYNCHRONOUS and self.precision == "fp16":
                raise UsageError(f"{name} is asynchronous: its workers take no gradient scaler's step, which --precision fp16 "
                                 "needs; use bf16")

    def _check_types(self) -> None:
        """Each setting of the type its field declares (values from a TOML file arrive unchecked)."""
        kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "Dict[str, Any]": (dict,)}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            text = str(f.type)
            optional = text.startswith("Optional[")
            declared = text[len("Optional[") : -1] if optional else text
            if value is None and optional:
                continue
            allowed = kinds[declared]
            if not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool)):
                raise UsageError(f"{f.name} must be {'a table' if declared.startswith('Dict') else 'a ' + declared}, got {value!r}")

    def _check_hyperparameters(self, name: str) -> None:
        """Check the names and values against the algorithm's schema: construct nothing, communicate nothing."""
        values = self.for_algorithm(name).algorithm_hyperparameters(name)
        if name == DDP:
            from .ddp import hyperparameter_names

            unknown = sorted(set(values) - set(hyperparameter_names()))
            if unknown:
                raise UsageError(
                    f"{name} has no hyperparameter {', '.join(map(repr, unknown))}; it takes {', '.join(sorted(hyperparameter_names()))}"
                )
            return
        from ..algorithms import algorithm_class

        schema = algorithm_class(name).schema
        try:
            schema.check_names(values, what=name)
        except TypeError as err:
            raise UsageError(str(err)) from None
        try:
            schema.validate(values, what=name)
        except (TypeError, ValueError) as err:
            raise UsageError(f"{name}: {err}") from None


def survival_refusal(name: str) -> Optional[str]:
    """Why ``name`` cannot go on without a lost rank (its class's ``survival_refusal``; the ddp baseline's own); None: it can."""
    if name == DDP:
        return "torch DDP's gloo process group ends with a lost rank"
    from ..algorithms import algorithm_class

    return algorithm_class(name).survival_refusal


def islands_refusal(name: str) -> Optional[str]:
    """Why ``name`` takes no islands (its class's ``islands_refusal``; the ddp baseline's own reason); None: it takes them."""
    if name == DDP:
        return "the baseline is data-parallel over every rank already (sgd --islands is that, its exchange sharded between nodes)"
    from ..algorithms import algorithm_class

    return algorithm_class(name).islands_refusal


def agree_or_fail(world: "Comm", what: Optional[str], fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if it fails on any, raise the same :class:`UsageError` on every rank (collective).

    For the steps before training that involve no communication (reading
    settings, checking paths, reading data): a rank failing alone (a folder
    missing on one node) must not leave the others waiting in the next
    collective.  ``what`` prefixes the message.
    """

    def error(failures: List["Failure"], own: Optional[BaseException]) -> BaseException:
        where = "" if len(failures) == world.size else f" (on rank{'s' if len(failures) > 1 else ''} {', '.join(str(f.rank) for f in failures)})"
        return UsageError(f"{what + ': ' if what else ''}{failures[0].message}{where}")

    caught = (UsageError, OSError, ValueError, TypeError)  # a DatasetError is a ValueError
    return world.decide(fn, what or "settings", catch=caught, error=error)


def _positive(name: str, value: Any, integer: bool = False) -> None:
    if value is None:
        return
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise UsageError(f"{name} must be {kind}, got {value!r}")
