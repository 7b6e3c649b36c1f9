"""``--device`` and ``--precision`` end to end on the CPU (2 ranks): refusals on every rank, bfloat16 trained and resumed bitwise."""

from __future__ import annotations

import json
import re

import pytest

from mpiopt.checkpoint import first_difference

from .launch import CLI_DRIVER as DRIVER, run_mpi

h5py = pytest.importorskip("h5py")
torch = pytest.importorskip("torch")

from mpiopt.checkpoint.layout import read_group  # noqa: E402  (needs h5py)

# What these tests check does not depend on the MPI library: CI runs them under MPICH only (.ci/run).
pytestmark = pytest.mark.one_mpi

TEXT = ["train", "--dataset", "text", "--model", "gpt", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "8", "--steps", "6", "--eval-every", "6", "--dropout", "0.1", "--progress", "lines", "--checkpoint-every", "3"]


def _read(path) -> dict:
    with h5py.File(path, "r") as f:
        return {"model": read_group(f["model"]), "ranks": read_group(f["ranks"]), "precision": f.attrs["precision"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --device cuda is not refused")
def test_device_cuda_without_a_gpu_fails_every_rank_before_training(tmp_path):
    code, output, _ = run_mpi(2, ["-m", "mpiopt", *TEXT, "--device", "cuda", "--out", str(tmp_path / "run")], timeout=120)
    assert code == 2, output
    assert output.count("mpiopt train: error: --device cuda, but no GPU is visible to this rank: torch.cuda.is_available() is "
                        "False, CUDA_VISIBLE_DEVICES is") == 1, output
    assert "Traceback" not in output and "data:" not in output and not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU fp16 is allowed")
def test_bf16_trains_resumes_bitwise_and_refuses_another_precision(tmp_path):
    whole, resumed, logs = tmp_path / "whole", tmp_path / "resumed", tmp_path / "logs"
    middle = str(whole / "checkpoints" / "ckpt-000000003.h5")
    cases = [
        ("whole", [*TEXT, "--precision", "bf16", "--out", str(whole)]),
        ("resumed", [*TEXT, "--precision", "bf16", "--out", str(resumed), "--resume", middle]),
        ("other-precision", [*TEXT, "--out", str(tmp_path / "refused"), "--resume", middle]),
        ("fp16-on-cpu", [*TEXT, "--precision", "fp16", "--out", str(tmp_path / "fp16")]),
    ]
    logs.mkdir()
    code, output, _ = run_mpi(2, ["-c", DRIVER, json.dumps(cases), str(logs)], timeout=300)
    assert code == 0, output
    codes = json.loads((logs / "codes.json").read_text())
    text = {name: (logs / f"{name}.0.log").read_text() for name, _ in cases}
    assert codes["whole"] == codes["resumed"] == 0, text
    assert "precision = \"bf16\"" in (whole / "config.toml").read_text()
    a, b = _read(whole / "checkpoints" / "ckpt-000000006.h5"), _read(resumed / "checkpoints" / "ckpt-000000006.h5")
    assert a["precision"] == "bf16" and first_difference(a, b) is None
    assert codes["other-precision"] == 2 and (f"--resume {middle}: the checkpoint's precision (--precision) is 'bf16', this "
                                              "run's 'fp32'") in text["other-precision"]
    assert codes["fp16-on-cpu"] == 2 and "--precision fp16 needs a GPU" in text["fp16-on-cpu"]
    assert "Traceback" not in text["other-precision"] + text["fp16-on-cpu"]


def test_help_names_the_device_settings():
    code, output, _ = run_mpi(1, ["-m", "mpiopt", "compare", "--help"], timeout=60)
    assert code == 0 and all(flag in output for flag in ("--device DEVICE", "--precision PRECISION", "--share-gpus")), output


def test_info_names_each_ranks_gpu_and_where_gpu_buffers_go():
    code, output, _ = run_mpi(2, ["-m", "mpiopt", "info", "--elements", "1024"], timeout=120, env={"MPIOPT_GPU_AWARE": "0"})
    assert code == 0, output
    assert "GPU buffers: staged through pinned host memory (MPI not CUDA-aware: MPIOPT_GPU_AWARE=0;" in output, output
    gpu = r"(none visible \(torch.cuda.is_available\(\) is False, .*\)|cuda:\d of \d+: .*, [\d.]+ GiB)"
    assert [rank for rank, _ in re.findall(rf"^\| (\d) \| {gpu} \|$", output, flags=re.M)] == ["0", "1"], output


# fp16 is refused on the CPU by the CLI; train() called with the device given runs its scaler path there (CPU autocast
# takes float16, torch's GradScaler takes "cpu"), so that path is tested without a GPU.
FP16 = """
import sys
from mpiopt.comm import Topology
from mpiopt.training.config import TrainConfig
from mpiopt.training.data import load_data
from mpiopt.training.loop import train
out, algorithm = sys.argv[1], sys.argv[2]
topology = Topology()
parts = [("whole", None)] + ([] if algorithm == "ddp" else [("resumed", f"{out}/whole/checkpoints/ckpt-000000002.h5")])
for part, resume in parts:
    config = TrainConfig(algorithm=algorithm, dataset="text", model="gpt", n_layer=1, n_embd=16, n_head=2, block_size=16,
                         batch_size=4, steps=4, eval_every=4, dropout=0.1, precision="fp16", progress="lines", clip_grad_norm=1.0,
                         checkpoint_every=None if algorithm == "ddp" else 2, resume=resume)
    train(config, algorithm, topology, load_data(config, topology.world), f"{out}/{part}", device="cpu")
"""


@pytest.mark.parametrize("algorithm, ranks", [("sgd", 2), ("topk", 2), ("ddp", 1)])
def test_fp16_steps_through_the_scaler_and_resumes_with_its_state(tmp_path, algorithm, ranks):
    """sgd at 2 ranks: backward sent the scaled gradient (overlap), unscaled once summed; topk: unscaled before its exchange."""
    code, output, _ = run_mpi(ranks, ["-c", FP16, str(tmp_path), algorithm], timeout=180)
    assert code == 0, output
    if algorithm == "ddp":
        return  # torch's scaler stepped the baseline's optimizer
    a, b = (_read(tmp_path / part / "checkpoints" / "ckpt-000000004.h5") for part in ("whole", "resumed"))
    assert a["precision"] == "fp16" and first_difference(a, b) is None
    for rank in ("0", "1"):
        assert float(a["ranks"][rank]["scaler"]["scale"]) > 0 and int(a["ranks"][rank]["scaler"]["_growth_tracker"]) == 4
