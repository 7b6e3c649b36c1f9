"""``--device`` and ``--precision``: which device each rank trains on, and the autocast around its forward pass.

One GPU per node-local rank: the launcher's local rank, else the rank among
the processes sharing the node's memory; never the world rank modulo the
count.  Rules and why: docs/gpu.md.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Mapping, Optional

from .config import DEVICES, PRECISIONS, agree_or_fail

__all__ = ["DEVICES", "PRECISIONS", "LOCAL_RANK_VARIABLES", "CudaView", "cuda_view", "local_rank", "resolve_device",
           "choose_device", "use_device", "autocast", "uses_scaler"]

#: The node-local rank as each launcher sets it, in the order read: Open MPI, MPICH/Hydra and Intel MPI, Slurm's srun.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID")


@dataclass(frozen=True)
class CudaView:
    """What this process sees of CUDA: the usable devices, and what a refusal names."""

    count: int
    visible: Optional[str]  # CUDA_VISIBLE_DEVICES, None where unset
    torch_cuda: Optional[str]  # torch.version.cuda: None for a CPU-only build

    def described(self) -> str:
        """The three facts looked at, in words."""
        build = f"torch built with CUDA {self.torch_cuda}" if self.torch_cuda else "torch built without CUDA (a CPU-only wheel)"
        visible = "unset" if self.visible is None else repr(self.visible)
        return f"torch.cuda.is_available() is {self.count > 0}, CUDA_VISIBLE_DEVICES is {visible}, {build}"


def cuda_view(environ: Optional[Mapping[str, str]] = None) -> CudaView:
    """This process's :class:`CudaView` (torch asked; no device is initialised beyond counting)."""
    import torch

    environ = os.environ if environ is None else environ
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return CudaView(count, environ.get("CUDA_VISIBLE_DEVICES"), torch.version.cuda)


def local_rank(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The node-local rank the launcher set (:data:`LOCAL_RANK_VARIABLES`), or None; ValueError for a malformed one."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        text = environ.get(name)
        if text is not None and text.strip():
            if not text.strip().isdigit():
                raise ValueError(f"{name} must be a node-local rank >= 0, got {text!r}")
            return int(text)
    return None


def resolve_device(setting: str, precision: str, view: CudaView, node_rank: int, node_size: int, *, share: bool = False) -> str:
    """The torch device of the rank at ``node_rank`` of the ``node_size`` on its node: ``"cpu"`` or ``"cuda:i"``.

    Node rank r takes device r (r % count only where ``share``); where the
    rank sees one device picked for it by CUDA_VISIBLE_DEVICES, that one.
    ``auto`` is the CPU where the node's ranks cannot each have a GPU.
    Refusals are ValueErrors naming the values.
    """
    if setting not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {setting!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if setting == "cuda" and view.count == 0:
        raise ValueError(f"--device cuda, but no GPU is visible to this rank: {view.described()}")
    device = "cpu"
    if setting != "cpu" and view.count > 0:
        per_rank = view.count == 1 and view.visible is not None and view.visible.strip() != ""
        if setting == "auto" and node_size > view.count and not (per_rank or share):
            pass  # a laptop's GPU and mpiexec -n 4: every rank on the CPU, as before --device
        elif node_rank < view.count or per_rank or share:
            device = f"cuda:{0 if per_rank else node_rank % view.count}"
        else:
            raise ValueError(f"node-local rank {node_rank} has no GPU of its own: {view.count} visible ({view.described()}); "
                             "launch one rank per GPU, give each rank its CUDA_VISIBLE_DEVICES, or let ranks share with --share-gpus")
    if precision == "fp16" and device == "cpu":
        raise ValueError("--precision fp16 needs a GPU (float16 autocast with a gradient scaler); on the CPU use bf16 or fp32")
    return device


def autocast(device: Any, precision: str) -> ContextManager[Any]:
    """``torch.autocast`` on ``device`` for ``precision`` (bf16, fp16), nothing for fp32."""
    import torch

    if precision == "fp32":
        return nullcontext()
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def uses_scaler(precision: str) -> bool:
    """Whether ``precision`` trains with a gradient scaler (float16: its small exponent underflows gradients)."""
    return precision == "fp16"


def choose_device(setting: str, precision: str, share: bool, comm: Any) -> str:
    """This rank's device (:func:`resolve_device`; collective over ``comm``): a refusal on any rank is every rank's UsageError.

    The node-local rank is the launcher's, else the rank among those sharing this node's memory.
    """
    node = comm.Split_shared("node")
    node_rank, node_size = node.rank, node.size
    node.Free()

    def resolve() -> str:
        given = local_rank()
        return resolve_device(setting, precision, cuda_view(), node_rank if given is None else given, node_size, share=share)

    return agree_or_fail(comm, None, resolve)


def use_device(device: str) -> None:
    """Make ``device`` the current CUDA device of torch and of cupy (the algorithms' kernels launch there); nothing for the CPU."""
    if not device.startswith("cuda"):
        return
    import torch

    index = torch.device(device).index or 0
    torch.cuda.set_device(index)
    try:
        import cupy
    except ImportError:  # the algorithms then fall back as mpiopt.arrays decides
        return
    cupy.cuda.Device(index).use()
