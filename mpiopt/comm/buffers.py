"""Array buffers for MPI: numpy, torch (CPU and CUDA) and cupy, staged through host memory where MPI is not GPU-aware.

The producing CUDA stream is synchronised first: MPI would read memory a kernel is still writing.
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
    "byte_view",
    "check_buffer",
    "copy_bytes",
]

GPU_AWARE_ENV = "MPIOPT_GPU_AWARE"
# The CUDA driver a CUDA-aware MPI loads at run time (Linux, where these MPIs run).
_CUDA_DRIVER = "libcuda.so.1" if os.name == "posix" else ""
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
    """``(aware, reason)``: whether MPI can use GPU memory directly, and where the answer came from (docs/internals-comm.md)."""
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
        aware = bool(query())
    except (AttributeError, OSError):
        return False, "no GPU support reported by the MPI library"
    if aware and _CUDA_DRIVER and not _loads(_CUDA_DRIVER):
        # Open MPI 4.1 answers from how it was built; without the driver it runs as a plain MPI (and says so)
        return False, f"MPIX_Query_cuda_support is 1, but {_CUDA_DRIVER} does not load: the library runs without CUDA"
    return aware, "MPIX_Query_cuda_support"


def _loads(library: str) -> bool:
    """Whether this process can load the shared library ``library``."""
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


def _synchronize(buf: Any) -> None:
    """Wait for the stream that produces ``buf`` before MPI touches it."""
    if _is_torch(buf):
        import torch

        torch.cuda.current_stream(buf.device).synchronize()
    else:
        import cupy

        cupy.cuda.get_current_stream().synchronize()


class HostStaging:
    """Reusable host buffers, one per named slot, grown on demand; pinned through cupy or torch when present."""

    def __init__(self) -> None:
        self._slots: Dict[str, np.ndarray] = {}

    def get(self, slot: str, size: int) -> np.ndarray:
        """A uint8 host array of at least ``size`` bytes for ``slot``."""
        have = self._slots.get(slot)
        if have is None or have.nbytes < size:
            have = self._slots[slot] = self._allocate(max(size, 2 * (0 if have is None else have.nbytes)))
        return have[:size]

    def __len__(self) -> int:
        """The number of slots allocated."""
        return len(self._slots)

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


def byte_view(buf: Any) -> Any:
    """A flat uint8 view of a contiguous buffer in its own library (numpy, torch or cupy): no copy."""
    check_buffer(buf)
    if _is_torch(buf):
        import torch

        return buf.detach().reshape(-1).view(torch.uint8)
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    import cupy

    return cupy.asarray(buf).reshape(-1).view(cupy.uint8)


def copy_bytes(dst: Any, src: Any, count: Optional[int] = None) -> None:
    """Copy the first ``count`` bytes of ``src`` (all by default) to the start of ``dst``; on the device, in stream order, for GPU arrays."""
    count = nbytes(src) if count is None else count
    if count > nbytes(dst):
        raise ValueError(f"cannot copy {count} bytes into a buffer of {nbytes(dst)}")
    to, of = byte_view(dst)[:count], byte_view(src)[:count]
    if _is_torch(to) or _is_torch(of):
        import torch

        def tensor(x: Any) -> Any:
            return x if _is_torch(x) else torch.as_tensor(x, device="cuda" if is_gpu_array(x) else "cpu")

        tensor(to).copy_(tensor(of))
    elif is_gpu_array(to) and isinstance(of, np.ndarray):
        to.set(of)
    elif is_gpu_array(to):
        to[...] = of
    elif is_gpu_array(of):
        of.get(out=to)
    else:
        np.copyto(to, of)


def check_buffer(buf: Any) -> None:
    """Raise unless ``buf`` is a C-contiguous numpy/cupy array or torch tensor (TypeError, ValueError)."""
    if isinstance(buf, np.ndarray):
        ok = buf.flags.c_contiguous
    elif _is_torch(buf):
        ok = buf.is_contiguous()
    elif is_gpu_array(buf):
        ok = _cupy_contiguous(buf)
    else:
        raise TypeError(f"buffer must be a numpy/cupy array or a torch tensor, got {type(buf).__name__}")
    if not ok:
        raise ValueError(f"buffer must be C-contiguous, got a strided {type(buf).__name__} (its result would be lost in a copy)")


def as_mpi_buffer(
    buf: Any,
    *,
    gpu_aware: bool,
    staging: HostStaging,
    slot: str,
    read: bool,
    write: bool,
) -> Tuple[Any, Optional[Callable[[], None]]]:
    """Turn ``buf`` into ``(mpi_buf, writeback)`` for mpi4py, without copying where possible.

    ``read``/``write`` say whether MPI reads ``buf`` (copied in when staged) or writes it: then ``writeback``
    copies the staged host data back once MPI has written it (after the call, or after ``Wait``); else None.
    ``slot`` names the staging buffer (distinct for buffers used in one call).
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
