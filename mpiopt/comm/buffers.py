"""Array buffers for MPI: numpy, torch (CPU and CUDA) and cupy.

CPU arrays go to mpi4py without a copy (a torch CPU tensor through its
zero-copy numpy view).  GPU arrays (cupy, torch CUDA, anything with
``__cuda_array_interface__``) go to mpi4py directly when the MPI library is
GPU-aware; otherwise they are staged through reusable host buffers that grow
on demand (pinned when cupy or torch can pin them).  Either way the stream that
produced the GPU data is synchronised first: MPI knows nothing of CUDA streams
and would read memory that a kernel is still writing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

__all__ = [
    "nbytes",
    "is_gpu_array",
    "gpu_aware_mpi",
    "HostStaging",
    "as_mpi_buffer",
    "tensor_array",
]

GPU_AWARE_ENV = "MPIOPT_GPU_AWARE"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _is_torch(buf: Any) -> bool:
    return type(buf).__module__.startswith("torch") and hasattr(buf, "is_cuda")


def is_gpu_array(buf: Any) -> bool:
    """Whether ``buf`` lives in GPU memory (cupy array, torch CUDA tensor, ...)."""
    if _is_torch(buf):
        return bool(buf.is_cuda)
    return hasattr(buf, "__cuda_array_interface__")


def nbytes(buf: Any) -> int:
    """Size in bytes of a numpy/cupy array or torch tensor."""
    if _is_torch(buf):
        return buf.numel() * buf.element_size()
    try:
        return int(buf.nbytes)
    except AttributeError:
        raise TypeError(f"buffer must be a numpy/cupy array or a torch tensor, got {type(buf).__name__}") from None


def _parse_flag(value: str, name: str) -> bool:
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name} must be one of 1/0/true/false/yes/no/on/off, got {value!r}")


def gpu_aware_mpi(override: Optional[bool] = None) -> Tuple[bool, str]:
    """Decide whether the MPI library can read and write GPU memory directly.

    Parameters
    ----------
    override : bool, optional
        Explicit answer; wins over everything else.

    Returns
    -------
    (aware, reason) : tuple of bool and str
        ``reason`` says where the answer came from: the argument, the
        ``MPIOPT_GPU_AWARE`` environment variable, the MPI 4.1
        ``mpi_memory_alloc_kinds`` info key, or the MPICH/Open MPI extension
        ``MPIX_Query_cuda_support``.
    """
    if override is not None:
        return bool(override), "argument"
    env = os.environ.get(GPU_AWARE_ENV)
    if env is not None and env.strip():
        return _parse_flag(env, GPU_AWARE_ENV), f"{GPU_AWARE_ENV}={env}"
    from mpi4py import MPI

    try:
        info = MPI.COMM_WORLD.Get_info()
        kinds = info.Get("mpi_memory_alloc_kinds") or ""
        info.Free()
    except Exception:  # noqa: BLE001 - libraries older than MPI 4.1 lack the key
        kinds = ""
    if "cuda" in kinds.lower():
        return True, f"mpi_memory_alloc_kinds={kinds}"
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
        query.restype = ctypes.c_int
        return bool(query()), "MPIX_Query_cuda_support"
    except (AttributeError, OSError):
        return False, "no GPU support reported by the MPI library"


def _synchronize(buf: Any) -> None:
    """Wait for the stream that produces ``buf`` before MPI touches it."""
    if _is_torch(buf):
        import torch

        torch.cuda.current_stream(buf.device).synchronize()
    else:
        import cupy

        cupy.cuda.get_current_stream().synchronize()


class HostStaging:
    """Reusable host buffers, one per named slot, grown on demand.

    Pinned (page-locked) memory makes device-host copies faster and is
    allocated through cupy or torch when one of them is present.
    """

    def __init__(self) -> None:
        self._slots: Dict[str, np.ndarray] = {}

    def get(self, slot: str, size: int) -> np.ndarray:
        """A uint8 host array of at least ``size`` bytes for ``slot``."""
        have = self._slots.get(slot)
        if have is None or have.nbytes < size:
            have = self._slots[slot] = self._allocate(max(size, 2 * (0 if have is None else have.nbytes)))
        return have[:size]

    @staticmethod
    def _allocate(size: int) -> np.ndarray:
        try:
            import cupy

            mem = cupy.cuda.alloc_pinned_memory(size)
            return np.frombuffer(mem, dtype=np.uint8, count=size)
        except Exception:  # noqa: BLE001 - no cupy, or cupy without a usable GPU: try torch, then pageable
            pass
        try:
            import torch

            if torch.cuda.is_available():
                return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        except ImportError:
            pass
        return np.empty(size, dtype=np.uint8)


def _cupy_contiguous(buf: Any) -> bool:
    flags = getattr(buf, "flags", None)
    if flags is not None:
        return bool(flags.c_contiguous)
    interface = buf.__cuda_array_interface__  # other producers: no strides means C order
    return interface.get("strides") is None


def tensor_array(tensor: Any) -> Any:
    """A numpy (CPU) or cupy (CUDA) array sharing a torch ``tensor``'s memory."""
    if tensor.is_cuda:
        try:
            import cupy
        except ImportError:
            raise RuntimeError(
                "CUDA parameters need cupy for mpiopt's GPU path: pip install cupy-cuda12x (the 'cuda' extra)"
            ) from None
        return cupy.asarray(tensor)
    return tensor.numpy()


def torch_numpy_dtype(tensor: Any) -> np.dtype:
    """The numpy dtype of a torch tensor's elements (TypeError naming a dtype numpy lacks)."""
    import torch

    try:
        return torch.empty(0, dtype=tensor.dtype).numpy().dtype
    except TypeError:
        raise TypeError(f"torch dtype {tensor.dtype} has no MPI/numpy equivalent; cast to float32 first") from None


def as_mpi_buffer(
    buf: Any,
    *,
    gpu_aware: bool,
    staging: HostStaging,
    slot: str,
    read: bool,
    write: bool,
) -> Tuple[Any, Optional[Callable[[], None]]]:
    """Turn ``buf`` into an object mpi4py accepts, without copying where possible.

    Parameters
    ----------
    buf : numpy.ndarray, torch.Tensor or GPU array
        Contiguous array.
    gpu_aware : bool
        Pass GPU memory to MPI directly.
    staging : HostStaging
        Host buffers used when GPU memory must be staged.
    slot : str
        Name of the staging slot (distinct for buffers used in one call).
    read, write : bool
        Whether MPI reads ``buf`` (its data must be copied in when staged) and
        whether it writes it (the data must be copied back afterwards).

    Returns
    -------
    (mpi_buf, writeback)
        ``writeback`` is None or a function to call once MPI has written the
        staged host copy (after the call, or after ``Wait`` for nonblocking
        calls).
    """
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"buffer must be C-contiguous, got an array with strides {buf.strides}")
        return buf, None
    if _is_torch(buf) and not buf.is_cuda:
        if not buf.is_contiguous():
            raise ValueError(f"tensor must be contiguous, got strides {tuple(buf.stride())}")
        return buf.detach().numpy(), None
    if not is_gpu_array(buf):
        raise TypeError(f"buffer must be a numpy/cupy array or a torch tensor, got {type(buf).__name__}")

    contiguous = buf.is_contiguous() if _is_torch(buf) else _cupy_contiguous(buf)
    if not contiguous:
        raise ValueError("GPU buffer must be C-contiguous (a strided view would be staged into a copy and its result lost)")
    _synchronize(buf)
    if gpu_aware:
        return (buf.detach() if _is_torch(buf) else buf), None

    if _is_torch(buf):
        import torch

        flat = buf.detach().reshape(-1)
        host = staging.get(slot, nbytes(buf)).view(torch_numpy_dtype(buf))
        host_t = torch.from_numpy(host)
        if read:
            host_t.copy_(flat)
        writeback = (lambda: flat.copy_(host_t)) if write else None
        return host, writeback

    import cupy

    dev = cupy.asarray(buf).reshape(-1)
    host = staging.get(slot, dev.nbytes).view(dev.dtype)
    if read:
        dev.get(out=host)
    writeback = (lambda: dev.set(host)) if write else None
    return host, writeback
