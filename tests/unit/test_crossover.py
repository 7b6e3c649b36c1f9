"""The crossover experiment's tuning grid: every variant tuned alike, and a grid that grows past an edge that wins."""

from __future__ import annotations

import pytest

from mpiopt.experiments.crossover import ADAMW_RATES, EXTENSIONS, FULL, Variant, extended, grid, point_name


def test_every_variant_is_tuned_over_the_same_grid_of_its_kind():
    variants = FULL["variants"]
    assert [v.label for v in variants][:2] == ["ddp", "sgd"]
    assert {"sgd", "dasgd", "lsgd", "diloco", "streaming_diloco", "sparseloco", "diloco-int8", "signum", "topk"} <= {v.label for v in variants}
    for v in variants:
        if v.algorithm != "signum":  # AdamW's rate for everyone AdamW steps; signum's own update has its own scale
            assert v.rates == ADAMW_RATES, v
    periodic = {v.label: v.periods for v in variants if v.periods != (None,)}
    assert set(periodic) == {"dasgd", "diloco", "diloco-int8", "streaming_diloco", "sparseloco"}


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
