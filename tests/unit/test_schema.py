"""Hyperparameter schemas: one declaration per algorithm serves constructors, the command line, TOML and checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

import mpiopt
from mpiopt.algorithms import SynchronousAlgorithm, algorithm_class, algorithms, register
from mpiopt.algorithms.base import BASE
from mpiopt.algorithms.schema import Hyperparameter, Schema, positive
from mpiopt.training.config import TrainConfig, UsageError
from mpiopt.training.flags import hyperparameter_help


def test_every_schema_declares_its_constructor():
    import inspect

    for cls in algorithms():
        parameters = inspect.signature(cls.__init__).parameters
        keywords = {k: p.default for k, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
        assert keywords == {k: cls.schema[k].default for k in keywords}, cls.name
        assert {"lr", "nan_policy"} <= set(cls.schema.names()) and "lr" in cls.schema.per_group()


def test_register_refuses_a_schema_that_is_not_the_constructor():
    class Undeclared(SynchronousAlgorithm):
        name = "undeclared_toy"

        def __init__(self, topology, *, lr: float = 0.1, period: int = 2, nan_policy: str = "raise") -> None:
            super().__init__(topology, lr=lr, nan_policy=nan_policy)

    with pytest.raises(TypeError, match=r"undeclared \['period'\]"):
        register(Undeclared)
    Undeclared.schema = BASE + Schema(Hyperparameter("period", 3, positive(integer=True), "steps"))
    with pytest.raises(TypeError, match=r"other defaults \['period'\]"):
        register(Undeclared)
    Undeclared.schema = BASE + Schema(Hyperparameter("period", 2, positive(integer=True), "steps"))
    Undeclared.evaluates = "best"  # what a training run evaluates must be a kind the loop and the help know
    with pytest.raises(ValueError, match="Undeclared.evaluates must be one of identical, .*, got 'best'"):
        register(Undeclared)
    assert "undeclared_toy" not in mpiopt.available()


def test_validate_names_the_bad_key_and_value():
    schema = algorithm_class("lsgd").schema
    assert schema.validate({"pull_local": 0.5, "period": None}) == {"pull_local": 0.5, "period": None}
    with pytest.raises(TypeError, match="lsgd has no hyperparameter 'pull'; it takes lr, nan_policy, pull_local"):
        schema.validate({"pull": 0.5}, what="lsgd")
    with pytest.raises(ValueError, match=r"pull_local must be in \[0.0, 1.0\], got 1.5"):
        schema.validate({"pull_local": 1.5})
    with pytest.raises(TypeError, match="global_period must be an integer, got 4.0"):
        schema.validate({"global_period": 4.0})
    with pytest.raises(ValueError, match="declared twice"):
        Schema(schema["lr"], schema["lr"])
    assert schema.with_defaults(pull_local=0.3)["pull_local"].default == 0.3 and schema["pull_local"].default == 0.1


def test_create_names_a_misspelt_keyword_with_the_algorithm_the_close_match_and_what_it_takes():
    topology = mpiopt.Topology()
    with pytest.raises(TypeError) as caught:
        mpiopt.create("diloco", topology, perido=2)
    assert str(caught.value) == (
        "diloco has no hyperparameter 'perido' (did you mean 'period'?); it takes "
        + ", ".join(algorithm_class("diloco").schema.names())
    )
    with pytest.raises(TypeError, match=r"^sgd has no hyperparameter 'perido'; it takes lr, nan_policy, momentum"):
        mpiopt.create("sgd", topology, perido=2)  # nothing close: no guess
    with pytest.raises(TypeError, match=r"'momentm' \(did you mean 'momentum'\?\), 'perido' \(did you mean 'period'\?\); it"):
        mpiopt.create("streaming_diloco", topology, perido=2, momentm=0.9)
    for cls in algorithms():  # refused before the constructor runs, so even those that need more ranks than here
        with pytest.raises(TypeError, match=f"^{cls.name} has no hyperparameter 'no_such_key'; it takes lr, nan_policy"):
            mpiopt.create(cls.name, topology, no_such_key=1)
    topology.Free()


def test_the_command_line_and_toml_check_against_the_schema_before_any_rank_starts():
    config = TrainConfig(algorithm="dasgd", hyperparameters={"dasgd": {"delay_steps": -1}})
    with pytest.raises(UsageError, match="dasgd: delay_steps must be >= 0, got -1"):
        config.validate(["dasgd"])
    with pytest.raises(UsageError, match="signum has no hyperparameter 'period'"):
        TrainConfig(algorithm="signum", hyperparameters={"period": 2}).validate(["signum"])
    TrainConfig(algorithm="signum", hyperparameters={"pipeline_chunks": 3}).validate(["signum"])


def test_help_lists_every_algorithm_and_hyperparameter():
    text = hyperparameter_help()
    for cls in algorithms():
        assert f"  {cls.name}" in text
        for entry in cls.schema:
            if entry.name != "nan_policy":
                assert f"{entry.name}={entry.default!r}" in text, (cls.name, entry.name)
    assert "progress='test'" in text and "[execution]" in text and "[per group]" in text


def test_help_gives_each_algorithms_rule_with_an_inner_optimizer_or_why_it_takes_none():
    """Every algorithm that takes an inner optimizer states its step with it, beside the paper's; the others say why not."""
    text = " ".join(hyperparameter_help().split())  # the help wraps long lines
    for cls in algorithms():
        block = text[text.index(f" {cls.name} ("):]
        if cls.inner_role:
            assert "inner(" in cls.inner_rule and "the paper" in cls.inner_rule, cls.name
            assert block.split(" with --optimizer: ", 1)[1].startswith(" ".join(cls.inner_rule.split())), cls.name
        else:
            refusal = " ".join(cls.inner_refusal.split())
            assert cls.inner_rule == "" and block.split(" --optimizer: refused (", 1)[1].startswith(refusal), cls.name


def test_execution_knobs_are_not_hyperparameters_and_never_refuse_a_resume():
    topology = mpiopt.Topology()
    params = np.zeros(8, np.float32)
    saved = mpiopt.create("dasgd", topology, progress="test", tests_per_poke=8)
    saved.setup(params)
    saved.step(params, np.ones(8, np.float32))
    state = saved.state_dict()
    assert "progress" not in state["hyperparameters"] and saved.execution()["tests_per_poke"] == 8
    other = mpiopt.create("dasgd", topology, progress="none", tests_per_poke=2)
    other.setup(np.zeros(8, np.float32))
    other.load_state_dict(state)  # another progress mode: the same mathematics
    assert other.steps == 1 and other.progress == "none"
    # A state from before knobs were told apart carries them among its hyperparameters: still no refusal.
    old = {**state, "hyperparameters": {**state["hyperparameters"], "progress": "thread", "progress_interval": 0.5}}
    other.load_state_dict(old)
    with pytest.raises(ValueError, match="hyperparameter period: saved 4, here 8"):
        changed = mpiopt.create("dasgd", topology, period=8)
        changed.setup(np.zeros(8, np.float32))
        changed.load_state_dict(state)
    topology.Free()


def test_an_optimizer_steps_the_algorithms_that_take_one_and_the_others_keep_their_own_update():
    config = TrainConfig(optimizer="adamw", no_decay_on="bias", hyperparameters={"lr": 0.003})
    config.validate(["ddp", "sgd", "diloco", "signum", "async_msgd"])  # compare's mix
    assert config.for_algorithm("sgd") is config and config.for_algorithm("ddp") is config
    signum = config.for_algorithm("signum")
    assert (signum.optimizer, signum.no_decay_on) == (None, None)
    # signum's own update keeps its own settings (momentum, weight decay), the shared rate included.
    assert signum.algorithm_hyperparameters("signum") == {**TrainConfig().algorithm_hyperparameters("signum"), "lr": 0.003}
    assert "momentum" not in config.algorithm_hyperparameters("sgd")  # AdamW's, not the built-in update's
    for alone in (["signum"], ["ddp", "async_msgd", "async_lsgd"]):
        with pytest.raises(UsageError, match=r"(signum|async_msgd) takes no --optimizer: "):
            config.validate(alone)


@pytest.mark.parametrize("algorithm", ["lsgd", "sgd"])
def test_saved_settings_with_an_optimizer_reproduce_its_keywords(algorithm, tmp_path):
    """config.toml carries --optimizer's keywords as its table (parsed: 0.90,0.95 is [0.9, 0.95]), and read back
    with --config gives the same optimizer and algorithm settings.  --optimizer sgd claims the table sgd from the
    sgd algorithm, whose own values are then the shared ones alone."""
    torch = pytest.importorskip("torch")
    from mpiopt.cli.main import build_parser
    from mpiopt.cli.session import _hyperparameter_tables
    from mpiopt.training.flags import config_from_args, dump_toml
    from mpiopt.training.optimizers import OptimizerSettings, inner_optimizer, optimizer_keywords

    def read(*argv):
        return config_from_args(build_parser().parse_args(["train", "--algorithm", algorithm, "--out", str(tmp_path), *argv]), "train")[0]

    optimizer = "sgd" if algorithm == "sgd" else "adamw"
    keys = ["--hp", "sgd.momentum=0.9", "--hp", "sgd.nesterov=true"] if optimizer == "sgd" else ["--hp", "adamw.betas=0.90,0.95"]
    config = read("--optimizer", optimizer, "--hp", "nan_policy=skip", *keys)
    assert config.algorithm_hyperparameters(algorithm) == {"nan_policy": "skip"}
    want = {"momentum": 0.9, "nesterov": True} if optimizer == "sgd" else {"betas": [0.9, 0.95]}
    assert optimizer_keywords(config) == want
    tables = _hyperparameter_tables(config, [algorithm])
    assert tables == ({"nan_policy": "skip", "sgd": want} if algorithm == "sgd" else {"lsgd": {"nan_policy": "skip"}, "adamw": want})
    (tmp_path / "config.toml").write_text(dump_toml({"algorithm": algorithm, "optimizer": optimizer, "steps": 3, "hyperparameters": tables}))
    again = read("--config", str(tmp_path / "config.toml"))
    assert optimizer_keywords(again) == want and again.algorithm_hyperparameters(algorithm) == {"nan_policy": "skip"}
    inner = inner_optimizer(OptimizerSettings.of(again), torch.nn.Linear(2, 2))
    assert all(inner.param_groups[0][k] == (tuple(v) if isinstance(v, list) else v) for k, v in want.items())


def test_a_checkpoint_with_the_optimizers_keywords_as_text_compares_equal_to_them_parsed():
    """Checkpoints written before the keywords were parsed kept betas=0.9,0.95 as text: the resume check parses them."""
    pytest.importorskip("torch")
    pytest.importorskip("h5py")
    from mpiopt.algorithms.resize import hyperparameter_differences
    from mpiopt.training.resume import _parsed_keywords

    here = {"lr": 0.001, "optimizer": {"name": "adamw", "keywords": {"betas": [0.9, 0.95]}, "clip_grad_norm": 0.5}}
    old = {"lr": 0.001, "optimizer": {"name": "adamw", "keywords": {"betas": "0.9,0.95"}, "clip_grad_norm": 0.5}}
    cls = "sgd"
    assert hyperparameter_differences(cls, old, here, 2, 2) != []  # as text they differ...
    assert hyperparameter_differences(cls, _parsed_keywords(old), here, 2, 2) == []  # ...parsed they do not
    other = {**old, "optimizer": {**old["optimizer"], "keywords": {"betas": "0.9,0.99"}}}
    assert hyperparameter_differences(cls, _parsed_keywords(other), here, 2, 2) != []
