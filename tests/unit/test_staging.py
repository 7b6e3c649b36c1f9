"""The pipelined staging of GPU buffers, on the CPU: chunk ranges, the order of copies and MPI calls, results and settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpiopt.comm.buffers import HostStaging, copy_bytes
from mpiopt.comm.staging import CHUNK_ENV, DEFAULT_CHUNK_BYTES, chunk_ranges, gpu_path, schedule, staged_call, staging_chunk_bytes


@pytest.mark.parametrize("total", [0, 4, 12, 4096, 4100, 40_000])
@pytest.mark.parametrize("chunk", [1, 4, 6, 4096, 10_000])
@pytest.mark.parametrize("itemsize", [1, 4, 8])
def test_chunks_cover_the_buffer_exactly(total, chunk, itemsize):
    total = total // itemsize * itemsize
    ranges = chunk_ranges(total, chunk, itemsize)
    covered = [b for a, stop in ranges for b in range(a, stop)]
    assert covered == list(range(total))  # in order: no gap, no overlap
    step = max(itemsize, chunk // itemsize * itemsize)
    assert all((a % itemsize, (stop - a) % itemsize) == (0, 0) for a, stop in ranges[:-1] or ranges)
    assert all(stop - a == step for a, stop in ranges[:-1]) and all(0 < stop - a <= step for a, stop in ranges)


def test_chunks_refuse_a_partial_item():
    with pytest.raises(ValueError, match="10 bytes is no whole number of 4-byte items"):
        chunk_ranges(10, 4, 4)


class FakeRequest:
    """Completes at its ``done_after``-th Test (Wait at once); logs its completion."""

    def __init__(self, i, log, done_after=1):
        self.i, self.log, self.left = i, log, done_after

    def Test(self):
        self.left -= 1
        if self.left <= 0:
            self.Wait()
        return self.left <= 0

    def Wait(self):
        self.log.append(("wait", self.i))
        self.left = 0


def run_schedule(count):
    log = []

    def start(i):
        log.append(("start", i))
        return FakeRequest(i, log)

    for request in schedule(count, lambda i: log.append(("in", i)), start, lambda i: log.append(("out", i))):
        request.Wait()
    return log


def test_the_order_is_pipelined():
    assert run_schedule(0) == []
    assert run_schedule(1) == [("in", 0), ("start", 0), ("wait", 0), ("out", 0)]
    assert run_schedule(3) == [
        ("in", 0), ("start", 0), ("in", 1),
        ("start", 1), ("in", 2), ("wait", 0), ("out", 0),  # chunk 2 copied in and chunk 0 out while chunk 1 is reduced
        ("start", 2), ("wait", 1), ("out", 1),
        ("wait", 2), ("out", 2),
    ]


def fake_sum(ranks, log=None):
    """A nonblocking 'Allreduce' over ``ranks`` identical ranks: the chunk times ``ranks``, done at once."""

    def start(*chunks):
        src, dst = chunks[0], chunks[-1]
        dst[...] = src * ranks
        if log is not None:
            log.append(src.size)
        return FakeRequest(len(log or ()), [], done_after=2)

    return start


@pytest.mark.parametrize("n", [1, 3, 1000, 1025, 4096])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("in_place", [True, False])
def test_staged_results_equal_one_unchunked_call(n, dtype, in_place):
    rng = np.random.default_rng(n)
    data = rng.standard_normal(n).astype(dtype)
    expect = data * 3
    staging, sizes = HostStaging(), []
    buf, out = data.copy(), np.zeros_like(data)
    buffers = [(buf, True, True)] if in_place else [(buf, True, False), (out, False, True)]
    call = staged_call(buffers, fake_sum(3, sizes), staging, ["a", "b"][: len(buffers)], chunk=1000)
    while not call.Test():  # each chunk's request completes at its second Test
        pass
    result = buf if in_place else out
    assert np.array_equal(result.view(np.uint8), expect.view(np.uint8))
    assert sum(sizes) == n and max(sizes) <= max(1, 1000 // np.dtype(dtype).itemsize)
    assert len(staging) == len(buffers)
    if not in_place:
        assert np.array_equal(buf, data)


def test_staged_torch_cpu_tensors_and_reused_host_buffers():
    staging = HostStaging()
    for n in (5000, 300):
        t = torch.arange(n, dtype=torch.float32)
        staged_call([(t, True, True)], fake_sum(2), staging, ["s"], chunk=512).Wait()
        assert torch.equal(t, torch.arange(n, dtype=torch.float32) * 2)
    assert len(staging) == 1


def test_staged_buffers_must_match():
    with pytest.raises(ValueError, match=r"equal sizes, got \[16, 8\]"):
        staged_call([(np.zeros(4, np.float32), True, False), (np.zeros(2, np.float32), False, True)], fake_sum(1), HostStaging(), "ab", 8)


def test_chunk_size_setting(monkeypatch):
    monkeypatch.delenv(CHUNK_ENV, raising=False)
    assert staging_chunk_bytes() == (DEFAULT_CHUNK_BYTES, "default")
    assert staging_chunk_bytes(4096) == (4096, "staging_chunk")
    assert staging_chunk_bytes("16M") == (16 << 20, "staging_chunk")
    monkeypatch.setenv(CHUNK_ENV, "4MiB")
    assert staging_chunk_bytes() == (4 << 20, f"{CHUNK_ENV}=4MiB")
    for bad in (0, -1, "lots", "1.5M", True):
        with pytest.raises(ValueError, match="staging_chunk must be a positive number of bytes"):
            staging_chunk_bytes(bad)
    monkeypatch.setenv(CHUNK_ENV, "8X")
    with pytest.raises(ValueError, match=f"{CHUNK_ENV} must be .* got '8X'"):
        staging_chunk_bytes()


def test_gpu_path_says_which_and_why():
    assert gpu_path(1, False, "x", 8 << 20, "default").path == "world of one"
    assert str(gpu_path(4, True, "MPIX_Query_cuda_support", 8 << 20, "default")).startswith("cuda-aware (MPI takes GPU memory")
    staged = gpu_path(4, False, "MPIOPT_GPU_AWARE=0", 8 << 20, "default")
    assert (staged.path, staged.chunk_bytes) == ("staged", 8 << 20)
    assert str(staged) == "staged in pipelined chunks of 8 MiB (MPI is not CUDA-aware: MPIOPT_GPU_AWARE=0; chunk size: default)"


def test_copy_bytes_across_libraries():
    src = np.arange(6, dtype=np.float32)
    dst = torch.zeros(8, dtype=torch.float32)
    copy_bytes(dst, src)
    assert dst.tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    back = np.zeros(3, np.float32)
    copy_bytes(back, dst, 12)
    assert back.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot copy 24 bytes into a buffer of 12"):
        copy_bytes(back, src)
    with pytest.raises(ValueError, match="C-contiguous"):
        copy_bytes(np.zeros((3, 3))[:, 0], np.zeros(3))


def test_the_staging_benchmark_has_help(capsys):
    from mpiopt.bench.staging import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0 and "--chunk" in capsys.readouterr().out
