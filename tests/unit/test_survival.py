"""Survival settings without MPI: which launches can survive a lost rank, and the test hook's spec."""

from __future__ import annotations

import pytest

from mpiopt.comm.survival import LAUNCH, FaultInjection, INJECT_ENV, ulfm_problem

OPEN_MPI = "Open MPI v5.0.11, package: Open MPI ..."
ULFM = {"OMPI_MCA_mpi_ft_enable": "true", "OMPI_MCA_btl": "tcp,self"}


def test_ulfm_launch_is_accepted():
    assert ulfm_problem(OPEN_MPI, ULFM) is None
    assert ulfm_problem(OPEN_MPI, {**ULFM, "OMPI_MCA_btl": "tcp"}) is None


@pytest.mark.parametrize("library, environ, says", [
    ("MPICH Version:      5.0.2", ULFM, "this is MPICH Version:      5.0.2"),
    (OPEN_MPI, {"OMPI_MCA_btl": "tcp,self"}, "only `mpiexec --with-ft ulfm` turns on"),
    (OPEN_MPI, {**ULFM, "OMPI_MCA_mpi_ft_enable": "0"}, "only `mpiexec --with-ft ulfm` turns on"),
    (OPEN_MPI, {"OMPI_MCA_mpi_ft_enable": "1"}, "btl is its default"),
    (OPEN_MPI, {**ULFM, "OMPI_MCA_btl": "sm,tcp,self"}, "btl is sm,tcp,self"),
    (OPEN_MPI, {**ULFM, "OMPI_MCA_btl": "^sm"}, "btl is ^sm"),
])
def test_each_launch_that_cannot_survive_is_named_with_the_fix(library, environ, says):
    problem = ulfm_problem(library, environ)
    assert says in problem and LAUNCH in problem


@pytest.mark.parametrize("spec, expected", [
    ("", set()),
    ("2@7", {(2, 7, "step")}),
    ("0@3:exchange, 1@9", {(0, 3, "exchange"), (1, 9, "step")}),
])
def test_injection_spec(monkeypatch, spec, expected):
    monkeypatch.setenv(INJECT_ENV, spec)
    hook = FaultInjection()
    assert hook.points == expected
    hook.current = 7
    hook.reached("exchange", 2)  # not an injected point: returns at once
