"""The crossover experiment: every variant tuned alike, a grid that grows past an edge that wins, and a slower rate's run
taking its reference run's evaluations only where it repeated that run to the bit."""

from __future__ import annotations

import json
import re

import pytest

from mpiopt.experiments import crossover
from mpiopt.experiments.crossover import ADAMW_RATES, EXTENSIONS, FULL, Variant, burst_bytes, extended, grid, link, point_name, run_entry


def test_every_variant_is_tuned_over_the_same_grid_of_its_kind():
    variants = FULL["variants"]
    assert [v.label for v in variants][:2] == ["ddp", "sgd"]
    assert {"sgd", "dasgd", "lsgd", "diloco", "streaming_diloco", "sparseloco", "diloco-int8", "signum", "topk"} <= {v.label for v in variants}
    for v in variants:
        if v.algorithm != "signum":  # AdamW's rate for everyone AdamW steps; signum's own update has its own scale
            assert v.rates == ADAMW_RATES, v
    periodic = {v.label: v.periods for v in variants if v.periods != (None,)}
    assert set(periodic) == {"dasgd", "lsgd", "diloco", "diloco-int8", "streaming_diloco", "sparseloco",
                             "diloco-islands", "streaming_diloco-islands", "sparseloco-islands"}
    # Each island variant is its per-rank twin with each node one worker, tuned over the same grid.
    twins = {v.label: v for v in variants}
    islands = [v for v in variants if v.islands]
    assert {v.label for v in islands} == {"diloco-islands", "streaming_diloco-islands", "sparseloco-islands", "signum-islands"}
    for v in islands:
        assert v._replace(label=v.algorithm, islands=False) == twins[v.algorithm]
    lsgd = next(v for v in variants if v.label == "lsgd")  # its global pulls are the ones that cross the link
    assert grid(lsgd.rates, lsgd.periods, lsgd.period_name)[0] == {"lr": ADAMW_RATES[0], "global_period": lsgd.periods[0]}


def test_a_grid_is_every_rate_with_every_period():
    v = Variant("diloco", "diloco", {}, (1e-3, 3e-3), (8, 16))
    points = grid(v.rates, v.periods)
    assert points == [{"lr": 1e-3, "period": 8}, {"lr": 1e-3, "period": 16}, {"lr": 3e-3, "period": 8}, {"lr": 3e-3, "period": 16}]
    assert grid((1e-3,), Variant("sgd", "sgd", {}, (1e-3,)).periods) == [{"lr": 1e-3}]
    assert point_name({"lr": 0.0003, "period": 8}) == "lr0.0003-period8"
    assert len({point_name(p) for p in points}) == len(points)


@pytest.mark.parametrize("chosen, expected", [(3e-4, 1e-4), (3e-3, 9e-3), (1e-3, None)])
def test_an_edge_that_wins_grows_the_grid_by_a_factor_of_three(chosen, expected):
    found = extended(ADAMW_RATES, chosen, grown=0, factor=3.0)
    assert found == (None if expected is None else pytest.approx(expected))


def test_the_grid_grows_a_bounded_number_of_times_and_never_from_one_value():
    assert extended(ADAMW_RATES, 3e-4, grown=EXTENSIONS, factor=3.0) is None
    assert extended((1e-3,), 1e-3, grown=0, factor=3.0) is None
    assert extended((None,), None, grown=0, factor=2) is None  # no period to tune


@pytest.mark.parametrize("chosen, expected", [(16, 32), (8, 4), (4, 2), (2, None)])
def test_a_period_at_an_edge_doubles_or_halves_and_stays_a_whole_number_of_steps_of_at_least_two(chosen, expected):
    periods = (chosen, chosen * 2) if chosen in (8, 4, 2) else (8, 16)
    assert extended(periods, chosen, grown=0, factor=2) == expected


def test_the_links_bucket_holds_five_milliseconds_of_the_line_and_at_most_one_megabyte():
    assert burst_bytes("100mbit") == 62_500  # 100e6 bit/s x 5 ms / 8
    assert burst_bytes("1gbit") == 625_000
    assert burst_bytes("10gbit") == burst_bytes("100gbit") == 1 << 20  # tools/emulated_cluster.sh's default


def test_a_timed_run_names_its_link_so_that_a_changed_shaping_trains_again_and_a_tuning_run_does_not(tmp_path):
    v = FULL["variants"][1]
    timed = run_entry(str(tmp_path), v, {"lr": 1e-3}, 0, 200, "1gbit/sgd/seed0", link("1gbit"))
    tuning = run_entry(str(tmp_path), v, {"lr": 1e-3}, 0, 100, "tuning/sgd/lr0.001")
    assert timed["link"] == {"rate": "1gbit", "burst_bytes": 625_000} and not timed["tuning"]
    assert "link" not in tuning and tuning["tuning"]


def test_a_calibration_is_redone_only_when_its_links_shaping_changed(tmp_path, monkeypatch):
    launched = []

    def fake_launch(rate, command, what):
        launched.append(rate)
        with open(command[command.index("--json") + 1], "w") as handle:
            json.dump({"benchmark": "collectives", "results": []}, handle)

    monkeypatch.setattr(crossover, "launch", fake_launch)
    path, s = str(tmp_path / "collectives.json"), dict(FULL)
    crossover.calibrate_link(path, "1gbit", 4, "allreduce", s, "calibration")
    assert json.load(open(path))["shaping"] == link("1gbit")
    crossover.calibrate_link(path, "1gbit", 4, "allreduce", s, "calibration")
    assert launched == ["1gbit"]  # kept
    monkeypatch.setattr(crossover, "BURST_SECONDS", 0.010)
    crossover.calibrate_link(path, "1gbit", 4, "allreduce", s, "calibration")
    assert launched == ["1gbit", "1gbit"]  # the bucket changed: timed again


def test_ddps_allreduce_is_priced_at_gloos_fit_and_every_other_variants_at_mpichs():
    from mpiopt.bench.collectives import GLOO_ALLREDUCE
    from mpiopt.experiments.crossover_report import _priced

    model = {"collectives": {"allreduce": {"alpha": 1e-5, "beta": 1e-9}, GLOO_ALLREDUCE: {"alpha": 1e-3, "beta": 2e-9}}}
    ddp, sgd = FULL["variants"][:2]
    assert _priced(ddp, model)["collectives"]["allreduce"] == {"alpha": 1e-3, "beta": 2e-9}
    assert _priced(sgd, model) is model
    older = {"collectives": {"allreduce": {"alpha": 1e-5, "beta": 1e-9}}}  # a calibration without gloo's timing
    assert _priced(ddp, older) is older


def test_the_lowest_loss_wins_unless_a_longer_period_at_its_rate_ties_with_it():
    from mpiopt.experiments.crossover import TIE, choose

    near = 2.7 * (1 + TIE / 2)
    scored = [(2.7, {"lr": 1e-3, "period": 4}), (near, {"lr": 1e-3, "period": 8}), (2.9, {"lr": 1e-3, "period": 16}),
              (2.7 * (1 + 2 * TIE), {"lr": 1e-3, "period": 32}), (2.69, {"lr": 3e-3, "period": 2}), (None, {"lr": 1e-2, "period": 64})]
    assert choose(scored) == {"lr": 3e-3, "period": 2}  # the lowest; no longer period at its rate ties with it
    assert choose(scored[:5]) == choose(scored) and choose(scored[:4]) == {"lr": 1e-3, "period": 8}  # a tie: the longer
    assert choose([(2.5, {"lr": 1e-3}), (2.51, {"lr": 3e-3})]) == {"lr": 1e-3}  # no period: the rate is never a tie
    assert choose([(2.5, {"lr": 1e-3, "global_period": 4}), (2.51, {"lr": 1e-3, "global_period": 16})], "global_period") == {
        "lr": 1e-3, "global_period": 16}
    assert choose([(None, {"lr": 1e-3, "period": 4}), (None, {"lr": 3e-3, "period": 8})]) == {"lr": 1e-3, "period": 4}


def _projected(compute=0.03, steps=(140, 110), d=945_000):
    """The report's projection of ddp, diloco and island diloco from made-up rows: ``steps`` to the loss per rank and
    with islands, ``compute`` seconds a step per rank."""
    from mpiopt.bench.model.costs import COLLECTIVES
    from mpiopt.experiments.crossover_report import _projection

    variants = [v for v in FULL["variants"] if v.label in ("ddp", "diloco", "diloco-islands")]
    s = dict(FULL, variants=variants)
    # the island variant's own measured computation 20 ms more: the projection takes its twin's, the same work a rank
    rows = [{"rate": "10gbit", "label": v.label, "compute_step": compute + 0.02 * v.islands, "steps_to_target": n}
            for v, n in zip(variants, (100, *steps))]
    chosen = {"ddp": {"lr": 1e-3}, "diloco": {"lr": 3e-4, "period": 64}, "diloco-islands": {"lr": 3e-4, "period": 64}}
    link = {"medium": "switched", "link_bits_per_second": 1e9, "collectives": {op: {"alpha": 1e-4, "beta": 1e-8} for op in COLLECTIVES}}
    node = dict(link, collectives={op: {"alpha": 1e-3, "beta": 1 / 2.4e9} for op in COLLECTIVES})  # 2.4 GB/s, as measured here
    return s, _projection(s, chosen, rows, link, "ddp", d, node), node


def test_the_projection_prices_the_islands_mean_at_this_machines_node_and_at_each_gpu_nodes_links():
    from mpiopt.experiments.crossover_report import HERE, PROJECTED_NODE_RATES, _island_gains

    s, projection, _ = _projected()
    assert {p["node"] for p in projection if p["label"] != "diloco-islands"} == {HERE}  # only an island's mean moves
    gains = _island_gains(s, projection)
    for rate in ("10gbit", "100gbit"):
        here, pcie, nvlink = (gains[("diloco-islands", rate, w)] for w in (HERE, *PROJECTED_NODE_RATES))
        for P, a, b, c in zip((64, 128, 256, 512, 1024), here, pcie, nvlink):
            assert a < b < c < 140 / 110 * 1.01, (rate, P)  # faster links inside, a cheaper mean: up to the steps saved
            # 450 GB/s: the mean of 3.78 MB over 8 ranks (6 hops, 2 x 7/8 of it on the wire) is 0.09 ms of a 30 ms step.
            mean = 6 * 1e-5 + 2 * 7 / 8 * 4 * 945_000 / 450e9
            isl = next(p for p in projection if p["label"] == "diloco-islands" and p["rate"] == rate and p["P"] == P
                       and p["node"] == "450gbps")
            twin = next(p for p in projection if p["label"] == "diloco" and p["rate"] == rate and p["P"] == P)
            # plus its rails' share of an exchange every 64 steps: less than the per-rank exchange of the whole vector
            assert 0 < isl["step_seconds"] - 0.03 - mean < twin["step_seconds"] - 0.03


def test_the_islands_projected_goal_is_judged_on_a_gpu_nodes_links_and_shows_this_machines_beside_them():
    from mpiopt.experiments.crossover_report import _islands_projected, _projected_verdicts

    s, projection, node = _projected()
    (goal, verdict), = _projected_verdicts(s, projection, node).items()
    assert goal.startswith("diloco-islands in the projection") and "25 GB/s or 450 GB/s" in goal and ">= 1.2x" in goal
    assert verdict["met"] and verdict["measured"].startswith("this machine's (2.4 GB/s) at least 0.98x, 25 GB/s at least 1.2")
    fewer = _projected(steps=(140, 130))  # too few steps saved: no node's links make up for it
    assert not _projected_verdicts(*fewer)[goal]["met"]
    table = _islands_projected(s, projection, node)
    assert "| diloco-islands | 10gbit |" in table and "node: 450 GB/s" in table and "node: this machine's (2.4 GB/s)" in table


def _run(losses, evals, path):
    """A metrics ``Run`` of one step per loss (5 bytes and 10 ms each) and ``evals`` as ``(step, test loss)``."""
    from mpiopt.metrics import Run

    steps = [{"step": i, "loss": loss, "bytes_sent": 5, "wall_seconds": 0.01 * i} for i, loss in enumerate(losses, 1)]
    return Run(header={}, steps=steps, evals=[{"step": s, "test_loss": t, "wall_seconds": 9.0, "bytes_sent_total": 0} for s, t in evals],
               path=path)


def test_a_run_takes_its_references_evaluations_only_where_it_repeated_the_reference_to_the_bit():
    """The borrowed evaluations carry the run's own time and bytes at their step; a differing step, a differing last
    test loss or another number of steps is refused, naming what differs."""
    from mpiopt.experiments.crossover_job import NotRepeated, with_reference_evaluations

    nan = float("nan")
    reference = _run([3.0, nan, 2.5, 2.25], [(2, 2.9), (4, 2.4)], "ref")
    taken = with_reference_evaluations(_run([3.0, nan, 2.5, 2.25], [(4, 2.4)], "slow"), reference)
    assert [(e["step"], e["test_loss"], e["wall_seconds"], e["bytes_sent_total"]) for e in taken.evals] == [(2, 2.9, 0.02, 10), (4, 2.4, 9.0, 0)]
    assert taken.evals[0]["borrowed_from"] == "ref" and "borrowed_from" not in taken.evals[1]
    for losses, evals, message in (
        ([3.0, nan, 2.5000001, 2.25], [(4, 2.4)], "step 3: training loss 2.5000001 in slow, 2.5 at step 3 in ref"),
        ([3.0, nan, 2.5, 2.25], [(4, 2.41)], "the last test loss: 2.41 at step 4 in slow, 2.4 at step 4 in ref"),
        ([3.0, nan, 2.5], [(3, 2.4)], "slow has 3 steps and 1 evaluation(s), its reference ref 4 and 2"),
    ):
        with pytest.raises(NotRepeated, match=re.escape(message)):
            with_reference_evaluations(_run(losses, evals, "slow"), reference)
