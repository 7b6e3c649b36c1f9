"""The training CLI when something is wrong on ONE rank only: the job ends within 30 s with the message, never hangs.

Each job is launched MPMD-style (``mpiexec -n 1 A : -n 1 B``) so that rank 1
alone sees the fault: a settings check that fails on one node only, a bad
environment variable, a damaged data file.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from .launch import ROOT, mpiexec

pytest.importorskip("torch")

TRAIN = ["-m", "mpiopt", "train", "--dataset", "digits", "--steps", "4", "--batch-size", "8"]


def run_two(rank0: list, rank1: list, env1: dict = None, timeout: float = 60):
    """Rank 0 runs ``python rank0...``, rank 1 ``python rank1...`` (with ``env1`` set for rank 1 only)."""
    # Through env(1): each MPI has its own flag for one program's variables (MPICH -env, Open MPI -x).
    extra = ["env", *(f"{key}={value}" for key, value in (env1 or {}).items())]
    command = [mpiexec(), "-n", "1", sys.executable, *rank0, ":", "-n", "1", *extra, sys.executable, *rank1]
    started = time.monotonic()
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc.returncode, proc.stdout, time.monotonic() - started


def digits_folder(path, corrupt: bool = False):
    """A copy of the digits file (from the installed scikit-learn); ``corrupt`` puts NaN pixels in a few rows."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        pytest.skip("scikit-learn (the digits file) is not installed")
    source = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    rows = np.loadtxt(gzip.open(source, "rt"), delimiter=",")
    if corrupt:
        rows[:: 7, 5] = np.nan
    path.mkdir()
    with gzip.open(path / "digits.csv.gz", "wt") as handle:
        np.savetxt(handle, rows, delimiter=",", fmt="%g")
    return str(path)


def test_a_folder_missing_on_one_rank_is_one_message(tmp_path):
    good = digits_folder(tmp_path / "good")
    out = ["--out", str(tmp_path / "o")]
    code, output, seconds = run_two([*TRAIN, "--data-dir", good, *out], [*TRAIN, "--data-dir", str(tmp_path / "gone"), *out])
    assert code == 2 and seconds < 30, output
    assert output.count("is not a directory (on rank 1)") == 1, output
    assert "Traceback" not in output


def test_a_bad_environment_variable_on_one_rank_ends_the_job(tmp_path):
    out = ["--out", str(tmp_path / "o")]
    code, output, seconds = run_two([*TRAIN, *out], [*TRAIN, *out], env1={"MPIOPT_GROUP_SIZE": "zero"})
    assert code != 0 and seconds < 30, output
    assert "MPIOPT_GROUP_SIZE" in output and "zero" in output, output


def test_a_corrupt_data_file_on_one_rank_is_one_message(tmp_path):
    """A damaged copy of the data on one node (NaN pixels): refused there, reported once, every rank exits 2.

    (A non-finite gradient on one rank, which data checked like this cannot
    produce through the CLI, ends the job as tests/e2e/test_no_hang.py shows.)
    """
    good, bad = digits_folder(tmp_path / "good"), digits_folder(tmp_path / "bad", corrupt=True)
    out = ["--out", str(tmp_path / "o")]
    code, output, seconds = run_two([*TRAIN, "--data-dir", good, *out], [*TRAIN, "--data-dir", bad, *out])
    assert code == 2 and seconds < 30, output
    assert output.count("is not the digits table") == 1 and "(on rank 1)" in output, output
    assert "Traceback" not in output


def test_a_diverging_run_ends_with_the_message(tmp_path):
    """A non-finite gradient through the CLI (here every rank's at once: the data are checked, so one rank's alone
    cannot be made this way) ends the job with the rank, the step and the way out."""
    from .launch import run_mpi

    args = ["-m", "mpiopt", "train", "--algorithm", "easgd", "--lr", "1e6", "--dataset", "synthetic", "--steps", "40",
            "--out", str(tmp_path / "o")]
    code, output, seconds = run_mpi(2, args, timeout=60)
    assert code != 0 and seconds < 30, output
    assert "non-finite gradient on rank" in output and "nan_policy='skip'" in output, output
