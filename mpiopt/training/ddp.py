"""The ``ddp`` baseline of ``mpiopt train`` and ``compare``: torch ``DistributedDataParallel`` on gloo (NCCL on GPUs).

What users run today, trained by the same loop as the mpiopt algorithms so
that one ``compare`` puts them side by side.  Its bytes are an estimate and its
Allreduce time is inside its compute time (:data:`NOTES`; docs/training-internals.md).
"""

from __future__ import annotations

import atexit
import gc
import inspect
import os
import socket
import time
import warnings
from typing import Any, FrozenSet, Optional

import torch
import torch.distributed as dist

from ..algorithms.base import StepRecord
from ..torch.optimizer import loss_value
from ..comm import Topology

__all__ = ["NOTES", "MODELLED_AS", "DDPBaseline", "hyperparameter_names"]

#: What the run header says about the baseline's step records.
NOTES = {
    "bytes": "estimated: the ledger's convention for an Allreduce of the float32 gradient (4 d sent, 4 d received per step); "
    "DDP's gloo traffic does not pass mpiopt's ledger",
    "compute_seconds": "forward, backward and DDP's gradient Allreduce (overlapped with the backward pass); comm_seconds is 0",
}


#: The mpiopt algorithm whose plan and computation the alpha-beta model uses for DDP: ``sgd``, one Allreduce of
#: the gradient a step.  DDP's hooks fold that exchange into its backward pass, so its own time outside MPI is not
#: measured apart; its Allreduce is priced with gloo's fit, which runs it (docs/crossover.md).
MODELLED_AS = "sgd"


def hyperparameter_names() -> FrozenSet[str]:
    """The keywords the baseline takes: those of ``torch.optim.SGD``."""
    return frozenset(inspect.signature(torch.optim.SGD.__init__).parameters) - {"self", "params"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_gloo(topology: Topology, backend: str = "gloo") -> None:
    """Start a torch.distributed group (gloo; nccl for GPUs) over the MPI world (ranks, size and rank 0's port from MPI)."""
    hosts = topology.world.allgather_obj(socket.gethostname())
    one_host = len(set(hosts)) == 1
    if one_host:
        # Loopback: inside tools/emulated_link.sh, the shaped device.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    address = "127.0.0.1" if one_host else hosts[0]
    port = topology.world.bcast_obj(_free_port() if topology.rank == 0 else None)
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=topology.rank, world_size=topology.size)
    # Ended while the interpreter is still whole: gloo's worker threads torn down during its finalization can
    # abort the process ("terminate called without an active exception", pytorch/pytorch#190489).
    atexit.register(_destroy_gloo)


def _destroy_gloo() -> None:
    """Destroy the process group init_gloo started, unless its user did already."""
    if dist.is_initialized():
        gc.collect()  # DDP wrappers still held in reference cycles go while their group lives
        dist.destroy_process_group()


class DDPBaseline:
    """A model wrapped in ``DistributedDataParallel`` over gloo, and its optimizer (a collective constructor).

    ``optimizer``: ``--optimizer``'s over ``model``'s parameters; default
    ``torch.optim.SGD`` with ``hyper`` (checked before any communication).
    """

    def __init__(self, model: torch.nn.Module, topology: Topology, optimizer: Optional[torch.optim.Optimizer] = None,
                 scaler: Optional[torch.amp.GradScaler] = None, **hyper: Any) -> None:
        # Bad keywords fail here, on every rank alike.
        self.optimizer = optimizer if optimizer is not None else torch.optim.SGD(model.parameters(), **hyper)
        self.scaler = scaler  # --precision fp16: torch's scaler (DDP's averaged gradient carries an overflow to every rank)
        device = next(model.parameters()).device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if dist.is_initialized() and dist.get_backend() != backend:
            dist.destroy_process_group()  # a job's runs share one device, so this is a library user's other group
        if not dist.is_initialized():
            init_gloo(topology, backend)
        with warnings.catch_warnings():
            # torch 2.13 deprecates broadcast_buffers, but its replacement still syncs at set-up.
            warnings.filterwarnings("ignore", message=".*broadcast_buffers", category=FutureWarning)
            # mpiopt averages BatchNorm statistics before evaluations only: so does the baseline.
            ids = [device.index] if device.type == "cuda" else None
            self.network = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
        gradient_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._bytes = gradient_bytes if topology.size > 1 else 0  # at one rank a collective moves nothing
        self.steps = 0
        self.last = StepRecord(0, None, 0, 0, 0.0, 0.0, 0.0)

    @property
    def algorithm(self) -> "DDPBaseline":
        """Where the loop reads the learning rate (``opt.algorithm.lr``), as of an mpiopt algorithm."""
        return self

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self, loss: Any = None) -> None:
        """Apply the mean gradient (already averaged by DDP during ``backward``)."""
        started = time.perf_counter()
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
        self.steps += 1
        self.last = StepRecord(self.steps, loss_value(loss), self._bytes, self._bytes, 0.0, 0.0, time.perf_counter() - started)

    def finish(self) -> None:
        """Nothing in flight: the process group stays up for later runs of the job."""
