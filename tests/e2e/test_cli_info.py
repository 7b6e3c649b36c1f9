"""``python -m mpiopt info``: topology, GPU-awareness and the per-collective byte table."""

from __future__ import annotations

import re

from .launch import run_mpi


def test_info_four_ranks_two_groups():
    code, output, _ = run_mpi(
        4, ["-m", "mpiopt", "info", "--group-size", "2", "--elements", "1024"], env={"MPIOPT_WAIT_POLICY": "passive"}
    )
    assert code == 0, output
    assert "4 rank(s)" in output and "GPU-aware MPI: no" in output
    # The launcher's count beside MPI's: hydra's PMI_SIZE under MPICH, OMPI_COMM_WORLD_SIZE under Open MPI.
    assert re.search(r"^launcher: 4 process\(es\), from .* \((PMI_SIZE|OMPI_COMM_WORLD_SIZE)=4\)$", output, flags=re.M), output
    rows = re.findall(r"^\| (\d) \| \S+ \| (\d) \| (\d)/(\d) \| (yes)? ?\| (\w+) \|$", output, flags=re.M)
    assert [(r[0], r[1], r[2], r[4], r[5]) for r in rows] == [
        ("0", "0", "0", "yes", "passive"), ("1", "0", "1", "", "passive"), ("2", "1", "0", "yes", "passive"), ("3", "1", "1", "", "passive"),
    ]
    # Allreduce of 1024 float32 values: 4096 bytes sent by each of the 4 ranks.
    assert re.search(r"^\| world\.Allreduce \| 4 \| 16384 \| 16384 \|", output, flags=re.M), output


def test_help_lists_commands():
    code, output, _ = run_mpi(1, ["-m", "mpiopt", "--help"])
    assert code == 0 and "info" in output
