"""A run's inner optimizer, its parameter groups, clipping and learning-rate schedule (``--optimizer`` and friends).

``--optimizer`` steps every synchronous algorithm that takes an inner
optimizer, and the ``ddp`` baseline, with the same torch optimizer, so they
compare on equal terms; what each flag does: docs/training-internals.md.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from .config import DDP, TrainConfig, UsageError

__all__ = ["OPTIMIZERS", "NO_DECAY", "OptimizerSettings", "check_replaced_settings", "keyword_names", "optimizer_keywords", "parse_keywords", "inner_optimizer", "schedule", "clip", "inner_state", "load_inner_state"]

#: ``--optimizer`` names and their torch classes, with the rate each starts from where ``--lr`` is not given.
OPTIMIZERS = {"sgd": (torch.optim.SGD, 0.05), "adam": (torch.optim.Adam, 1e-3), "adamw": (torch.optim.AdamW, 1e-3)}
#: ``--no-decay-on`` kinds: which parameters they name.
NO_DECAY = ("bias", "norm")
_NORMS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase)


def optimizer_keywords(config: TrainConfig) -> Dict[str, Any]:
    """``--hp NAME.KEY=VALUE``'s table of the run's ``--optimizer``, parsed (:func:`parse_keywords`)."""
    return parse_keywords(config.optimizer, config.hyperparameters.get(config.optimizer or "", {}))


def parse_keywords(optimizer: Optional[str], table: Mapping[str, Any]) -> Dict[str, Any]:
    """An optimizer's keywords as checkpoints record and ``config.toml`` saves them: ``betas=0.9,0.95`` is a list.

    So ``0.90,0.95`` and a TOML array ``[0.9, 0.95]`` are the same setting as ``0.9,0.95``.
    """
    table = dict(table)
    for key, value in table.items():
        if isinstance(value, str) and "," in value:  # betas=0.9,0.95 from the command line
            try:
                table[key] = [float(v) for v in value.split(",")]
            except ValueError:
                raise UsageError(f"--hp {optimizer}.{key}: expected numbers separated by commas, got {value!r}") from None
        elif isinstance(value, tuple):
            table[key] = list(value)
    return table


@dataclass(frozen=True)
class OptimizerSettings:
    """``--optimizer`` and its companions: what the inner optimizer is made of, and what a checkpoint records of them."""

    name: Optional[str] = None
    lr: Optional[float] = None  # the optimizer's --lr (None: its default rate)
    keywords: Dict[str, Any] = field(default_factory=dict)  # parsed (:func:`parse_keywords`)
    no_decay_on: Optional[str] = None
    clip_grad_norm: Optional[float] = None
    warmup_steps: Optional[int] = None

    @classmethod
    def of(cls, config: TrainConfig) -> "OptimizerSettings":
        """``config``'s (as one algorithm trains: :meth:`TrainConfig.for_algorithm`)."""
        return cls(config.optimizer, config.lr if config.optimizer else None, optimizer_keywords(config), config.no_decay_on,
                   config.clip_grad_norm, config.warmup_steps)

    def record(self) -> Dict[str, Any]:
        """What a checkpoint compares on resume: {} without any of them, so that such runs' checkpoints compare as before."""
        if not (self.name or self.clip_grad_norm or self.warmup_steps):
            return {}
        return {"optimizer": {"name": self.name, "keywords": self.keywords, "lr": self.lr, "no_decay_on": self.no_decay_on,
                              "clip_grad_norm": self.clip_grad_norm, "warmup_steps": self.warmup_steps}}


def check_replaced_settings(config: TrainConfig, algorithms: Sequence[str]) -> None:
    """Refuse a built-in update's setting (``lr``, momentum, ...) given to an algorithm that ``--optimizer`` steps.

    The torch front end would refuse it when that algorithm's run starts (the
    ``ddp`` baseline would ignore it); checked with the other settings, before
    the first run, the message names the flag that works.  No MPI.
    """
    from ..algorithms.local import LOCAL_SGD

    replaced: Dict[Tuple[str, str], List[str]] = {}  # (key, value as a flag takes it) -> the algorithms given it
    for name in algorithms:
        if not config.for_algorithm(name).optimizer:
            continue  # its own update (signum, the asynchronous ones) keeps these settings
        for key, value in config.given_hyperparameters(name).items():
            if name == DDP or key == "lr" or key in LOCAL_SGD:  # the baseline takes nothing beside --optimizer
                replaced.setdefault((key, _flag_value(value)), []).append(name)
    if replaced:
        fixes = [f"{key}={text} (for {', '.join(names)}): {_replacement(config.optimizer, key, text)}" for (key, text), names in replaced.items()]
        raise UsageError(f"--optimizer {config.optimizer} replaces the built-in update, and these settings with it: {'; '.join(fixes)}")


def _replacement(optimizer: str, key: str, text: str) -> str:
    """What to give instead of the built-in update's ``key=text``: the optimizer's own flag, or nothing."""
    if key == "lr":
        return f"give --lr {text} (or --hp {optimizer}.lr={text})"
    if key in keyword_names(optimizer):
        return f"give --hp {optimizer}.{key}={text}"
    return f"{optimizer} takes no {key}; leave it out"


def _flag_value(value: Any) -> str:
    """``value`` as ``--hp``/``--lr`` take it on the command line: ``true``, ``0.9,0.95``, ``0.0003``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(_flag_value(v) for v in value)
    return str(value)


def keyword_names(optimizer: str) -> List[str]:
    """The keywords ``--optimizer optimizer``'s torch class takes (``lr``, ``betas``, ...)."""
    cls, _ = OPTIMIZERS[optimizer]
    return [name for name in inspect.signature(cls.__init__).parameters if name not in ("self", "params")]


def _groups(model: torch.nn.Module, kinds: List[str], weight_decay: Optional[float]) -> List[Dict[str, Any]]:
    """The parameters in two groups: those ``kinds`` name without weight decay, the rest with the optimizer's."""
    exempt = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if ("bias" in kinds and name == "bias") or ("norm" in kinds and isinstance(module, _NORMS)):
                exempt.add(id(p))
    params = list(model.parameters())
    decayed = [p for p in params if id(p) not in exempt]
    groups = [{"params": decayed}] if decayed else []
    return groups + [{"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0}]


def inner_optimizer(settings: OptimizerSettings, model: torch.nn.Module) -> Optional[torch.optim.Optimizer]:
    """The ``--optimizer`` over ``model``'s parameters (None without one); bad keywords raise :class:`UsageError`."""
    if settings.name is None:
        return None
    cls, default_lr = OPTIMIZERS[settings.name]
    table = {key: tuple(value) if isinstance(value, list) else value for key, value in settings.keywords.items()}
    keywords = {"lr": settings.lr if settings.lr is not None else default_lr, **table}
    kinds = [k for k in (settings.no_decay_on or "").split(",") if k]
    params: Any = model.parameters() if not kinds else _groups(model, kinds, keywords.get("weight_decay"))
    try:
        return cls(params, **keywords)
    except (TypeError, ValueError) as err:
        raise UsageError(f"--optimizer {settings.name}: {err}") from None


def schedule(warmup_steps: Optional[int], optimizer: torch.optim.Optimizer, steps: int, start: int) -> Optional[Any]:
    """``--warmup-steps``' schedule on ``optimizer``'s groups, advanced to ``start`` (a resume), or None."""
    warmup = warmup_steps
    if warmup is None:
        return None

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    with warnings.catch_warnings():  # replaying a resumed run's steps calls step() before the optimizer's: meant here
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step\\(\\)", category=UserWarning)
        for _ in range(start):
            scheduler.step()
    return scheduler


def clip(max_norm: Optional[float], opt: Any, model: torch.nn.Module, synchronized: bool = False) -> None:
    """``--clip-grad-norm``: the exchanged gradient where the algorithm exchanges one, with islands the island's mean
    (``synchronize()``, unless ``synchronized`` already), else this rank's."""
    if max_norm is None:
        return
    algorithm = getattr(opt, "algorithm", None)
    if not synchronized and (getattr(algorithm, "inner_role", None) == "gradient" or getattr(algorithm, "islands", False)):
        opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def inner_state(optimizer: Optional[torch.optim.Optimizer]) -> Optional[Dict[str, Any]]:
    """The optimizer's per-parameter state as arrays (``{"p0": {"exp_avg": ...}}``), for a checkpoint."""
    if optimizer is None:
        return None
    return {
        f"p{index}": {key: np.array(value.detach().cpu().numpy() if torch.is_tensor(value) else value) for key, value in entry.items()}
        for index, entry in optimizer.state_dict()["state"].items()
    }


def load_inner_state(optimizer: Optional[torch.optim.Optimizer], saved: Optional[Mapping[str, Any]]) -> None:
    """Restore :func:`inner_state`'s arrays into ``optimizer`` (its groups stay this run's)."""
    if optimizer is None:
        return
    current = optimizer.state_dict()
    state = {int(key[1:]): {k: torch.from_numpy(np.array(v)) for k, v in entry.items()} for key, entry in (saved or {}).items()}
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
