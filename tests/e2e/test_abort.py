"""An exception on one rank ends the whole job quickly, with its traceback."""

from __future__ import annotations

import textwrap

from .launch import run_mpi

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import mpiopt
    from mpiopt import Topology

    mpiopt.abort_on_exception()
    topo = Topology()
    if topo.rank == 1:
        raise RuntimeError("deliberate failure on rank one")
    topo.world.Allreduce(np.ones(4))  # rank 0 would wait here forever without the abort
    print("rank", topo.rank, "was not aborted")
    """
)


def test_exception_on_one_rank_aborts_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT)
    code, output, seconds = run_mpi(2, [str(script)], timeout=60)
    assert code != 0, output
    assert seconds < 30, f"took {seconds:.1f} s"
    assert "deliberate failure on rank one" in output and "Traceback" in output, output
    assert "uncaught exception on rank 1 of 2" in output, output
    assert "was not aborted" not in output


def test_cli_error_aborts_every_rank():
    # --elements smaller than the number of ranks raises on every rank; the job must still end.
    code, output, seconds = run_mpi(2, ["-m", "mpiopt", "info", "--elements", "1"], timeout=60)
    assert code != 0 and seconds < 30, output
    assert "--elements must be at least the number of ranks (2), got 1" in output, output
