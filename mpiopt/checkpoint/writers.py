"""The two writers (``serial`` through rank 0, ``mpio`` in parallel) that fill the temporary checkpoint file alike.

How each works: docs/internals-checkpoint.md, "Writing".
"""

from __future__ import annotations

import os
import pickle
from typing import Iterator, List, Optional, Sequence

import h5py
import numpy as np

from ..comm import Comm
from ..comm.survival import INJECTION
from .agreement import on_all_ranks
from .files import discard, publish, temporary_path
from .layout import DATASET, Entry, write_entry

__all__ = ["DRIVER_ENV", "choose_writer", "write_serial", "hand_over", "write_parallel"]

# Tag of the hand-over messages to rank 0 (below the MPI minimum tag bound 32767).
_TAG = 0x7C4E
#: Environment variable that picks the writer: ``mpio`` (parallel HDF5) or ``serial`` (hand-over to rank 0).
DRIVER_ENV = "MPIOPT_CHECKPOINT_DRIVER"


def choose_writer() -> str:
    """The writer to use: ``$MPIOPT_CHECKPOINT_DRIVER``, else ``mpio`` when h5py has parallel HDF5, else ``serial``."""
    parallel = bool(h5py.get_config().mpi)
    choice = os.environ.get(DRIVER_ENV, "").strip().lower() or ("mpio" if parallel else "serial")
    if choice not in ("mpio", "serial"):
        raise ValueError(f"{DRIVER_ENV} must be 'mpio' or 'serial', got {choice!r}")
    if choice == "mpio" and not parallel:
        raise ValueError(f"{DRIVER_ENV}=mpio needs h5py built with parallel HDF5 (h5py.get_config().mpi is False)")
    return choice


def _byte_view(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array (any dtype, 0-d included) as a 1-D uint8 view, for MPI."""
    return array.reshape(-1).view(np.uint8)


def _write_state(group: h5py.Group, entries: Sequence[Entry], arrays: Iterator[np.ndarray], failure: Optional[BaseException]):
    """Write ``entries`` under ``group`` (None: the file has failed); drain every array regardless, to keep the hand-over in step."""
    for entry in entries:
        array = next(arrays) if entry.kind == DATASET else None
        if failure is None:
            try:
                write_entry(group, entry, array)
            except Exception as err:  # disk full, quota, ...: reported collectively
                failure = err
    return failure


def _receive_arrays(world: Comm, source: int, entries: Sequence[Entry]) -> Iterator[np.ndarray]:
    """Rank 0: the arrays of ``entries`` received from ``source`` one at a time, as the writer asks for them."""
    for entry in entries:
        if entry.kind == DATASET:
            dtype, shape, _ = entry.value
            array = np.empty(shape, dtype=np.dtype(dtype))
            if array.nbytes:
                world.Recv(_byte_view(array), source=source, tag=_TAG)
            yield array


def _receive_rank(world: Comm, source: int, ranks: Optional[h5py.Group], failure: Optional[BaseException]):
    """Rank 0's side of the hand-over from ``source``: a go/stop byte, then the header, then the arrays one by one."""
    world.Send(np.array([failure is None], dtype=np.uint8), source, _TAG)
    if failure is not None:
        return failure
    length = np.zeros(1, dtype=np.int64)
    world.Recv(length, source=source, tag=_TAG)
    header = np.empty(int(length[0]), dtype=np.uint8)
    world.Recv(header, source=source, tag=_TAG)
    entries = pickle.loads(header.tobytes())
    try:
        group = ranks.create_group(str(source))
    except Exception as err:
        group, failure = None, err
    return _write_state(group, entries, _receive_arrays(world, source, entries), failure)


def hand_over(world: Comm, entries: List[Entry], arrays: List[np.ndarray]) -> None:
    """A rank other than 0: wait for rank 0's go, then send the header and each array's raw bytes."""
    INJECTION.reached("checkpoint")
    go = np.zeros(1, dtype=np.uint8)
    world.Recv(go, source=0, tag=_TAG)
    if not go[0]:
        return
    header = np.frombuffer(pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    world.Send(np.array([header.size], dtype=np.int64), 0, _TAG)
    world.Send(header, 0, _TAG)
    for array in arrays:
        if array.nbytes:
            world.Send(_byte_view(array), 0, _TAG)


def write_serial(world: Comm, path: str, root_attrs, model, entries, arrays) -> Optional[BaseException]:
    """Rank 0: write everything to a temporary file next to ``path`` and rename it into place; the first failure or None."""
    tmp = temporary_path(path)
    failure: Optional[BaseException] = None
    f = ranks = None
    try:
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        f = h5py.File(tmp, "w", locking="best-effort")
        for name, value in root_attrs.items():
            f.attrs[name] = value
        if model is not None:
            failure = _write_state(f.create_group("model"), model[0], iter(model[1]), None)
        ranks = f.create_group("ranks")
        failure = _write_state(ranks.create_group("0"), entries, iter(arrays), failure)
    except Exception as err:
        failure = err
    INJECTION.reached("checkpoint")
    try:
        for source in range(1, world.size):
            failure = _receive_rank(world, source, ranks, failure)
    except BaseException:  # a rank lost in the hand-over (RankLost), or an interrupt: nothing half-written is left
        discard(f, tmp)
        raise
    if failure is None:
        try:
            f.attrs["complete"] = True  # last: a file without it never finished
            f.close()  # flushes
            publish(tmp, path)
        except Exception as err:
            failure = err
    if failure is not None:
        discard(f, tmp)
    return failure


def _create_layout(group: h5py.Group, entries: Sequence[Entry]) -> None:
    """Create ``entries`` under ``group``, datasets without their data: parallel HDF5 wants this done alike on every rank."""
    for entry in entries:
        write_entry(group, entry, None)


def _fill(group: h5py.Group, entries: Sequence[Entry], arrays: Sequence[np.ndarray]) -> None:
    """Write ``arrays`` into the datasets of ``entries`` created by :func:`_create_layout` (independent I/O)."""
    for entry, array in zip([e for e in entries if e.kind == DATASET], arrays):
        if array.size:
            group[entry.path][()] = array


def write_parallel(world: Comm, path: str, header, layouts: Sequence[Sequence[Entry]], model_arrays, arrays) -> Optional[str]:
    """Every rank: write with h5py's ``mpio`` driver; rank 0 renames.  None or why the write failed.

    Every rank creates every rank's groups and datasets alike (collective in parallel HDF5) from ``header`` and
    ``layouts``, then writes its own arrays.
    """
    tmp, root_attrs, model = header
    f: Optional[h5py.File] = None

    def create() -> None:
        nonlocal f
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        f = h5py.File(tmp, "w", driver="mpio", comm=world.mpi_comm_for_io(), locking="best-effort")

    def write() -> None:
        for name, value in root_attrs.items():
            f.attrs[name] = value
        if model is not None:
            _create_layout(f.create_group("model"), model)
        ranks = f.create_group("ranks")
        for rank, entries in enumerate(layouts):
            _create_layout(ranks.create_group(str(rank)), entries)
        if model is not None and world.rank == 0:
            _fill(f["model"], model, model_arrays)
        _fill(ranks[str(world.rank)], layouts[world.rank], arrays)

    def finish() -> None:
        f.attrs["complete"] = True  # last: a file without it never finished
        f.close()  # collective; flushes

    message = on_all_ranks(world, path, None, create)
    message = on_all_ranks(world, path, message, write)
    message = on_all_ranks(world, path, message, finish)
    if world.rank == 0 and message is None:
        try:
            publish(tmp, path)
        except Exception as err:
            message = f"cannot save checkpoint {path}: renaming on rank 0 failed: {type(err).__name__}: {err}"
    if message is not None:
        discard(f, tmp if world.rank == 0 else None)
    return message
