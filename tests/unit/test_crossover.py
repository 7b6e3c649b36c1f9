"""The crossover experiment's tuning grid: every variant tuned alike, and a grid that grows past an edge that wins."""

from __future__ import annotations

import pytest

import json

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
