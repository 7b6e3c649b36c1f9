"""Training settings on the command line: one flag per setting of ``mpiopt train`` and ``compare``, TOML files, the help.

Precedence: :class:`~mpiopt.training.config.TrainConfig`'s defaults, then the
file given with ``--config``, then the flags.  Algorithm hyperparameters come
from ``--hp KEY=VALUE`` (``--hp lsgd.pull_local=0.2`` for one algorithm only)
or a ``[hyperparameters]`` table (for ``compare``, a sub-table per algorithm
overrides it: ``[hyperparameters.lsgd]``), and are checked against each
algorithm's schema with every other setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from typing import Any, Dict, List

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from .config import DDP, DEFAULT_EPOCHS, TEXT_TARGET_LOSS, TrainConfig, UsageError, training_defaults

__all__ = ["add_config_arguments", "config_from_args", "command_settings", "dump_toml", "hyperparameter_help", "evaluated_help"]

_HELP = {
    "algorithm": "algorithm to train with: {choices}, or ddp (the baseline: torch DistributedDataParallel on gloo, sgd's defaults)",
    "dataset": "dataset: digits (8x8 handwritten digits shipped with scikit-learn, offline), cifar10 (binary batches in --data-dir), synthetic (Gaussian clusters), text (bytes of ~4.8 MB of the Python standard library's sources, offline, last 10%% held out; with --model gpt)",
    "data_dir": "folder of the dataset files (cifar10: data_batch_1.bin..test_batch.bin; digits: digits.csv.gz, default: scikit-learn's copy; text: every .txt .md .rst .py .tex .html .csv .json .c .h file below it, UTF-8, in sorted order)",
    "model": "model: mlp (2 hidden layers of --width, default 128), cnn (2 conv layers, width 32), resnet20 (He et al., width 16), gpt (a GPT-2 style transformer over bytes, for --dataset text)",
    "width": "hidden units (mlp) or channels (cnn, resnet20's first stage); default per model",
    "n_layer": "gpt: transformer blocks (default 2)",
    "n_embd": "gpt: embedding width, divisible by --n-head (default 128)",
    "n_head": "gpt: attention heads (default 4)",
    "block_size": "gpt: tokens (bytes) of context per training and evaluation window (default 128)",
    "dropout": "dropout before the classifier head (gpt: on the embeddings, attention and residual branches)",
    "augment": "random crop (padding 4) and horizontal flip of training images (cifar10)",
    "epochs": f"passes over the training set (default {DEFAULT_EPOCHS} when --steps is not given)",
    "steps": "optimizer steps per rank, instead of --epochs (default: from --epochs)",
    "batch_size": "samples per rank per step",
    "lr": "learning rate; default per algorithm: {lr_defaults} (with --optimizer: the optimizer's; default sgd 0.05, adam and adamw 1e-3)",
    "optimizer": "the local update: a torch optimizer (sgd, adam, adamw; its keywords with --hp NAME.KEY=VALUE, e.g. --hp "
    "adamw.betas=0.9,0.95 --hp adamw.weight_decay=0.1) that steps on the exchanged gradient ({gradient_exchanging}) or takes "
    "each rank's local step before the algorithm's exchange ({model_averaging}), as each one's rule below says; the ddp "
    "baseline uses the same; {no_inner} keep their own update (default: each algorithm's built-in SGD update)",
    "no_decay_on": "with --optimizer: no weight decay on these parameters (bias, norm, or bias,norm: biases and normalisation "
    "layers; default: the optimizer's decay on every parameter)",
    "clip_grad_norm": "clip the gradient's norm to X before each step: the exchanged gradient where the algorithm exchanges one "
    "({gradient_exchanging}, ddp), else this rank's own (default: no clipping)",
    "warmup_steps": "a linear warm-up of the learning rate over N steps, then a cosine down to 0 at the last step "
    "(default: a constant rate)",
    "seed": "seed of the model's initialisation, the data order and augmentation",
    "group_size": "ranks per group (LSGD's local leaders, signum's pre-vote, an island); default: the real nodes",
    "islands": "each group (a node; --group-size emulates one) is one worker: data-parallel inside, the algorithm's "
    "exchange between the groups, sliced over each group's ranks ({islands}; compare runs the others per rank; "
    "docs/islands.md)",
    "on_failure": "what a lost rank (its process killed, its node gone) does: abort (end the job, MPI's default), "
    "shrink (the survivors redo the step without it and train on) or respawn (as shrink, then the survivors "
    "checkpoint, start a process for each lost one and all go on at the original size, compare from the run the loss "
    "broke; shrink where none can start); "
    "needs Open MPI launched as `mpiexec --with-ft ulfm --mca btl tcp,self`, any algorithm (the asynchronous "
    "ones shrink only: their server drops a lost worker; a lost server ends the run), with --islands an island "
    "that lost a rank leaves whole (its other ranks end, exit 0; under respawn a new island takes its place), no fp16 "
    "yet; docs/failures.md",
    "eval_every": "evaluate on the test split every N steps (default: 10 times per run, and at the end)",
    "target_accuracy": "test accuracy for the time-to-target and bytes-to-target columns",
    "target_loss": "test loss for those columns instead of --target-accuracy: the first evaluation at or below it (for "
    "--dataset text, where the loss is what matters; the table then shows the test loss too; default: 2.5 for --dataset "
    "text, 3.6 bits per byte; else none, the accuracy target)",
    "log_every": "plain progress line every N steps when the output is not a terminal (default: --eval-every)",
    "progress": "progress on rank 0: bar (redrawn in place), lines (plain lines, for logs), or auto: a bar when the output is a "
    "terminal (mpiexec passes output through pipes: ask for bar there)",
    "threads": "threads per rank for torch and mpiopt's C kernels (default: the machine's cores divided by the ranks on it; the kernels keep MPIOPT_NUM_THREADS when it is set)",
    "device": "where each rank trains: cuda (the GPU of its node-local rank: device r for local rank r, or the one "
    "CUDA_VISIBLE_DEVICES leaves it; refused where none is visible), cpu, or auto: cuda where every rank of the node can "
    "have a GPU of its own, else cpu (docs/gpu.md)",
    "precision": "autocast of the forward pass: fp32 (none), bf16 (bfloat16, CPU or GPU), fp16 (float16 with "
    "mpiopt.torch.GradScaler, GPU only); parameters and exchanges stay float32; a resume keeps the checkpoint's",
    "share_gpus": "let several node-local ranks share a GPU (local rank r takes device r modulo the GPUs it sees); "
    "default: more ranks on a node than GPUs is refused",
    "trace": "write every rank's phases (compute, algorithm, communication, operations in flight) to this Chrome/Perfetto trace file (default: no trace)",
    "out": "folder for everything the run writes (default: runs/<command>-<date>-<time>)",
    "checkpoint_every": "write a checkpoint every N steps and at the end (default: no checkpoints)",
    "checkpoint_dir": "folder of the checkpoints (default: OUT/checkpoints)",
    "keep_checkpoints": "checkpoints to keep (older ones are deleted)",
    "resume": "resume from this checkpoint file, or 'auto': the newest valid one in the checkpoint folder (default: start from step 0)",
    "override_hyperparameters": "on resume, let this run's hyperparameters replace the checkpoint's",
}
_FLAGS_BY_COMMAND = {
    "train": [f.name for f in dataclasses.fields(TrainConfig) if f.name != "hyperparameters"],
    "compare": [
        f.name for f in dataclasses.fields(TrainConfig)
        if f.name not in ("hyperparameters", "algorithm", "checkpoint_every", "checkpoint_dir", "keep_checkpoints", "resume",
                          "override_hyperparameters", "trace")
    ],
}


def command_settings(command: str) -> List[str]:
    """The settings ``command`` (``train`` or ``compare``) takes, as field names of :class:`TrainConfig`."""
    return list(_FLAGS_BY_COMMAND[command])


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _toml_value(text: str) -> Any:
    """``0.9`` -> 0.9, ``true`` -> True, ``"x"`` or ``x`` -> 'x'."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def add_config_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Add one flag per setting of ``command`` (``train`` or ``compare``), every default None (= not given)."""
    from ..algorithms import algorithms, available

    defaults = TrainConfig()
    starts = {cls.name: training_defaults(cls.name) for cls in algorithms()}
    roles = {key: ", ".join(cls.name for cls in algorithms() if cls.inner_role == role)
             for key, role in (("gradient_exchanging", "gradient"), ("model_averaging", "local"), ("no_inner", None))}
    roles["islands"] = ", ".join(cls.name for cls in algorithms() if cls.islands_refusal is None) + " take them"
    parser.add_argument("--config", metavar="FILE.toml", help="read settings from a TOML file (keys as below, with underscores); flags override it")
    for name in _FLAGS_BY_COMMAND[command]:
        f = next(x for x in dataclasses.fields(TrainConfig) if x.name == name)
        default = getattr(defaults, name)
        lr_defaults = ", ".join(f"{a} {h['lr']:g}" for a, h in starts.items() if "lr" in h)
        text = _HELP[name].format(choices=", ".join(available()), lr_defaults=lr_defaults, **roles)
        text += "" if default is None else f" (default: {default})"
        flag = "--" + name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else str(f.type)
        if "bool" in kind:
            parser.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=None, metavar="BOOL", help=text)
        elif "int" in kind:
            parser.add_argument(flag, type=int, default=None, metavar="N", help=text)
        elif "float" in kind:
            parser.add_argument(flag, type=float, default=None, metavar="X", help=text)
        else:
            parser.add_argument(flag, default=None, metavar=name.upper(), help=text)
    if command == "compare":
        parser.add_argument(
            "--algorithms", default=None, metavar="A,B,...",
            help=f"comma-separated algorithms to compare, one after another on the same task, seed and ranks (default: all: {','.join(available())}); "
            f"add {DDP} for the baseline torch DistributedDataParallel on gloo",
        )
    parser.epilog = hyperparameter_help()
    parser.add_argument(
        "--hp", action="append", default=[], metavar="KEY=VALUE",
        help="an algorithm hyperparameter, e.g. --hp momentum=0.9 or, for one algorithm only, --hp lsgd.pull_local=0.2 "
        "(repeatable). Defaults: each algorithm's own (listed below), except "
        + "; ".join(f"{a}: " + ", ".join(f"{k}={v}" for k, v in h.items() if k != "lr") for a, h in starts.items() if set(h) - {"lr"}),
    )


def hyperparameter_help() -> str:
    """Every algorithm's hyperparameters, from its schema: the help's epilog."""
    from ..algorithms import algorithms

    lines = [
        "hyperparameters of each algorithm (--hp KEY=VALUE, --hp ALGORITHM.KEY=VALUE, or a [hyperparameters] TOML table;",
        "the papers' defaults, and where mpiopt train starts from others, those; [per group]: a parameter group may set it;",
        "[execution]: how the work is done, not its result: it never refuses a resume). Every algorithm also takes",
        "nan_policy='raise' (a non-finite gradient ends the job) or 'skip' (every rank skips that step):",
    ]
    for cls in algorithms():
        starts = ", ".join(f"{k}={v!r}" for k, v in training_defaults(cls.name).items())
        lines.append(f"  {cls.name}" + (f" (mpiopt train starts from {starts})" if starts else "") + ":")
        lines += [f"    {line}" for line in cls.schema.help(skip=("nan_policy",))]
        rule = f"with --optimizer: {cls.inner_rule}" if cls.inner_role else f"--optimizer: refused ({cls.inner_refusal})"
        lines += textwrap.wrap(rule, width=118, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines)


def evaluated_help() -> str:
    """One line per model a run may evaluate, naming the algorithms whose class's ``evaluates`` it is (none: no line)."""
    from ..algorithms import algorithms
    from ..algorithms.base import EVALUATED_MODELS

    lines = []
    for kind, words in EVALUATED_MODELS.items():
        names = [cls.name for cls in algorithms() if cls.evaluates == kind]
        if names:
            lines.append(f"  {words}: {', '.join(names)}")
    return "\n".join(lines)


def _load_file(path: str) -> Dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"config file {path!r} is not valid TOML: {err}") from None


def config_from_args(args: argparse.Namespace, command: str) -> "tuple[TrainConfig, List[str]]":
    """Merge defaults, ``--config`` file and flags; return the config and the algorithms to run."""
    from ..algorithms import available

    values: Dict[str, Any] = {}
    allowed = set(_FLAGS_BY_COMMAND[command]) | {"hyperparameters"} | ({"algorithms"} if command == "compare" else set())
    if args.config:
        loaded = _load_file(args.config)
        unknown = sorted(set(loaded) - allowed)
        if unknown:
            raise UsageError(f"config file {args.config!r}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        values.update(loaded)
    for name in _FLAGS_BY_COMMAND[command]:
        given = getattr(args, name, None)
        if given is not None:
            values[name] = given
    hyper = values.pop("hyperparameters", {})
    if not isinstance(hyper, dict):
        raise UsageError(f"hyperparameters must be a table ([hyperparameters] with KEY = VALUE lines), got {hyper!r}")
    hyper = dict(hyper)
    for item in args.hp:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--hp takes KEY=VALUE, got {item!r}")
        target, _, leaf = key.strip().rpartition(".")
        if target:
            hyper.setdefault(target, {})[leaf] = _toml_value(text)
        else:
            hyper[leaf] = _toml_value(text)
    algorithms_text = values.pop("algorithms", None)
    if command == "compare":
        given = getattr(args, "algorithms", None) or algorithms_text
        if isinstance(given, str):
            algorithms = [a.strip() for a in given.split(",") if a.strip()]
        elif isinstance(given, list):
            algorithms = [str(a) for a in given]
        else:  # all, the baseline first; with --optimizer those that take one
            from ..algorithms import algorithm_class

            optimizer = values.get("optimizer")
            algorithms = [a for a in available() if not optimizer or algorithm_class(a).inner_role]
        if not algorithms:
            raise UsageError("--algorithms names no algorithm")
    config = TrainConfig(**values, hyperparameters=hyper)
    if config.steps is None and config.epochs is None:
        config.epochs = float(DEFAULT_EPOCHS)
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        if value is not None and f.name in ("epochs", "dropout", "target_accuracy", "target_loss", "lr", "clip_grad_norm") and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, f.name, float(value))  # TOML's 1 where 1.0 was meant
    if config.dataset == "text" and config.target_loss is None:
        config.target_loss = TEXT_TARGET_LOSS  # a language model's target is a loss, not the next byte's accuracy
    if command == "train":
        algorithms = [config.algorithm]
    config.validate(algorithms)
    from .optimizers import check_replaced_settings  # torch: not for --help

    check_replaced_settings(config, algorithms)  # every run's, before the first one starts
    return config, algorithms


def dump_toml(values: Dict[str, Any]) -> str:
    """A TOML document for flat settings and (nested) tables of plain values; None is left out."""
    lines, tables = [], []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_toml_literal(value)}")
    for key, table in tables:
        plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        if plain or not nested:
            lines += ["", f"[{key}]"] + [f"{k} = {_toml_literal(v)}" for k, v in plain.items() if v is not None]
        for sub, subtable in nested.items():
            lines += ["", f"[{key}.{sub}]"] + [f"{k} = {_toml_literal(v)}" for k, v in subtable.items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
