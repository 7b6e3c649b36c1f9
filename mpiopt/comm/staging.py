"""Pipelined staging of GPU buffers through pinned host memory, for an MPI library that is not CUDA-aware.

The buffer is cut into chunks: chunk i+1 is copied device to host while chunk i is reduced by a nonblocking
MPI call, and chunk i's result is copied back while chunk i+1 is reduced.  :func:`schedule` is that order over
injected operations, so it is tested on the CPU with host arrays; the copiers below carry it to numpy (the
CPU twin), torch and cupy (side streams and events).  Settings and the order: docs/internals-comm.md.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Generator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .buffers import HostStaging, _is_torch, byte_view, copy_bytes, is_gpu_array, nbytes, torch_numpy_dtype

__all__ = [
    "CHUNK_ENV", "DEFAULT_CHUNK_BYTES", "staging_chunk_bytes", "chunk_ranges", "schedule", "StagedCall",
    "staged", "staged_call", "GpuPath", "gpu_path",
]

#: Environment variable giving the staging chunk size when ``Comm`` gets none (bytes; suffix k, M or G: KiB, MiB, GiB).
CHUNK_ENV = "MPIOPT_STAGING_CHUNK"
#: Default chunk: large enough that MPI runs near its bandwidth, small enough that a 400 MB buffer has 48 stages.
DEFAULT_CHUNK_BYTES = 8 << 20
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def staging_chunk_bytes(value: Any = None) -> Tuple[int, str]:
    """``(bytes, source)``: the staging chunk size from ``value``, else :data:`CHUNK_ENV`, else the default."""
    source = "staging_chunk" if value is not None else CHUNK_ENV
    asked = value if value is not None else os.environ.get(CHUNK_ENV, "").strip() or None
    if asked is None:
        return DEFAULT_CHUNK_BYTES, "default"
    if isinstance(asked, (int, np.integer)) and not isinstance(asked, bool):
        size = int(asked)
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?B)?\s*", str(asked))
        size = int(match.group(1)) * _SUFFIX[match.group(2).lower()] if match else 0
    if size < 1:
        raise ValueError(f"{source} must be a positive number of bytes such as 8388608 or 8M, got {asked!r}")
    return size, source if value is not None else f"{CHUNK_ENV}={asked}"


def chunk_ranges(total: int, chunk: int, itemsize: int = 1) -> List[Tuple[int, int]]:
    """Byte ranges ``[start, stop)`` that cover ``total`` bytes in order, each ``chunk`` bytes (rounded down to whole items, at least one) but the last."""
    if total % itemsize:
        raise ValueError(f"a buffer of {total} bytes is no whole number of {itemsize}-byte items")
    step = max(itemsize, chunk // itemsize * itemsize)
    return [(start, min(start + step, total)) for start in range(0, total, step)]


def schedule(
    count: int, copy_in: Callable[[int], None], start: Callable[[int], Any], copy_out: Callable[[int], None]
) -> Generator[Any, None, None]:
    """The pipelined order over ``count`` chunks, yielding each request (of ``start``) when it must be waited for.

    ``start(i)`` waits for ``copy_in(i)`` itself (an event on a GPU): the next copy in and the previous copy out
    are issued while chunk i is in MPI's hands.
    """
    requests = [None] * count
    if count:
        copy_in(0)
    for i in range(count):
        requests[i] = start(i)
        if i + 1 < count:
            copy_in(i + 1)
        if i:
            yield requests[i - 1]
            copy_out(i - 1)
    if count:
        yield requests[count - 1]
        copy_out(count - 1)


class StagedCall:
    """A running :func:`schedule` with the ``Test``/``Wait`` of an MPI request (what :class:`~mpiopt.comm.Request` holds)."""

    def __init__(self, steps: Generator[Any, None, None], finish: Callable[[], None]) -> None:
        self._steps, self._finish = steps, finish
        self._pending: Any = None
        self._advance()

    def _advance(self) -> None:
        self._pending = next(self._steps, None)
        if self._pending is None:
            self._finish()

    def Test(self) -> bool:
        """Advance past every completed chunk; True once the last result is back on the device."""
        while self._pending is not None and self._pending.Test():
            self._advance()
        return self._pending is None

    def Wait(self) -> None:
        """Run the schedule to its end."""
        while self._pending is not None:
            self._pending.Wait()
            self._advance()


class HostCopies:
    """The copies of host arrays treated as device arrays (the CPU twin of the GPU copiers, for tests and dry runs)."""

    def copy_in(self, i: int, device: Any, host: np.ndarray) -> None:
        copy_bytes(host, device)

    def ready(self, i: int) -> None:
        pass

    def copy_out(self, i: int, host: np.ndarray, device: Any) -> None:
        copy_bytes(device, host)

    def finish(self) -> None:
        pass


class TorchCopies:
    """Copies on two side streams of the buffer's device, after the current stream's kernels; an event per chunk copied in."""

    def __init__(self, device: Any) -> None:
        import torch

        self._torch = torch
        self._to_host, self._to_device = torch.cuda.Stream(device), torch.cuda.Stream(device)
        for side in (self._to_host, self._to_device):  # after the kernels that write or read the buffers
            side.wait_stream(torch.cuda.current_stream(device))
        self._copied: dict = {}

    def copy_in(self, i: int, device: Any, host: np.ndarray) -> None:
        with self._torch.cuda.stream(self._to_host):
            self._torch.from_numpy(host).copy_(device, non_blocking=True)
            self._copied[i] = self._to_host.record_event()

    def ready(self, i: int) -> None:
        self._copied.pop(i).synchronize()

    def copy_out(self, i: int, host: np.ndarray, device: Any) -> None:
        with self._torch.cuda.stream(self._to_device):
            device.copy_(self._torch.from_numpy(host), non_blocking=True)

    def finish(self) -> None:
        # Before the host buffers are reused and before the caller's kernels read the result.
        self._to_device.synchronize()


class CupyCopies:
    """:class:`TorchCopies` for cupy arrays."""

    def __init__(self) -> None:
        import cupy

        self._to_host = cupy.cuda.Stream(non_blocking=True)
        self._to_device = cupy.cuda.Stream(non_blocking=True)
        produced = cupy.cuda.get_current_stream().record()
        self._to_host.wait_event(produced)
        self._to_device.wait_event(produced)
        self._copied: dict = {}

    def copy_in(self, i: int, device: Any, host: np.ndarray) -> None:
        try:
            device.get(stream=self._to_host, out=host, blocking=False)
        except TypeError:  # cupy before 13 has no ``blocking``: the copy is asynchronous on a given stream
            device.get(stream=self._to_host, out=host)
        self._copied[i] = self._to_host.record()

    def ready(self, i: int) -> None:
        self._copied.pop(i).synchronize()

    def copy_out(self, i: int, host: np.ndarray, device: Any) -> None:
        device.set(host, stream=self._to_device)

    def finish(self) -> None:
        self._to_device.synchronize()


def staged(buffers: Sequence[Tuple[Any, bool, bool]], gpu_aware: bool, stage_host: bool = False) -> bool:
    """Whether ``(buf, read, write)`` buffers go through host memory: GPU arrays MPI cannot take, or any told to."""
    return stage_host or (not gpu_aware and any(is_gpu_array(buf) for buf, _, _ in buffers))


def _copier(buf: Any) -> Any:
    if not is_gpu_array(buf):
        return HostCopies()
    return TorchCopies(buf.device) if _is_torch(buf) else CupyCopies()


def _dtype(buf: Any) -> np.dtype:
    if _is_torch(buf):
        return torch_numpy_dtype(buf)
    return np.dtype(buf.dtype)


def staged_call(
    buffers: Sequence[Tuple[Any, bool, bool]],
    start: Callable[..., Any],
    staging: HostStaging,
    slots: Sequence[str],
    chunk: int,
) -> StagedCall:
    """Stage ``buffers`` (``(buf, read, write)``, equal sizes) in pinned chunks, ``start(*host_chunks)`` on each (a nonblocking MPI call).

    The host buffers are ``staging``'s ``slots``, whole-buffer sized, so no chunk waits for another's host memory.
    """
    size = nbytes(buffers[0][0])
    if any(nbytes(buf) != size for buf, _, _ in buffers):
        raise ValueError(f"staged buffers must have equal sizes, got {[nbytes(buf) for buf, _, _ in buffers]} bytes")
    kinds = {type(buf).__name__ for buf, _, _ in buffers}
    if is_gpu_array(buffers[0][0]) and len(kinds) > 1:
        raise ValueError(f"staged GPU buffers of one call must come from one library, got {', '.join(sorted(kinds))}")
    dtype = _dtype(buffers[0][0])
    ranges = chunk_ranges(size, chunk, dtype.itemsize)
    devices = [byte_view(buf) for buf, _, _ in buffers]
    hosts = [staging.get(slot, size) for slot in slots]
    copies = _copier(buffers[0][0])
    reads = [j for j, (_, read, _) in enumerate(buffers) if read]
    writes = [j for j, (_, _, write) in enumerate(buffers) if write]

    def copy_in(i: int) -> None:
        a, b = ranges[i]
        for j in reads:
            copies.copy_in(i, devices[j][a:b], hosts[j][a:b])

    def start_chunk(i: int) -> Any:
        copies.ready(i) if reads else None
        a, b = ranges[i]
        return start(*(host[a:b].view(dtype) for host in hosts))

    def copy_out(i: int) -> None:
        a, b = ranges[i]
        for j in writes:
            copies.copy_out(i, hosts[j][a:b], devices[j][a:b])

    return StagedCall(schedule(len(ranges), copy_in, start_chunk, copy_out), copies.finish)


class GpuPath(NamedTuple):
    """How this communicator moves GPU buffers: ``path`` (``"world of one"``, ``"cuda-aware"``, ``"staged"``) and why."""

    path: str
    chunk_bytes: Optional[int]
    reason: str

    def __str__(self) -> str:
        size = self.chunk_bytes or 0
        size_text = f"{size / (1 << 20):g} MiB" if size >= 1 << 20 else f"{size} bytes"
        chunk = f" in pipelined chunks of {size_text}" if self.path == "staged" else ""
        return f"{self.path}{chunk} ({self.reason})"


def gpu_path(size: int, gpu_aware: bool, aware_reason: str, chunk_bytes: int, chunk_reason: str) -> GpuPath:
    """Which path GPU buffers take at a world of ``size`` ranks, and why (for ``mpiopt info``)."""
    if size == 1:
        return GpuPath("world of one", None, "one rank: collectives are device-side copies, no MPI call")
    if gpu_aware:
        return GpuPath("cuda-aware", None, f"MPI takes GPU memory: {aware_reason}")
    return GpuPath("staged", chunk_bytes, f"MPI is not CUDA-aware: {aware_reason}; chunk size: {chunk_reason}")
