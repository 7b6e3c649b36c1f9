"""``--device`` and ``--precision``: each rank's device from the devices it sees and its node-local rank, and the refusals."""

from __future__ import annotations

import pytest

from mpiopt.training.device import CudaView, local_rank, resolve_device

NONE = CudaView(0, None, None)
FOUR = CudaView(4, None, "12.4")
ONE_PER_RANK = CudaView(1, "2", "12.4")  # the template's CUDA_VISIBLE_DEVICES=$SLURM_LOCALID
ONE_SHARED = CudaView(1, None, "12.4")


@pytest.mark.parametrize("view, rank, size, device", [
    (NONE, 0, 1, "cpu"), (FOUR, 0, 4, "cuda:0"), (FOUR, 3, 4, "cuda:3"), (FOUR, 1, 2, "cuda:1"), (ONE_PER_RANK, 0, 4, "cuda:0"),
    (ONE_PER_RANK, 3, 4, "cuda:0"), (ONE_SHARED, 0, 1, "cuda:0"),
])
def test_each_rank_takes_its_local_ranks_gpu_and_the_cpu_without_one(view, rank, size, device):
    assert resolve_device("auto", "fp32", view, rank, size) == device
    assert resolve_device("cpu", "fp32", view, rank, size) == "cpu"
    if view.count:
        assert resolve_device("cuda", "bf16", view, rank, size) == device


def test_more_local_ranks_than_gpus_train_on_the_cpu_with_auto_and_are_refused_with_cuda_unless_shared():
    for view, rank, size in ((FOUR, 4, 5), (ONE_SHARED, 1, 2)):
        assert resolve_device("auto", "fp32", view, 0, size) == resolve_device("auto", "fp32", view, rank, size) == "cpu"
        with pytest.raises(ValueError, match=f"node-local rank {rank} has no GPU of its own: {view.count} visible.*--share-gpus"):
            resolve_device("cuda", "fp32", view, rank, size)
    assert resolve_device("cuda", "fp32", FOUR, 6, 8, share=True) == "cuda:2"  # the local rank modulo the count
    assert resolve_device("auto", "fp32", ONE_SHARED, 1, 2, share=True) == "cuda:0"


def test_cuda_without_a_gpu_names_what_was_looked_for():
    with pytest.raises(ValueError) as caught:
        resolve_device("cuda", "fp32", CudaView(0, "", "12.4"), 0, 1)
    assert str(caught.value) == ("--device cuda, but no GPU is visible to this rank: torch.cuda.is_available() is False, "
                                 "CUDA_VISIBLE_DEVICES is '', torch built with CUDA 12.4")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES is unset, torch built without CUDA"):
        resolve_device("cuda", "fp32", NONE, 0, 1)


def test_fp16_needs_a_gpu_and_bad_names_are_named():
    with pytest.raises(ValueError, match="--precision fp16 needs a GPU"):
        resolve_device("auto", "fp16", NONE, 0, 1)
    assert resolve_device("auto", "fp16", FOUR, 1, 4) == "cuda:1"
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'gpu'"):
        resolve_device("gpu", "fp32", FOUR, 0, 1)
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16, got 'fp8'"):
        resolve_device("cpu", "fp8", FOUR, 0, 1)


def test_the_local_rank_is_the_launchers():
    assert local_rank({}) is None
    assert local_rank({"SLURM_LOCALID": "3"}) == 3
    assert local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "SLURM_LOCALID": "3"}) == 1  # mpirun inside an allocation
    assert local_rank({"MPI_LOCALRANKID": "2"}) == local_rank({"PMI_LOCAL_RANK": "2"}) == 2
    with pytest.raises(ValueError, match="SLURM_LOCALID must be a node-local rank >= 0, got 'x'"):
        local_rank({"SLURM_LOCALID": "x"})
