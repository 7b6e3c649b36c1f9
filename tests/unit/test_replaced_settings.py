"""``check_replaced_settings``: the built-in update's settings given where ``--optimizer`` steps instead."""

from __future__ import annotations

import pytest

from mpiopt.training.config import TrainConfig, UsageError

pytest.importorskip("torch")

from mpiopt.training.optimizers import check_replaced_settings  # noqa: E402  (needs torch)

COMPARE = ["ddp", "sgd", "diloco", "signum", "async_msgd"]


def test_a_shared_rate_with_an_optimizer_is_refused_naming_every_algorithm_and_the_flags_that_work():
    config = TrainConfig(optimizer="adamw", hyperparameters={"lr": 0.0003})
    config.validate(COMPARE)  # each setting is valid on its own
    with pytest.raises(UsageError) as refused:
        check_replaced_settings(config, COMPARE)
    message = str(refused.value)
    assert "lr=0.0003 (for ddp, sgd, diloco): give --lr 0.0003 (or --hp adamw.lr=0.0003)" in message, message
    assert "signum" not in message and "async_msgd" not in message  # their own update takes the shared rate


def test_an_algorithms_own_table_names_the_optimizers_keyword_or_says_it_has_none():
    with pytest.raises(UsageError, match=r"weight_decay=0\.1 \(for diloco\): give --hp sgd\.weight_decay=0\.1"):
        check_replaced_settings(TrainConfig(optimizer="sgd", hyperparameters={"diloco": {"weight_decay": 0.1}}), ["sgd", "diloco"])
    with pytest.raises(UsageError, match=r"nesterov=true \(for sgd\): adamw takes no nesterov; leave it out"):
        check_replaced_settings(TrainConfig(optimizer="adamw", hyperparameters={"sgd": {"nesterov": True}}), ["sgd"])


@pytest.mark.parametrize("config,algorithms", [
    (TrainConfig(hyperparameters={"lr": 0.0003, "momentum": 0.9}), COMPARE),  # no --optimizer: the built-in update's
    (TrainConfig(optimizer="adamw", lr=0.0003, hyperparameters={"adamw": {"weight_decay": 0.1}}), COMPARE),  # the optimizer's own
    (TrainConfig(optimizer="adamw", hyperparameters={"period": 4, "diloco": {"outer_lr": 0.5}}), ["diloco"]),  # the algorithm's own
    (TrainConfig(optimizer="sgd", hyperparameters={"sgd": {"momentum": 0.9}}), ["sgd"]),  # --optimizer sgd claims the table sgd
    (TrainConfig(optimizer="adamw", hyperparameters={"signum": {"momentum": 0.9}}), ["sgd", "signum"]),  # signum keeps its own update
])
def test_settings_that_reach_their_update_pass(config, algorithms):
    config.validate(algorithms)
    check_replaced_settings(config, algorithms)
