"""``compare --sweep``'s grid: which points each algorithm trains (no MPI, no training)."""

from __future__ import annotations

import pytest

from mpiopt.cli.sweep import choose, grid, parse_sweeps
from mpiopt.training.config import UsageError


def test_shared_axes_form_a_grid_and_an_algorithms_own_axis_replaces_the_shared_one_of_its_key():
    axes = parse_sweeps(["lr=0.001,0.003", "async_msgd.lr=0.03,0.1,0.3", "lsgd.period=2,4"])
    assert grid(axes, "sgd") == [{"lr": 0.001}, {"lr": 0.003}]
    assert grid(axes, "async_msgd") == [{"lr": 0.03}, {"lr": 0.1}, {"lr": 0.3}]
    assert grid(axes, "lsgd") == [{"lr": 0.001, "period": 2}, {"lr": 0.001, "period": 4},
                                  {"lr": 0.003, "period": 2}, {"lr": 0.003, "period": 4}]
    assert grid(parse_sweeps(["lsgd.period=2"]), "sgd") == [{}]


def test_parse_reads_toml_values_and_names_a_bad_item():
    assert parse_sweeps(["streaming_diloco.alpha=0, 0.5"]) == [("streaming_diloco", "alpha", [0, 0.5])]
    with pytest.raises(UsageError, match="got 'lr'"):
        parse_sweeps(["lr"])


def test_choose_takes_the_lowest_score_and_puts_missing_and_nan_last():
    candidates = [{"score": None}, {"score": float("nan")}, {"score": 2.0}, {"score": 1.5}, {"score": 1.5, "second": True}]
    assert choose(candidates) is candidates[3]
    assert choose([{"score": None}, {"score": float("nan")}]) == {"score": None}


def test_a_tuning_run_is_short_skips_non_finite_steps_and_puts_the_rate_where_the_algorithm_takes_it():
    from mpiopt.cli.sweep import tuning_config
    from mpiopt.training.config import TrainConfig

    config = TrainConfig(epochs=3, optimizer="adamw", hyperparameters={"lsgd": {"nan_policy": "raise"}})
    sgd = tuning_config(config, "sgd", {"lr": 0.003}, 40)
    assert (sgd.steps, sgd.epochs, sgd.lr) == (40, None, 0.003)  # AdamW's rate
    assert sgd.algorithm_hyperparameters("sgd") == {"nan_policy": "skip"}
    signum = tuning_config(config, "signum", {"lr": 0.003}, 40)  # its own update: its own rate
    assert (signum.optimizer, signum.lr) == (None, None)
    assert signum.algorithm_hyperparameters("signum")["lr"] == 0.003
    assert signum.algorithm_hyperparameters("signum")["nan_policy"] == "skip"
    assert tuning_config(config, "lsgd", {}, 40).algorithm_hyperparameters("lsgd")["nan_policy"] == "raise"  # the user's
    for name in ("ddp", "async_msgd"):  # torch's own loop; skipping is collective
        assert "nan_policy" not in tuning_config(config, name, {"lr": 0.01}, 40).algorithm_hyperparameters(name)
    for name in ("sgd", "signum", "lsgd", "ddp", "async_msgd"):
        tuning_config(config, name, {"lr": 0.01}, 40).validate([name])


def test_a_synchronous_tuning_run_is_evaluated_once_at_its_end_and_an_asynchronous_one_at_its_cadence():
    """Only the last test loss scores a candidate: a synchronous one skips the evaluations before it, its progress
    lines as they were; an asynchronous run's evaluations are quiescent points that shape it, so they stay."""
    from mpiopt.cli.sweep import tuning_config
    from mpiopt.training.config import TrainConfig

    for config, lines in ((TrainConfig(eval_every=5), 5), (TrainConfig(eval_every=5, log_every=2), 2), (TrainConfig(), 4)):
        for name in ("sgd", "diloco", "ddp"):
            short = tuning_config(config, name, {"lr": 0.01}, 40)
            assert (short.eval_every, short.log_every) == (40, lines), (name, config)
    for name in ("async_msgd", "async_lsgd"):
        short = tuning_config(TrainConfig(eval_every=5), name, {"lr": 0.01}, 40)
        assert (short.eval_every, short.log_every) == (5, None)


def test_the_choice_is_scored_when_made_from_every_tuning_runs_metrics(tmp_path):
    """Rank 0 scores every candidate as it chooses, from the metrics files: a rank that took rank 0's place after a lost
    rank (compare --on-failure shrink or respawn) scores the runs before the loss too.  An algorithm that no --sweep
    key applies to is not tried and keeps its settings."""
    import json
    from types import SimpleNamespace

    from mpiopt.cli.compare import Comparison
    from mpiopt.training.config import TrainConfig

    def metrics(name, loss):
        path = tmp_path / name
        records = [{"kind": "run", "algorithm": "sgd", "task": "digits", "config": {}, "world_size": 2, "versions": {}},
                   {"kind": "eval", "step": 3, "wall_seconds": 0.1, "bytes_sent_total": 0, "test_loss": loss, "test_accuracy": 0.5}]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)

    comparison = Comparison(TrainConfig(), ["sgd", "diloco"], 1, parse_sweeps(["sgd.lr=0.05,0.1"]), 3,
                            tried={"sgd": [{"values": {"lr": 0.05}, "metrics": metrics("a", 2.5)},
                                           {"values": {"lr": 0.1}, "metrics": metrics("b", 2.25)}]})
    world = SimpleNamespace(bcast_obj=lambda value: value)
    comparison._choose(SimpleNamespace(rank=0, out=str(tmp_path), topology=SimpleNamespace(world=world)))
    assert comparison.chosen == {"sgd": {"lr": 0.1}, "diloco": {}}
    assert [c["score"] for c in comparison.tried["sgd"]] == [2.5, 2.25]
    assert "- sgd: chose lr=0.1 (lr=0.05: 2.5; lr=0.1: 2.25)" in comparison.section, comparison.section
    assert "- diloco: no --sweep key applies; its settings as given" in comparison.section, comparison.section
    assert json.loads((tmp_path / "sweep.json").read_text())["chosen"] == {"sgd": {"lr": 0.1}, "diloco": {}}
