"""The text task's data (mpiopt.tasks.text): a fixed corpus, a deterministic split, reproducible windows, --data-dir."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from mpiopt.tasks.images import DatasetError  # noqa: E402
from mpiopt.tasks.text import EVAL_WINDOWS, STDLIB_FILES, load_text, text_files  # noqa: E402
from mpiopt.training.config import TrainConfig, UsageError  # noqa: E402


def test_the_stdlib_stream_and_its_split_are_the_same_on_every_load():
    first, second = load_text(block_size=64), load_text(block_size=64)
    assert first.sha256() == second.sha256()
    total = len(first.train) + len(first.held_out)
    assert 2_000_000 < total < 6_000_000 and len(first.held_out) == total // 10
    # The held-out part is the stream's last 10 %: the files' bytes in the fixed order.
    root = Path(sysconfig.get_paths()["stdlib"])
    assert text_files() == tuple(root / name for name in STDLIB_FILES)
    assert list(STDLIB_FILES) == sorted(set(STDLIB_FILES))  # sorted, no file twice
    tail = (root / STDLIB_FILES[-1]).read_bytes()
    assert first.held_out.tobytes().endswith(tail)


def test_training_windows_are_a_function_of_seed_rank_and_step():
    data = load_text(block_size=32)
    a = data.sampler(rank=1, world_size=3, batch_size=8, seed=5)
    b = data.sampler(rank=1, world_size=3, batch_size=8, seed=5)
    x, y = a(7)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == __import__("torch").int64
    assert (x[:, 1:] == y[:, :-1]).all()
    assert all((u == v).all() for u, v in zip(a(7), b(7)))  # no state: step 7 again, from a fresh sampler
    assert not (a(7)[0] == a(8)[0]).all()
    # Each rank reads its own contiguous third of the training stream.
    third = len(data.train) // 3
    for rank in range(3):
        offsets = data.sampler(rank=rank, world_size=3, batch_size=64, seed=5).offsets(0)
        assert (offsets >= rank * third).all() and (offsets + 33 <= (rank + 1) * third + 1).all()


def test_the_held_out_windows_are_fixed_and_do_not_overlap():
    data = load_text(block_size=128)
    x, y = data.x_test, data.y_test
    assert x.shape == y.shape == (EVAL_WINDOWS, 128) and (x[:, 1:] == y[:, :-1]).all()
    starts = [data.held_out.tobytes().find(bytes(row.astype(np.uint8).tolist())) for row in x[:3]]
    assert starts[0] == 0 and starts[1] - starts[0] >= 128


def test_a_data_dir_of_utf8_files_is_read_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("é" * 400, encoding="utf-8")
    (tmp_path / "a.md").write_text("x" * 600, encoding="utf-8")
    (tmp_path / "skip.bin").write_bytes(b"\xff" * 10)  # not a text suffix: not read
    data = load_text(tmp_path, block_size=16)
    assert [p.name for p in data.files] == ["a.md", "two.txt"]
    stream = data.train.tobytes() + data.held_out.tobytes()
    assert stream == b"x" * 600 + "é".encode() * 400
    assert load_text(tmp_path, block_size=16).sha256() == data.sha256()


def test_a_file_that_is_not_utf8_is_refused_by_name(tmp_path):
    (tmp_path / "good.txt").write_text("hello " * 100, encoding="utf-8")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 " * 100)
    with pytest.raises(DatasetError, match="bad.txt.*not UTF-8"):
        load_text(tmp_path, block_size=16)


def test_too_little_text_for_the_block_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("tiny", encoding="utf-8")
    with pytest.raises(DatasetError, match="too few for block_size 16"):
        load_text(tmp_path, block_size=16)


@pytest.mark.parametrize("settings, message", [
    (dict(dataset="text", model="mlp"), "dataset text goes with model gpt"),
    (dict(dataset="digits", model="gpt"), "dataset text goes with model gpt"),
    (dict(dataset="text", model="gpt", n_embd=100, n_head=3), "n_embd must be divisible by n_head, got n_embd=100 and n_head=3"),
    (dict(dataset="text", model="gpt", n_layer=0), "n_layer must be a positive integer, got 0"),
    (dict(dataset="text", model="gpt", block_size=-4), "block_size must be a positive integer, got -4"),
    (dict(dataset="text", model="gpt", width=64), "model gpt takes --n-embd"),
    (dict(dataset="digits", model="mlp", n_head=2), "n_head=2: the transformer's sizes apply to model gpt only"),
])
def test_bad_text_settings_are_named(settings, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig(**settings).validate(["sgd"])


def test_good_text_settings_pass_with_the_defaults_filled_in():
    config = TrainConfig(dataset="text", model="gpt", n_embd=96)
    config.validate(["sgd", "ddp"])
    assert config.gpt_sizes() == {"n_layer": 2, "n_embd": 96, "n_head": 4, "block_size": 128}
