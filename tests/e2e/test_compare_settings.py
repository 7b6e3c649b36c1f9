"""``mpiopt compare`` checks every listed algorithm's settings before its first run: a refusal trains nothing."""

from __future__ import annotations

import pytest

from .launch import run_mpi

pytest.importorskip("torch")

TINY = ["--dataset", "synthetic", "--steps", "3", "--batch-size", "16"]


@pytest.mark.parametrize("given,working", [
    (["--hp", "lr=0.0003"], ["--lr 0.0003", "--hp adamw.lr=0.0003"]),
    (["--hp", "diloco.weight_decay=0.1"], ["--hp adamw.weight_decay=0.1"]),
])
def test_a_setting_the_optimizer_replaces_is_refused_before_the_first_run_naming_the_flag_that_works(tmp_path, given, working):
    """The issue's command trained ddp for a minute, then ended at sgd naming neither --lr nor --hp adamw.lr."""
    out = tmp_path / "cmp"
    args = ["-m", "mpiopt", "compare", "--optimizer", "adamw", *given, "--algorithms", "ddp,sgd,diloco", *TINY, "--out", str(out)]
    code, output, _ = run_mpi(2, args, timeout=120)
    assert code == 2, output
    assert output.count("mpiopt compare: error: --optimizer adamw replaces the built-in update") == 1, output  # rank 0 says it once
    for flag in working:
        assert flag in output, output
    assert "== 1/3" not in output and "step 1/3" not in output, output  # no run started
    assert not out.exists(), sorted(str(p) for p in out.rglob("*"))  # no run folder, no metrics
    assert "Traceback" not in output, output
