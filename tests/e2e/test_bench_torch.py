"""``python -m mpiopt.bench.torch_overhead`` at a tiny size: it runs at 2 ranks and reports the ratio."""

from __future__ import annotations

import math
import re

import pytest

from mpiopt.bench.torch_overhead import layer_shapes, resnet18_shapes

from .launch import run_mpi

# What these tests check does not depend on the MPI library: CI runs them under MPICH only (.ci/run).
pytestmark = pytest.mark.one_mpi


def test_resnet18_shapes_total():
    # torchvision's resnet18(): 11,689,512 parameters in 62 tensors.
    assert len(resnet18_shapes()) == 62
    assert sum(math.prod(s) for s in resnet18_shapes()) == 11_689_512


def test_layer_shapes_cut_to_d():
    for d in (1, 9408, 10_000, 11_000_000, 30_000_000):
        shapes = layer_shapes(d)
        assert sum(math.prod(s) for s in shapes) == d
        assert shapes[0] == (64, 3, 7, 7) or shapes == [(d,)]


def test_tiny_run_reports_ratio():
    code, output, _ = run_mpi(2, ["-m", "mpiopt.bench.torch_overhead", "--params", "10000", "--steps", "3", "--rounds", "3"], timeout=120)
    assert code == 0, output
    assert "2 ranks, d = 10000 float32 in 4 parameter tensors" in output, output
    for label in ("flat API: alg.step(params, grad)", "torch: opt.step()", "torch: opt.zero_grad()"):
        assert re.search(rf"^\| {re.escape(label)} \| \d+\.\d\d \|", output, flags=re.M), output
    match = re.search(r"^ratio torch/flat \(median of per-round ratios\): (\d+\.\d+) \(goal <= 1\.05: (met|missed)\)$", output, flags=re.M)
    assert match, output
    assert float(match.group(1)) > 0
