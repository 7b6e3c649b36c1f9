"""``mpiopt train``, ``compare`` and ``plot`` end to end under mpiexec, on synthetic data, and their bad input."""

from __future__ import annotations

import json
import os

import pytest

from mpiopt.metrics import EVAL_FIELDS, STEP_FIELDS, read_metrics

from .launch import run_mpi

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

TINY = ["--dataset", "synthetic", "--steps", "12", "--eval-every", "6", "--batch-size", "16"]


def _png(path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000


@pytest.mark.one_mpi  # its output's form, whichever MPI ran it
def test_train_writes_every_field_and_prints_the_settings_first(tmp_path):
    out = tmp_path / "run"
    code, output, _ = run_mpi(2, ["-m", "mpiopt", "train", "--algorithm", "lsgd", *TINY, "--out", str(out)], timeout=180)
    assert code == 0, output
    assert output.index("settings (saved as") < output.index("lsgd step")
    run = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in run.steps] == list(range(1, 13))
    for record in run.steps:
        assert set(STEP_FIELDS) <= set(record) and record["algorithm"] == "lsgd"
    assert [e["step"] for e in run.evals] == [6, 12]
    for record in run.evals:
        assert set(EVAL_FIELDS) <= set(record) and record["evaluated"] == "average" and 0 <= record["test_accuracy"] <= 1
    assert run.header["world_size"] == 2 and run.header["config"]["hyperparameters"]["lr"] == 0.05
    assert sum(r["bytes_sent"] for r in run.steps) == run.end["bytes_sent_total"] > 0
    # The saved settings reproduce the run: read back with --config, flags still win.
    saved = (out / "config.toml").read_text()
    assert 'algorithm = "lsgd"' in saved and "steps = 12" in saved
    again = tmp_path / "again"
    code, output, _ = run_mpi(2, ["-m", "mpiopt", "train", "--config", str(out / "config.toml"), "--steps", "6", "--out", str(again)], timeout=180)
    assert code == 0, output
    assert len(read_metrics(again / "metrics.jsonl").steps) == 6
    assert 'dataset = "synthetic"' in (again / "config.toml").read_text()


@pytest.mark.one_mpi  # its output's form, whichever MPI ran it
def test_compare_writes_the_table_and_figures_and_plot_redraws_them(tmp_path):
    out = tmp_path / "cmp"
    algorithms = "sgd,dasgd,signum,async_msgd"
    code, output, _ = run_mpi(
        3, ["-m", "mpiopt", "compare", "--algorithms", algorithms, *TINY, "--group-size", "2", "--out", str(out)], timeout=240
    )
    assert code == 0, output
    table = (out / "results.md").read_text()
    for name in algorithms.split(","):
        assert f"| {name} |" in table and f"| {name} |" in output
        assert (out / name / "metrics.jsonl").exists()
    assert "time to 90.0 %" in table
    figures = [out / "accuracy.png", out / "loss.png"]
    assert all(_png(f) for f in figures) and all(str(f) in output for f in figures)
    redrawn = tmp_path / "redrawn"
    code, output, _ = run_mpi(1, ["-m", "mpiopt", "plot", str(out), "--out", str(redrawn)], timeout=120)
    assert code == 0, output
    assert all(_png(redrawn / f.name) for f in figures)
    assert sorted((redrawn / "results.md").read_text().splitlines()[2:]) == sorted(table.strip().splitlines()[4:])


BAD = [
    (["train", "--algorithm", "adamw"], "unknown algorithm 'adamw'; choose from"),
    (["train", "--dataset", "mnist"], "unknown dataset 'mnist'; choose from digits, cifar10, synthetic"),
    (["train", "--batch-size", "0"], "batch_size must be a positive integer, got 0"),
    (["train", "--lr", "-1"], "lr must be a positive number, got -1.0"),
    (["train", "--steps", "5", "--epochs", "2"], "give --steps or --epochs, not both"),
    (["train", "--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "data_dir '/nonexistent/cifar' is not a directory"),
    (["train", "--dataset", "cifar10", "--data-dir", "{empty}"], "cannot load the dataset: cifar10: no binary batches in"),
    (["train", "--hp", "momentum"], "--hp takes KEY=VALUE, got 'momentum'"),
    (["train", "--hp", "pull_locl=0.2", "--algorithm", "lsgd"], "lsgd has no hyperparameter 'pull_locl'"),
    (["train", "--hp", "momentum=1.5"], "momentum must be in [0.0, 1.0)"),
    (["compare", "--algorithms", "sgd,nope"], "unknown algorithm 'nope'"),
    (["train", "--config", "/nonexistent.toml"], "config file '/nonexistent.toml' does not exist"),
    (["train", "--config", "{badkey}"], "unknown key(s) colour"),
    (["train", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["train", "--progress", "fancy"], "progress must be one of auto, bar, lines, got 'fancy'"),
    (["plot", "/nonexistent/metrics.jsonl", "--out", "x"], "no such file or folder"),
    (["compare", "--target-loss", "0"], "target_loss must be a finite loss > 0, got 0.0"),
    (["plot", "{empty}", "--out", "x", "--target-loss", "-2"], "--target-loss must be a finite loss > 0, got -2.0"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_gives_one_clear_message(tmp_path, args, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    badkey = tmp_path / "bad.toml"
    badkey.write_text('colour = "blue"\n')
    args = [a.format(empty=empty, badkey=badkey) for a in args]
    code, output, seconds = run_mpi(2, ["-m", "mpiopt", *args, "--out", str(tmp_path / "o")] if args[0] != "plot" else ["-m", "mpiopt", *args], timeout=60)
    assert code != 0 and seconds < 30, output
    assert message in output, output
    assert output.count(message) == 1, f"printed more than once:\n{output}"
    assert "Traceback" not in output, output


@pytest.mark.one_mpi  # its output's form, whichever MPI ran it
def test_metrics_lines_are_json_with_numbers(tmp_path):
    out = tmp_path / "one"
    code, output, _ = run_mpi(1, ["-m", "mpiopt", "train", "--algorithm", "topk", *TINY, "--out", str(out)], timeout=120)
    assert code == 0, output
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines][:2] == ["run", "step"] and lines[-1]["kind"] == "end"
    steps = [line for line in lines if line["kind"] == "step"]
    assert all(line["bytes_sent"] == 0 for line in steps)  # one rank: nothing crosses a wire
    assert all(line["step_seconds"] >= line["compute_seconds"] >= 0 for line in steps)


def test_trace_shows_every_rank_and_dasgd_averaging_in_flight_during_compute(tmp_path):
    trace = tmp_path / "trace.json"
    args = ["-m", "mpiopt", "train", "--algorithm", "dasgd", *TINY, "--hp", "period=3", "--out", str(tmp_path / "o"), "--trace", str(trace)]
    code, output, _ = run_mpi(2, args, timeout=180)
    assert code == 0, output
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {"compute", "algorithm", "eval", "world.Iallreduce"} <= {e["name"] for e in spans}
    from mpiopt.metrics import overlap_fraction

    for rank in (0, 1):
        assert overlap_fraction(events, rank) > 0  # the averaging ran behind the next steps' forward/backward


@pytest.mark.one_mpi  # its output's form, whichever MPI ran it
def test_settings_from_a_file_are_type_checked(tmp_path):
    from mpiopt.training.config import TrainConfig, UsageError

    for bad, message in [
        (dict(seed=-1), "seed must be an integer >= 0, got -1"),
        (dict(dropout="x"), "dropout must be a float, got 'x'"),
        (dict(augment=1), "augment must be a bool, got 1"),
        (dict(hyperparameters={"lsdg": {"pull_local": 0.2}}), "hyperparameter table 'lsdg' names no algorithm"),
        (dict(override_hyperparameters=True), "--override-hyperparameters only applies with --resume"),
    ]:
        with pytest.raises(UsageError, match=message):
            TrainConfig(**bad).validate(["sgd"])
    TrainConfig(hyperparameters={"lsgd": {"pull_local": 0.2}}).validate(["sgd"])  # a table for another algorithm is fine


@pytest.mark.one_mpi  # its output's form, whichever MPI ran it
def test_progress_bar_on_request_and_plain_lines_in_logs(tmp_path):
    code, output, _ = run_mpi(2, ["-m", "mpiopt", "train", *TINY, "--progress", "bar", "--out", str(tmp_path / "bar")], timeout=120)
    assert code == 0, output
    assert "       sgd [" in output and "] 12/12" in output and "eval at step 6" in output  # the bar, evaluations as lines
    code, output, _ = run_mpi(2, ["-m", "mpiopt", "train", *TINY, "--out", str(tmp_path / "lines")], timeout=120)
    assert code == 0, output
    assert "sgd [" not in output and "sgd step  6/12  loss" in output and "sgd step 12/12" in output  # mpiexec: pipes


def test_help_under_mpiexec_is_printed_once():
    code, output, _ = run_mpi(2, ["-m", "mpiopt", "train", "--help"])
    assert code == 0, output
    assert output.count("usage: python -m mpiopt train") == 1 and output.count("Checkpoints:") == 1, output


@pytest.mark.one_mpi  # its output's form, whichever MPI ran it
def test_help_names_the_evaluated_model_of_every_algorithm():
    import argparse

    from mpiopt.algorithms import algorithms
    from mpiopt.algorithms.base import EVALUATED_MODELS
    from mpiopt.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    paragraph = sub.format_help().split("Evaluated model:", 1)[1].split("\n\n", 1)[0]
    listed = {}
    for line in paragraph.splitlines():
        if line.startswith("  ") and ": " in line:
            words, names = line.strip().rsplit(": ", 1)
            listed.update({name: words for name in names.split(", ")})
    assert listed == {cls.name: EVALUATED_MODELS[cls.evaluates] for cls in algorithms()}
    assert listed["diloco"] == listed["streaming_diloco"] == "the average of the ranks' models"
    assert listed["async_lsgd"] == "the global leader's model" and listed["sgd"].startswith("every rank's model")


@pytest.mark.one_mpi
@pytest.mark.parametrize("command", ["train", "compare"])
def test_help_documents_every_flag_and_its_default(command):
    import argparse
    import dataclasses

    from mpiopt.cli.main import build_parser
    from mpiopt.training.config import TrainConfig
    from mpiopt.training.flags import command_settings

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    helps = {o: a.help for a in sub._actions for o in a.option_strings}
    defaults = {f.name: getattr(TrainConfig(), f.name) for f in dataclasses.fields(TrainConfig)}
    for name in command_settings(command):
        text = helps["--" + name.replace("_", "-")]
        assert text and len(text) > 20, name
        if defaults[name] is not None:
            assert f"(default: {defaults[name]})" in text, (name, text)
        else:  # no fixed default: the text says what happens without the flag
            assert "default" in text, (name, text)
