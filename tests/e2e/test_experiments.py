"""``mpiopt experiment``: every experiment end to end at --quick sizes under mpiexec, --list, and the rank check."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from mpiopt.experiments import EXPERIMENTS, experiment_module

from .launch import ROOT, emulated_cluster_unavailable, mpiexec, run_mpi

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

# What these tests check does not depend on the MPI library: CI runs them under MPICH only (.ci/run).
pytestmark = pytest.mark.one_mpi

COMMAND = ["-m", "mpiopt", "experiment"]


def _png(path) -> bool:
    """A PNG file of a real figure (a blank canvas compresses to far less)."""
    with open(path, "rb") as handle:
        return handle.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000


def run_quick(name, tmp_path) -> dict:
    """Run experiment ``name`` with --quick at its rank count; check its files; return results.json."""
    out = tmp_path / name
    code, output, _ = run_mpi(EXPERIMENTS[name].ranks, [*COMMAND, name, "--quick", "--out", str(out)], timeout=300)
    assert code == 0, output
    document = json.loads((out / "results.json").read_text())
    assert document["experiment"] == name and document["quick"] is True
    assert document["figures"] and all(f.startswith(f"results-{name}-") for f in document["figures"])
    for figure in document["figures"]:
        assert _png(out / figure), figure
    assert (out / "results.md").read_text().startswith(f"# mpiopt experiment {name} --quick")
    return document


def by_algorithm(rows):
    return {row["algorithm"]: row for row in rows}


def test_list_and_help_name_every_experiment_with_its_ranks():
    code, listed, _ = run_mpi(1, [*COMMAND, "--list"], timeout=120)
    assert code == 0, listed
    code, helped, _ = run_mpi(1, [*COMMAND, "--help"], timeout=120)
    assert code == 0, helped
    for name, experiment in EXPERIMENTS.items():
        assert experiment_module(name).RANKS == experiment.ranks
        if experiment.launches:  # it starts its own jobs of experiment.ranks ranks
            assert f"python -m mpiopt experiment {name}   (as root: it starts {experiment.ranks}-rank jobs" in listed
            assert f"{name} (python, as root)" in " ".join(helped.split())
            continue
        assert f"mpiexec -n {experiment.ranks} python -m mpiopt experiment {name}" in listed
        assert f"{name} ({experiment.ranks} ranks)" in " ".join(helped.split())


def test_wrong_rank_count_and_unknown_name_are_usage_errors():
    code, output, _ = run_mpi(1, [*COMMAND, "lsgd", "--quick"], timeout=120)
    assert code == 2 and "experiment lsgd needs 4 ranks, got 1" in output, output
    code, output, _ = run_mpi(1, [*COMMAND, "nosuch"], timeout=120)
    assert code == 2 and "unknown experiment 'nosuch'" in output, output


def test_lsgd(tmp_path):
    numbers = run_quick("lsgd", tmp_path)["numbers"]
    image = by_algorithm(numbers["image"])
    assert set(image) == {"sgd", "easgd", "lsgd"} and all(row["steps"] == 20 for row in image.values())
    # sgd Allreduces every step; LSGD Bcasts a leader every period (4 steps): far fewer bytes.
    assert image["lsgd"]["bytes_sent_per_rank"] < image["sgd"]["bytes_sent_per_rank"] / 2
    symmetry = numbers["symmetry"]
    # Mirror-image starts: EASGD's centre sits at the maximum 0 (gradient 0, Hessian -4 I) ...
    assert symmetry["easgd_centre_gradient_norm"] < 1e-9 and symmetry["easgd_centre_min_hessian_eigenvalue"] == pytest.approx(-4.0)
    # ... while LSGD's workers leave it downhill, with one leader or two groups.
    for label in ("LSGD, one group", "LSGD, 2 groups of 2"):
        assert max(symmetry[label]["workers_loss"]) < symmetry["easgd_centre_loss"] == pytest.approx(2.0)


def test_dasgd(tmp_path):
    numbers = run_quick("dasgd", tmp_path)["numbers"]
    image = by_algorithm(numbers["image"])
    assert image["dasgd"]["bytes_sent_per_rank"] < image["sgd"]["bytes_sent_per_rank"] / 2  # an average every 4 steps
    # The trace saw DaSGD's Iallreduce in flight on both ranks: fractions, not NaN.
    for key in ("behind_compute", "behind_any_phase"):
        assert len(numbers["overlap"][key]) == 2 and all(0.0 <= v <= 1.0 for v in numbers["overlap"][key])
    assert all(math.isfinite(v) for v in numbers["final_loss"].values())
    # Each run's own trace: DaSGD's (the experiment's --trace) and SGD's in its folder, not one over the other.
    # sgd overlaps its exchange with backward by default (an Iallreduce of buckets every step); DaSGD starts one
    # every 4 steps and keeps no other world collective in its steps.
    spans = {
        name: [e["name"] for e in json.loads((tmp_path / "dasgd" / name / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
        for name in ("sgd", "dasgd")
    }
    assert 0 < spans["dasgd"].count("world.Iallreduce") < spans["sgd"].count("world.Iallreduce") / 2


def test_signum(tmp_path):
    numbers = run_quick("signum", tmp_path)["numbers"]
    image = by_algorithm(numbers["image"])
    # Packed signs against float32: 32x fewer bytes in theory, at least 10x here.
    assert image["signum"]["bytes_sent_per_rank"] * 10 < image["sgd"]["bytes_sent_per_rank"]
    final, start = numbers["byzantine_final_excess"], numbers["byzantine_start_excess"]
    assert set(final["signum"]) == set(final["sgd"]) == {"0", "1", "2", "3"}
    assert final["signum"]["0"] < start and final["sgd"]["0"] < start  # honest workers make progress
    assert final["sgd"]["1"] > start  # one adversary sending -10 g drives SGD's average uphill


def test_topk(tmp_path):
    numbers = run_quick("topk", tmp_path)["numbers"]
    image = by_algorithm(numbers["image"])
    for name in ("topk", "regtopk"):  # density 0.01: about 8k bytes per 1k parameters instead of 4k per parameter
        assert image[name]["bytes_sent_per_rank"] * 20 < image["sgd"]["bytes_sent_per_rank"]
    linreg = numbers["linreg"]
    assert linreg["k"] == {"0.7": 70}
    assert all(0 < v < linreg["start"] for v in [*linreg["topk_median_last_quarter"].values(), *linreg["regtopk_median_last_quarter"].values()])


def test_async(tmp_path):
    numbers = run_quick("async", tmp_path)["numbers"]
    grid = numbers["grid"]
    assert grid["delays"] == [0, 8] and grid["momenta"] == [0.0, 0.9] and len(grid["status"]) == 2
    straggler = numbers["straggler"]
    sync = straggler["sgd"]["gradients_per_rank"]
    assert len(set(sync)) == 1 and sync[0] > 0  # lockstep: every rank as many as the slow one
    for name in ("async_msgd", "async_lsgd"):
        counts = straggler[name]["gradients_per_rank"]
        assert counts[0] == 0 and min(counts[1:]) > 0  # rank 0 serves, every worker contributed
        assert 0.0 <= straggler[name]["test_accuracy"] <= 1.0


def test_diloco(tmp_path):
    numbers = run_quick("diloco", tmp_path)["numbers"]
    runs = {row["label"]: row for row in numbers["runs"]}
    assert {row["ranks"] for row in runs.values()} == {2, 4} and len(runs) == 14
    # One Allreduce of the parameters every H steps against sgd's gradient every step: exactly H times fewer bytes
    # (20 steps, every H of the quick sweep divides them), at 4 ranks and at 2.
    for suffix, sgd in (("", runs["sgd"]), (", 2 ranks", runs["sgd, 2 ranks"])):
        for period in (1, 2, 5, 10):
            assert runs[f"diloco H={period}{suffix}"]["bytes_per_rank"] * period == sgd["bytes_per_rank"]
    # Streaming at H = 5 with 4 fragments: the same total as diloco at H = 5, the busiest step a quarter of its.
    streaming, diloco = runs["streaming_diloco H=5 F=4"], runs["diloco H=5"]
    assert streaming["bytes_per_rank"] == diloco["bytes_per_rank"]
    assert streaming["peak_bytes_per_step"] * 3 < diloco["peak_bytes_per_step"] <= streaming["peak_bytes_per_step"] * 4 + 16
    assert numbers["streaming_peak_ratio"] == pytest.approx(diloco["peak_bytes_per_step"] / streaming["peak_bytes_per_step"])
    assert all(math.isfinite(row["test_loss"]) and 0.0 <= row["test_accuracy"] <= 1.0 for row in runs.values())


def test_codecs(tmp_path):
    """Every codec's bytes per outer step are its payload's (float32 diloco's: 4d), sparseloco's are topk's; the goals are judged."""
    from mpiopt import codecs

    document = run_quick("codecs", tmp_path)
    d, rows = document["settings"]["parameters"], {r["label"]: r for r in document["numbers"]["runs"]}
    assert rows["diloco none"]["bytes_per_outer_step"] == 4 * d == rows["sgd (data-parallel)"]["bytes_per_outer_step"]
    for name in ("bf16", "int8", "int4", "fp4", "sign", "topk"):
        assert rows[f"diloco {name}"]["bytes_per_outer_step"] == codecs.create(name).payload_nbytes(d), name
    assert rows["sparseloco"]["bytes_per_outer_step"] == rows["diloco topk"]["bytes_per_outer_step"]
    goals = document["numbers"]["goals"]
    assert goals["int8 bytes"]["met"] and goals["fp4 bytes"]["met"] and set(goals) >= {"bf16 loss", "sparseloco loss"}
    assert all(math.isfinite(r["test_loss"]) for r in rows.values())


CLUSTER_WHY_NOT = emulated_cluster_unavailable()


@pytest.mark.skipif(bool(CLUSTER_WHY_NOT), reason=CLUSTER_WHY_NOT or "runs")
def test_crossover_measures_each_rate_models_it_and_resumes(tmp_path):
    """2 rates x 3 variants on the emulated cluster: tuned, trained, calibrated and reported; a rerun trains only what is missing."""
    from mpiopt.experiments.crossover import QUICK
    from mpiopt.metrics import read_metrics

    out = tmp_path / "crossover"
    command = [sys.executable, "-m", "mpiopt", "experiment", "crossover", "--quick", "--out", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=os.path.dirname(mpiexec()) + os.pathsep + os.environ.get("PATH", ""))
    first = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, cwd=ROOT, env=env)
    assert first.returncode == 0, first.stdout[-4000:]
    document = json.loads((out / "results.json").read_text())
    rows = document["numbers"]["rows"]
    assert {(r["rate"], r["label"]) for r in rows} == {(rate, v.label) for rate in QUICK["rates"] for v in QUICK["variants"]}
    for r in rows:
        assert r["measured_step"] > 0 and r["predicted_step"] >= r["compute_step"] > 0, r
        assert r["predicted_step"] / r["measured_step"] - 1 == pytest.approx(r["model_error"])
    slow, fast = (next(r for r in rows if r["rate"] == rate and r["label"] == "sgd") for rate in ("100mbit", "1gbit"))
    assert slow["predicted_comm"] > fast["predicted_comm"] > 0  # a tenth of the rate: more time on the wire
    assert slow["final_loss"] == fast["final_loss"]  # the same seed trains the same steps at any rate
    # ... so the slower rate's runs are evaluated once, at their end, and take the first rate's evaluations.
    assert [e["step"] for e in read_metrics(out / "100mbit" / "sgd" / "seed0" / "metrics.jsonl").evals] == [QUICK["steps"]]
    assert slow["steps_to_target_seeds"] == fast["steps_to_target_seeds"]
    markdown = (out / "results.md").read_text()
    assert (out / "results-crossover-map.png").stat().st_size > 0 and "Goals" in markdown
    assert "| variant | fabric | node: this machine's (" in markdown  # the islands' projection by the node's links
    assert document["settings"]["burst_bytes"] == {"1gbit": 625_000, "100mbit": 62_500}  # 5 ms of each line
    islands = {r["rate"]: r for r in rows if r["label"] == "diloco-islands"}
    twin = {r["rate"]: r for r in rows if r["label"] == "diloco"}
    for rate, r in islands.items():  # 2 workers of 2 ranks: half the bytes across the link per exchange, the rest within
        assert r["link_bytes_per_rank"] == pytest.approx(twin[rate]["link_bytes_per_rank"] / 2, rel=0.02)
        assert r["bytes_per_rank"] > r["link_bytes_per_rank"] > 0
    goals = document["numbers"]["goals"]
    assert any(goal.startswith("across the link an island variant") for goal in goals)
    modelled = goals["model step time within 25% of measured, every island variant and rate"]  # the islands' own
    worst = max(islands.values(), key=lambda r: abs(r["model_error"]))
    assert modelled == {"measured": f"worst diloco-islands at {worst['rate']}: {worst['model_error']:+.0%}",
                        "met": abs(worst["model_error"]) <= 0.25}
    # Interrupted after all but one run: the same command trains that one and writes the same report around it.
    os.remove(out / "1gbit" / "diloco" / "seed0" / "complete.json")
    again = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, cwd=ROOT, env=env)
    assert again.returncode == 0, again.stdout[-4000:]
    n = len(QUICK["variants"])  # sgd, diloco, and diloco with islands
    assert f"[main-1gbit]: {n - 1} of {n} runs already done, 1 to go" in again.stdout
    assert f"[tuning-1]: all {n} runs already done" in again.stdout and f"[main-100mbit]: all {n} runs already done" in again.stdout
    rerun = {(r["rate"], r["label"]): r for r in json.loads((out / "results.json").read_text())["numbers"]["rows"]}
    assert rerun[("1gbit", "diloco")]["final_loss"] == next(r for r in rows if r["rate"] == "1gbit" and r["label"] == "diloco")["final_loss"]


def test_a_crossover_run_at_a_slower_rate_takes_its_reference_runs_evaluations_at_its_own_times(tmp_path):
    """A timed run with a reference (the same run at a faster rate) is evaluated once, at its end, and takes the
    reference's evaluations: what it would have recorded itself, to the bit, save the wall time of its own steps.
    A run that does not repeat its reference's steps (another seed) is trained again and evaluated on its own."""
    import dataclasses

    from mpiopt.experiments.crossover_job import COMPLETE, timed_metrics, with_reference_evaluations
    from mpiopt.metrics import read_metrics

    task = dict(dataset="synthetic", batch_size=16, eval_every=2, target_loss=2.28, log_every=2)
    base = dict(label="diloco", algorithm="diloco", hyperparameters={}, point={"lr": 0.05, "period": 2}, steps=8, tuning=False)
    folders = {name: str(tmp_path / name) for name in ("reference", "slow", "again", "other")}
    runs = [dict(base, folder=folders["reference"], seed=0), dict(base, folder=folders["slow"], seed=0, reference=folders["reference"]),
            dict(base, folder=folders["again"], seed=0), dict(base, folder=folders["other"], seed=1, reference=folders["reference"])]
    (tmp_path / "job.json").write_text(json.dumps({"tag": "[t]", "task": task, "runs": runs}))
    code, output, _ = run_mpi(2, ["-m", "mpiopt.experiments.crossover_job", str(tmp_path / "job.json")], timeout=300)
    assert code == 0, output
    done = {name: json.loads((tmp_path / name / COMPLETE).read_text()) for name in folders}
    own = {name: read_metrics(tmp_path / name / "metrics.jsonl") for name in folders}
    assert [e["step"] for e in own["slow"].evals] == [8] and [e["step"] for e in own["reference"].evals] == [2, 4, 6, 8]
    taken = timed_metrics(folders["slow"], done["slow"])
    assert [e["test_loss"] for e in taken.evals] == [e["test_loss"] for e in own["reference"].evals]
    assert [e["wall_seconds"] for e in taken.evals] == [r["wall_seconds"] for r in own["slow"].steps if r["step"] % 2 == 0]
    assert done["slow"]["summary"]["steps_to_target"] == done["reference"]["summary"]["steps_to_target"] == 6
    assert done["slow"]["summary"]["time_to_target"] == own["slow"].steps[5]["wall_seconds"]  # its own time to step 6
    # The run evaluated on its own ("again"), cut to its last evaluation, gets back every field it recorded.
    cut = dataclasses.replace(own["again"], evals=own["again"].evals[-1:])
    rebuilt = [{k: v for k, v in e.items() if k != "borrowed_from"} for e in with_reference_evaluations(cut, own["reference"]).evals]
    assert rebuilt == own["again"].evals
    assert "[t]: diloco seed 1 did not repeat its reference run (step 1: training loss" in output, output
    assert done["other"]["evaluated"] == "own" and [e["step"] for e in own["other"].evals] == [2, 4, 6, 8]
    assert timed_metrics(folders["other"], done["other"]).evals == own["other"].evals


def test_crossover_refuses_to_run_under_mpiexec():
    code, output, _ = run_mpi(2, ["-m", "mpiopt", "experiment", "crossover", "--quick", "--out", "/tmp/unused"], timeout=60)
    assert code != 0 and "starts its own MPI jobs: run it with plain python" in output, output
