"""Small helpers shared by the benchmark modules (each has ``add_arguments``, ``run`` and ``main``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..training.config import UsageError


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the docstring's layout and appends every flag's default to its help (lists comma-separated)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or "%(default)" in text or any(default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def build_parser(prog: str, doc: Optional[str], add_arguments: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """A parser for ``prog`` whose description is ``doc`` and whose flags come from ``add_arguments``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)
    add_arguments(parser)
    return parser


def module_main(
    name: str,
    doc: Optional[str],
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Optional[Sequence[str]],
) -> int:
    """``python -m mpiopt.bench.<name>``: parse ``argv``, run, report a :class:`UsageError` as argparse does (exit 2)."""
    parser = build_parser(f"python -m mpiopt.bench.{name}", doc, add_arguments)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as err:
        parser.error(str(err))  # exits with code 2
        raise  # pragma: no cover - parser.error does not return


def comma_list(kind: Callable[[str], Any]) -> Callable[[str], List[Any]]:
    """An argparse ``type`` for comma-separated values of ``kind`` ("1,2,4")."""
    name = getattr(kind, "__name__", "value")

    def parse(text: str) -> List[Any]:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"expected comma-separated {name}s, got {text!r}") from None

    return parse


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def count(text: str) -> int:
    """An argparse ``type``: a count >= 1 with an optional SI suffix (``4096``, ``64k``, ``11M``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    value = round(float(match.group(1)) * _COUNT_SUFFIXES[match.group(2).lower()]) if match else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 such as 4096, 64k or 11M, got {text!r}")
    return value


# tc's rate units (tc(8)): "bit" units are bits per second, "bps" units BYTES per second.
_RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
}


def parse_rate(text: str) -> float:
    """A link rate in tc's units (``1gbit``, ``100mbit``, ``125mbps`` = 125 MB/s) as bits per second; ``ValueError`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"link rate must be a number with one of tc's units ({', '.join(_RATE_UNITS)}), e.g. 1gbit; got {text!r}")
    return float(match.group(1)) * _RATE_UNITS[unit]


def slowest_seconds(topology: Any, fn: Callable[[], object], calls: int = 1) -> float:
    """The slowest rank's seconds per call of ``fn`` over ``calls`` calls (a Barrier before, a max after; neither timed)."""
    from ..comm import MAX

    topology.world.Barrier()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = np.array([(time.perf_counter() - started) / calls])
    topology.world.Allreduce(elapsed, op=MAX)
    return float(elapsed[0])


def check_choices(flag: str, given: Sequence[str], allowed: Sequence[str]) -> None:
    """Raise a :class:`UsageError` naming ``flag`` unless ``given`` is a non-empty selection from ``allowed``."""
    bad = [name for name in given if name not in allowed]
    if bad or not given:
        what = f"unknown {', '.join(map(repr, bad))}" if bad else "none given"
        raise UsageError(f"{flag}: {what}; choose from {', '.join(allowed)}")


def rotated(names: Sequence[Any], round_: int) -> List[Any]:
    """``names`` starting at position ``round_`` (mod len): interleaved rounds run every variant, in turn first."""
    shift = round_ % len(names)
    return list(names[shift:]) + list(names[:shift])


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(values) if len(values) else float("nan")


def say(rank: int) -> Callable[..., None]:
    """``print`` on rank 0 (flushed), nothing elsewhere."""
    if rank:
        return lambda *args, **kwargs: None
    return lambda *args, **kwargs: print(*args, flush=True, **kwargs)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: Optional[str] = None) -> str:
    """A Markdown table; ``align`` has one ``l`` or ``r`` per column (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, data: Dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented JSON (making its folder)."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1, default=lambda value: value.item() if hasattr(value, "item") else str(value))
        handle.write("\n")


def link_rate(given: Optional[str]) -> Optional[str]:
    """The link rate to report: ``given`` (``--link``), else ``$EMULATED_LINK_RATE``, else None.

    ``UsageError`` when ``given`` differs from the rate of the emulated link this job runs in.
    """
    emulated = os.environ.get("EMULATED_LINK_RATE")
    if given and emulated and parse_rate(given) != parse_rate(emulated):
        raise UsageError(f"--link {given} but this job runs inside tools/emulated_link.sh at RATE={emulated}")
    return given or emulated


def environment(topology: Any, link: Optional[str]) -> Dict[str, Any]:
    """What a result depends on, for the JSON: ranks, link, host, versions, date."""
    import datetime
    import platform

    from ..comm.process import host, library_version

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "world_size": topology.size,
        "link_rate": link,
        "link_bits_per_second": parse_rate(link) if link else None,
        "emulated_link": bool(os.environ.get("EMULATED_LINK_RATE")),
        "host": host(),
        "mpi": library_version(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cores": os.cpu_count(),
        "argv": sys.argv,
    }


#: Variables a launcher sets for its ranks: a job started from such a process must not inherit them...
LAUNCHER_ENV = ("PMI_", "PMIX_", "MPIR_CVAR_", "HYDRA_", "OMPI_")
#: ...but these are the user's settings for Open MPI's mpiexec, not a launcher's: run as root, MCA parameters.
USER_ENV = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_")


def child_environment() -> Dict[str, str]:
    """This process's environment for a new MPI job: without the launcher settings of the job it may be in."""
    return {k: v for k, v in os.environ.items() if k.startswith(USER_ENV) or not k.startswith(LAUNCHER_ENV)}


def repository_tool(name: str, needed_by: str) -> str:
    """``tools/<name>`` of the repository checkout this package is in; ``UsageError`` naming ``needed_by`` if absent."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools", name)
    if not os.path.exists(path):
        raise UsageError(f"{needed_by} needs tools/{name} of a repository checkout of mpiopt, not found at {path} "
                         f"(an installed package has no tools/)")
    return path


def mpiexec_path(needed_by: str) -> str:
    """The ``mpiexec`` next to this Python, else the first on PATH; ``UsageError`` naming ``needed_by`` if none."""
    import shutil

    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = local if os.path.exists(local) else shutil.which("mpiexec")
    if found is None:
        raise UsageError(f"{needed_by} needs mpiexec (next to this Python or on PATH); install the 'mpich' extra or an MPI")
    return found


def save_figure(fig: Any, path: str) -> None:
    """Write a matplotlib figure to ``path`` (making its folder) and free it."""
    import matplotlib.pyplot as plt

    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
