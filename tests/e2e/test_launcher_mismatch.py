"""No silent world of one: processes that a launcher counts as one job but MPI starts as separate worlds stop.

Two plain ``python`` processes with a launcher's variables set and no shared MPI world are what ``srun``
without a PMI (or the ``mpiexec`` of another MPI) starts: each must exit non-zero, soon, with the message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from .launch import ROOT

LAUNCHERS = {
    "srun": lambda rank: {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": str(rank)},
    "mpiexec": lambda rank: {"PMI_SIZE": "2", "PMI_RANK": str(rank)},
}
VARIABLE = {"srun": "SLURM_STEP_NUM_TASKS", "mpiexec": "PMI_SIZE"}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_processes_without_a_shared_world_both_stop_with_the_message(launcher):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_"))}
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mpiopt", "info"], env=dict(base, PYTHONUNBUFFERED="1", **LAUNCHERS[launcher](rank)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=10 - (time.monotonic() - started))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    seconds = time.monotonic() - started
    assert seconds < 10, f"took {seconds:.1f} s"
    for p, output in zip(procs, outputs):
        assert p.returncode != 0, output
        assert f"started 2 processes ({VARIABLE[launcher]}=2), but MPI's world has 1 rank" in output, output
        assert "srun --mpi=pmi2" in output and "MPI.Get_library_version()" in output, output
        assert "mpiopt info: " not in output  # it stopped before doing anything
