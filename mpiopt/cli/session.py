"""What ``train`` and ``compare`` share: the output folder, the settings printout, data, and the closing report."""

from __future__ import annotations

import dataclasses
import os
import textwrap
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..comm import Comm, Topology
from ..training.config import TrainConfig, UsageError, agree_or_fail
from ..training.flags import command_settings, config_from_args, dump_toml


@dataclass
class Session:
    """A started run: its communicators, its data and its output folder (the same on every rank)."""

    topology: Topology
    dataset: Any
    out: str
    command: str
    started: float
    #: The settings to save as ``OUT/config.toml`` once a resumed run has started (by rank 0; None: saved already).
    pending_settings: Optional[str] = None
    #: The ranks the session started with (``--on-failure shrink`` may end it with fewer).
    ranks_at_start: int = 0
    #: The intercommunicators to the jobs a respawn joined (:mod:`.respawn`), disconnected at the end.
    links: List[Any] = dataclasses.field(default_factory=list)
    #: Where the next run's wall time counts from (``time.perf_counter()``; None: its first step): after a respawn,
    #: the survivors' checkpoint (a replacement: its join), so that the join is counted as the loss's price.
    counted_since: Optional[float] = None

    @property
    def rank(self) -> int:
        return self.topology.rank

    def to_the_end(self, body: Callable[[], None], interrupted: Callable[[Any], str]) -> int:
        """``body()`` (the command's runs and its report) on every rank, its endings as the command's exit code: 0; after a
        stop signal ``EXIT_INTERRUPTED``, ``interrupted(stop)`` said after it; 1 where an asynchronous server was lost
        (every survivor said so); on a rank whose island left the run, 0 (1 where no island went on).  After these
        endings, the links to a respawn's jobs are closed (before MPI finalizes); any other exception goes on up
        without closing them, to the abort hook: closing is collective, and the other ranks would never reach it."""
        from ..asyncrt import ServerLost
        from ..comm import IslandLeft
        from ..training.checkpointing import EXIT_INTERRUPTED, Interrupted

        code = 0
        try:
            body()
        except Interrupted as stop:
            self.say(f"\n{stop}; {interrupted(stop)}")
            code = EXIT_INTERRUPTED
        except ServerLost:
            code = 1
        except IslandLeft as left:
            code = 0 if left.size else 1
        if self.links:
            from ..comm.joining import disconnect

            self.topology.Free()
            disconnect(self.links)
            self.links.clear()
        return code

    def save_settings(self) -> None:
        """Write the settings held back for a resume, now that it was accepted (on every rank; rank 0 writes)."""
        if self.pending_settings is not None and self.rank == 0:
            with open(os.path.join(self.out, "config.toml"), "w") as handle:
                handle.write(self.pending_settings)
        self.pending_settings = None

    def say(self, text: str = "") -> None:
        """Print on rank 0 only."""
        if self.rank == 0:
            print(text, flush=True)

    def finish(
        self, paths: Sequence[Optional[str]], config: TrainConfig,
        groups: Optional[Sequence[Sequence[Optional[str]]]] = None, extra: str = "",
    ) -> None:
        """On rank 0: the table of results, the figures, and where everything is.

        ``groups``: the paths again, one list per algorithm of its repeats
        (``compare --repeats``): the table then shows medians and ranges.
        ``extra``: Markdown appended to results.md (``compare --sweep``'s choices).
        """
        if self.rank == 0:
            from ..metrics import read_metrics
            from ..metrics.summary import world_over_time
            from .plot import write_report

            read = {p: read_metrics(p) for p in paths if p}
            runs = list(read.values())
            heading = f"# mpiopt {self.command}: {config.dataset}/{config.model}, {self.ranks_at_start} ranks"
            if self.topology.size != self.ranks_at_start:
                heading += f" ({self.topology.size} after a lost rank: 'World size over time' says when)"
            changed = [f"- {run.algorithm}: {sizes}" for run in runs for sizes in [world_over_time(run)] if sizes]
            if changed:  # lost ranks, replacements, resumes at another size
                extra = "World size over time:\n" + "\n".join(changed) + "\n" + (f"\n{extra}" if extra else "")
            repeated = None
            if groups is not None:
                repeated = [[read[p] for p in g if p] for g in groups]
                repeated = [g for g in repeated if g]
                heading += f", {len(groups[0])} repeats per algorithm (seeds {config.seed}-{config.seed + len(groups[0]) - 1}): median (min-max)"
            table, results, figures = write_report(runs, self.out, config.target_accuracy, heading, groups=repeated,
                                                   target_loss=config.target_loss, baseline="ddp" if any(r.algorithm == "ddp" for r in runs) else None)
            if extra:
                with open(results, "a") as handle:
                    handle.write(f"\n{extra}")
                print()
                print(extra.rstrip())
            print()
            print(table)
            print()
            print(f"results: {results}")
            for path in figures:
                print(f"figure:  {path}")
            for path in paths:
                print(f"metrics: {path}")
            print(f"done in {time.perf_counter() - self.started:.1f} s")
        self.topology.world.Barrier(sleeping=True)  # the others wait out rank 0's report without taking its cores


def _settings_summary(settings: Dict[str, Any]) -> str:
    """The settings as a few indented lines: the plain ones wrapped, then one line of hyperparameters per algorithm."""
    shown = {key: ",".join(value) if isinstance(value, list) else value for key, value in settings.items()}
    plain = ", ".join(f"{key}={value}" for key, value in shown.items() if value is not None and not isinstance(value, dict))
    lines = textwrap.wrap(plain, width=100, initial_indent="  ", subsequent_indent="  ", break_long_words=False)  # a name stays whole
    optimizer = settings.get("optimizer")
    shared = ", ".join(f"{key}={value}" for key, value in settings["hyperparameters"].items() if not isinstance(value, dict))
    if shared:
        lines.append(f"  every algorithm: {shared}")
    for name, hyper in settings["hyperparameters"].items():
        if isinstance(hyper, dict):
            values = ", ".join(f"{key}={value}" for key, value in hyper.items())
            default = "its defaults" + (", with --lr" if name == optimizer else "")
            lines.append(f"  {'--optimizer ' if name == optimizer else ''}{name}: {values or default}")
    return "\n".join(lines)


def _hyperparameter_tables(config: TrainConfig, algorithms: List[str]) -> Dict[str, Any]:
    """``config.toml``'s ``[hyperparameters]``: each algorithm's values, and the ``--optimizer``'s keywords as its table."""
    tables: Dict[str, Any] = {name: config.algorithm_hyperparameters(name) for name in algorithms}
    if config.optimizer:
        from ..training.optimizers import optimizer_keywords

        if config.optimizer in tables:  # --optimizer sgd beside the sgd algorithm: its values are the shared ones alone
            tables.update(tables.pop(config.optimizer))
        tables[config.optimizer] = optimizer_keywords(config)
    return tables


def read_settings(args: Any, command: str) -> "tuple[TrainConfig, List[str]]":
    """The command's settings, read and checked on every rank and agreed (a collective call).

    A check that fails on some ranks only (a folder missing on one node, a GPU
    missing for ``--device cuda``) fails on every rank with the same message,
    before any rank waits in a collective of the run.
    """
    check = Comm(name="settings")
    try:
        config, algorithms = agree_or_fail(check, None, lambda: config_from_args(args, command))
        from ..training.device import choose_device, cuda_view  # torch: not for --help

        device = choose_device(config.device, config.precision, config.share_gpus, check)  # --device cuda without a GPU: refused here
        if check.rank == 0 and device == "cpu" and config.device == "auto" and cuda_view().count:
            print("--device auto: more ranks on this node than GPUs for them: every rank trains on the CPU "
                  "(--device cuda --share-gpus shares the GPUs)", flush=True)
        return config, algorithms
    finally:
        check.Free()


def start_session(config: TrainConfig, command: str, algorithms: List[str]) -> Session:
    """Create the topology, agree on the output folder, print and save the settings, load the data."""
    from ..training.data import load_data

    started = time.perf_counter()
    try:  # the settings are agreed: every rank refuses alike
        topology = Topology(group_size=config.group_size, on_failure=config.topology_on_failure)
    except ValueError as error:
        raise UsageError(str(error)) from None
    world = topology.world
    out = config.out or world.bcast_obj(os.path.join("runs", time.strftime(f"{command}-%Y%m%d-%H%M%S")) if world.rank == 0 else None)
    config.out = out
    session = Session(topology, None, out, command, started, ranks_at_start=topology.size)
    if world.rank == 0:
        os.makedirs(out, exist_ok=True)
    # Held on every rank: whichever is rank 0 once a resume is accepted (rank 0 may be lost first) writes them.
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k in command_settings(command)}
    if command == "compare":
        settings["algorithms"] = algorithms
    settings["hyperparameters"] = _hyperparameter_tables(config, algorithms)
    session.pending_settings = dump_toml(settings)
    if config.resume is None:  # a refused resume must leave the run's own settings file as it was
        session.save_settings()
    if world.rank == 0:
        when = "" if config.resume is None else " once the checkpoint is accepted"
        groups = f"{topology.num_groups} group{'s' if topology.num_groups > 1 else ''}"
        if config.islands:
            groups = f"{topology.num_groups} island{'s' if topology.num_groups > 1 else ''} (--islands: each group one worker)"
            per_rank = [name for name in algorithms if not config.islands_for(name)]
            if per_rank and len(algorithms) > 1:
                verb = "takes" if len(per_rank) == 1 else "take"
                groups += f"; {', '.join(per_rank)} {verb} no islands and run{'s' if len(per_rank) == 1 else ''} one worker per rank"
        print(f"mpiopt {command}: {world.size} rank{'s' if world.size > 1 else ''} in {groups}; settings (saved as {out}/config.toml{when}):")
        print(_settings_summary(settings), flush=True)
    session.dataset = load_data(config, world)
    if world.rank == 0:
        print(f"data: {session.dataset.description}\n", flush=True)
    return session
