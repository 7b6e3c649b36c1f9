"""Collective save and load of one HDF5 checkpoint file; finding the newest valid one.

The file layout and the guarantees are described in :mod:`mpiopt.checkpoint`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import h5py
import mpi4py
import numpy as np
from mpi4py import MPI

from .._version import __version__
from ..comm import Comm
from .layout import DATASET, JSON_ATTRS, Entry, attr_decoded, decode_root_attrs, encode_root_attrs, flatten, read_group, write_entry

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "FORMAT",
    "FORMAT_VERSION",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_path",
    "list_checkpoints",
    "find_latest",
    "validate_checkpoint",
    "DRIVER_ENV",
]

FORMAT = "mpiopt-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"ckpt-(\d+)\.h5")
# Tag of the hand-over messages to rank 0 (below the MPI minimum tag bound 32767).
_TAG = 0x7C4E
#: Environment variable that picks the writer: ``mpio`` (parallel HDF5) or ``serial`` (hand-over to rank 0).
DRIVER_ENV = "MPIOPT_CHECKPOINT_DRIVER"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; raised on every rank with the same message."""


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read.

    Attributes
    ----------
    path : str
        The file.
    attrs : dict
        The root attributes, decoded (the caller's and the ones
        :func:`save_checkpoint` adds: ``world_size``, versions, ...).
    model : dict of numpy.ndarray or None
        Rank 0's model state as saved (on every rank); None when saved without one.
    rank_state : dict or None
        This rank's state, exactly as saved; None for a rank beyond the saved
        world size (``allow_world_size_change=True``).
    rank_states : list of dict or None
        Loaded at another world size (``allow_world_size_change=True``):
        every saved rank's state in rank order, on every rank, for the
        caller's redistribution (:mod:`mpiopt.algorithms.resize`); None at
        the saved world size.
    """

    path: str
    attrs: Dict[str, Any]
    model: Optional[Dict[str, np.ndarray]]
    rank_state: Optional[Dict[str, Any]]
    rank_states: Optional[List[Dict[str, Any]]] = None

    @property
    def world_size(self) -> int:
        """Number of ranks that wrote the checkpoint."""
        return int(self.attrs["world_size"])


# -- names and validity -----------------------------------------------------------------------
def checkpoint_path(directory: str, step: int) -> str:
    """``<directory>/ckpt-<step:09d>.h5``: the name :func:`find_latest` and ``keep`` look for."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return os.path.join(os.fspath(directory), f"ckpt-{int(step):09d}.h5")


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of the files named like :func:`checkpoint_path` in ``directory``, oldest step first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in names if (m := _NAME.fullmatch(name))]
    return sorted(found)


class _Invalid(Exception):
    """What is wrong with a checkpoint file (the message), before the path is put in front."""


def _open(path: str) -> h5py.File:
    """``path`` opened read-only as HDF5, or :class:`_Invalid` saying why not."""
    if not os.path.exists(path):
        raise _Invalid("no such file")
    try:
        # best-effort locking: reads work on file systems without POSIX locks (some NFS and Lustre mounts).
        return h5py.File(path, "r", locking="best-effort")
    except OSError as err:
        raise _Invalid(f"not a readable HDF5 file (truncated or corrupted?): {err}") from None


def _root_attr(f: h5py.File, name: str) -> Any:
    """A root attribute as a Python value (None when absent), for the checks and their messages."""
    value = f.attrs.get(name)
    try:
        return attr_decoded(value)
    except ValueError:
        return value


def _check(f: h5py.File) -> None:
    """Raise :class:`_Invalid` unless the open file is a whole mpiopt checkpoint (reads attributes only)."""
    fmt = _root_attr(f, "format")
    if fmt != FORMAT:
        raise _Invalid(f"not an mpiopt checkpoint (root attribute 'format' is {fmt!r}, expected {FORMAT!r})")
    version = _root_attr(f, "format_version")
    if version != FORMAT_VERSION:
        raise _Invalid(f"format version {version!r} is not supported (this mpiopt reads version {FORMAT_VERSION})")
    if _root_attr(f, "complete") is not True:
        raise _Invalid("incomplete: no completeness marker (root attribute 'complete'); the write did not finish")
    size = _root_attr(f, "world_size")
    ranks = set(f["ranks"]) if isinstance(f.get("ranks"), h5py.Group) else set()
    if type(size) is not int or ranks != {str(r) for r in range(size)}:
        raise _Invalid(f"/ranks does not hold one group per rank of the world size {size!r}")


def validate_checkpoint(path: str) -> Optional[str]:
    """None if ``path`` is a whole, readable mpiopt checkpoint, else what is wrong (cheap: reads no arrays)."""
    try:
        with _open(os.fspath(path)) as f:
            _check(f)
    except _Invalid as err:
        return str(err)
    except Exception as err:  # an attribute that cannot be read
        return f"cannot be read: {type(err).__name__}: {err}"
    return None


def find_latest(directory: str, *, warn: bool = True) -> Optional[str]:
    """The valid checkpoint with the highest step in ``directory``, or None.

    Not collective.  Invalid files (truncated, corrupted, incomplete,
    foreign) are skipped, each with a ``UserWarning`` naming it and what is
    wrong when ``warn`` is true.
    """
    for _, path in reversed(list_checkpoints(os.fspath(directory))):
        problem = validate_checkpoint(path)
        if problem is None:
            return path
        if warn:
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
    return None


# -- collective decisions -----------------------------------------------------------------------
def _agree(world: Comm, path: str, error: Optional[str], what: str, extra: Any = None) -> List[Any]:
    """Gather ``(path, error, extra)``; raise the same :class:`CheckpointError` everywhere if any rank failed or paths differ.

    Returns every rank's ``extra``.
    """
    everyone = world.allgather_obj((path, error, extra))
    paths = [p for p, _, _ in everyone]
    if len(set(paths)) > 1:
        listing = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(paths))
        raise CheckpointError(f"ranks disagree on the checkpoint to {what}: {listing}")
    errors = [(r, e) for r, (_, e, _) in enumerate(everyone) if e is not None]
    if errors:
        if len(errors) == world.size and len({e for _, e in errors}) == 1:
            raise CheckpointError(f"cannot {what} checkpoint {path}: {errors[0][1]}")
        raise CheckpointError(f"cannot {what} checkpoint {path}:\n" + "\n".join(f"  rank {r}: {e}" for r, e in errors))
    return [x for _, _, x in everyone]


# -- save ------------------------------------------------------------------------------------
def _own_attrs(world_size: int) -> Dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": world_size,
        "id": uuid.uuid4().hex,  # tells apart files of the same name (ranks must all read the same one)
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mpiopt_version": __version__,
        "numpy_version": np.__version__,
        "h5py_version": h5py.__version__,
        "hdf5_version": h5py.version.hdf5_version,
        "mpi4py_version": mpi4py.__version__,
        # Open MPI's ends in a NUL character (else the attribute would be stored as JSON text).
        "mpi_library_version": " ".join(MPI.Get_library_version().replace("\0", " ").splitlines()[0].split()),
    }


def _prepare_root(model: Optional[Mapping[str, np.ndarray]], attrs: Mapping[str, Any], world_size: int):
    """Rank 0's checks of ``model`` and ``attrs``: the root attributes and the flattened model."""
    if not isinstance(attrs, Mapping):
        raise TypeError(f"attrs must be a mapping, got {type(attrs).__name__}")
    own = _own_attrs(world_size)
    clash = sorted(set(attrs) & (set(own) | {"complete", JSON_ATTRS}))
    if clash:
        raise ValueError(f"attrs may not set {clash}: save_checkpoint writes these itself")
    # Encoded together: one list of the names stored as JSON covers the caller's attributes and ours.
    root_attrs = encode_root_attrs({**attrs, **own})
    if model is None:
        return root_attrs, None
    if not isinstance(model, Mapping):
        raise TypeError(f"model must be a mapping of names to numpy arrays or None, got {type(model).__name__}")
    for name, value in model.items():
        if not isinstance(value, np.ndarray):
            raise TypeError(f"model[{name!r}] must be a numpy array, got {type(value).__name__}")
    return root_attrs, flatten(model, "model")


def _byte_view(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array (any dtype, 0-d included) as a 1-D uint8 view, for MPI."""
    return array.reshape(-1).view(np.uint8)


def _write_state(group: h5py.Group, entries: Sequence[Entry], arrays: Iterator[np.ndarray], failure: Optional[BaseException]):
    """Write ``entries`` under ``group`` (None: nothing, the file has failed); consume every array regardless.

    ``arrays`` may be receiving from another rank: it must be drained even
    after a failure so that the hand-over protocol stays in step.  Returns
    the first failure.
    """
    for entry in entries:
        array = next(arrays) if entry.kind == DATASET else None
        if failure is None:
            try:
                write_entry(group, entry, array)
            except Exception as err:  # disk full, quota, ...: reported collectively
                failure = err
    return failure


def _receive_arrays(world: Comm, source: int, entries: Sequence[Entry]) -> Iterator[np.ndarray]:
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


def _hand_over(world: Comm, entries: List[Entry], arrays: List[np.ndarray]) -> None:
    """A rank other than 0: wait for rank 0's go, then send the header and each array's raw bytes."""
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


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary(path: str) -> str:
    """The name a checkpoint is written under before it is renamed to ``path``: same directory, hidden."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")


def _publish(tmp: str, path: str) -> None:
    """Rank 0, after the closed ``tmp`` is whole: fsync it, rename it to ``path``, fsync the directory."""
    _fsync(tmp)
    os.replace(tmp, path)
    try:
        _fsync(os.path.dirname(tmp))  # so that the rename itself survives a crash
    except OSError:
        pass  # some file systems cannot fsync a directory; the new file is in place either way


def _write_file(world: Comm, path: str, root_attrs, model, entries, arrays) -> Optional[BaseException]:
    """Rank 0: write everything to a temporary file next to ``path`` and rename it into place; the first failure or None."""
    tmp = _temporary(path)
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
    for source in range(1, world.size):
        failure = _receive_rank(world, source, ranks, failure)
    if failure is None:
        try:
            f.attrs["complete"] = True  # last: a file without it never finished
            f.close()  # flushes
            _publish(tmp, path)
        except Exception as err:
            failure = err
    if failure is not None:
        _discard(f, tmp)
    return failure


def _discard(f: Optional[h5py.File], tmp: Optional[str]) -> None:
    """Close a failed temporary file and delete it (``tmp`` None: close only); the failure already caught is the one worth reporting."""
    try:
        if f is not None:
            f.close()
    except Exception:
        pass
    try:
        if tmp is not None:
            os.remove(tmp)
    except OSError:
        pass


# -- save with parallel HDF5 ---------------------------------------------------------------------
def _driver() -> str:
    """The writer to use: ``$MPIOPT_CHECKPOINT_DRIVER``, else ``mpio`` when h5py has parallel HDF5, else ``serial``."""
    parallel = bool(h5py.get_config().mpi)
    choice = os.environ.get(DRIVER_ENV, "").strip().lower() or ("mpio" if parallel else "serial")
    if choice not in ("mpio", "serial"):
        raise ValueError(f"{DRIVER_ENV} must be 'mpio' or 'serial', got {choice!r}")
    if choice == "mpio" and not parallel:
        raise ValueError(f"{DRIVER_ENV}=mpio needs h5py built with parallel HDF5 (h5py.get_config().mpi is False)")
    return choice


def _create_layout(group: h5py.Group, entries: Sequence[Entry]) -> None:
    """Create ``entries`` under ``group``, datasets without their data: parallel HDF5 wants this done alike on every rank."""
    for entry in entries:
        write_entry(group, entry, None)


def _fill(group: h5py.Group, entries: Sequence[Entry], arrays: Sequence[np.ndarray]) -> None:
    """Write ``arrays`` into the datasets of ``entries`` created by :func:`_create_layout` (independent I/O)."""
    for entry, array in zip([e for e in entries if e.kind == DATASET], arrays):
        if array.size:
            group[entry.path][()] = array


def _on_all_ranks(world: Comm, path: str, message: Optional[str], step: Callable[[], None]) -> Optional[str]:
    """Run ``step()`` on every rank unless an earlier step failed (``message``); what failed anywhere, same on every rank."""
    if message is not None:
        return message
    error = None
    try:
        step()
    except Exception as err:  # disk full, quota, ...: reported collectively
        error = f"{type(err).__name__}: {err}"
    try:
        _agree(world, path, error, "save")
    except CheckpointError as err:
        return str(err)
    return None


def _write_parallel(world: Comm, path: str, header, layouts: Sequence[Sequence[Entry]], model_arrays, arrays) -> Optional[str]:
    """Every rank: write the checkpoint with h5py's ``mpio`` driver; rank 0 renames it into place.

    ``header`` is rank 0's ``(temporary name, root attributes, model
    entries or None)`` and ``layouts`` every rank's entries, so that every
    rank creates the same groups, datasets and attributes (collective in
    parallel HDF5); then each rank writes its own arrays, and rank 0 the
    model's, independently.  Returns None or why the write failed (on rank
    0 the final word, the rename included).
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

    message = _on_all_ranks(world, path, None, create)
    message = _on_all_ranks(world, path, message, write)
    message = _on_all_ranks(world, path, message, finish)
    if world.rank == 0 and message is None:
        try:
            _publish(tmp, path)
        except Exception as err:
            message = f"cannot save checkpoint {path}: renaming on rank 0 failed: {type(err).__name__}: {err}"
    if message is not None:
        _discard(f, tmp if world.rank == 0 else None)
    return message


def _prune(path: str, keep: int) -> None:
    """Delete the checkpoints next to ``path`` other than the newest ``keep`` by step; never ``path`` itself."""
    written = os.path.abspath(path)
    found = list_checkpoints(os.path.dirname(written))
    for _, old in found[: max(0, len(found) - keep)]:
        if os.path.abspath(old) == written:
            continue
        try:
            os.remove(old)
        except FileNotFoundError:
            pass
        except OSError as err:
            warnings.warn(f"could not delete old checkpoint {old}: {err}", stacklevel=3)


def save_checkpoint(
    path: str,
    world: Comm,
    *,
    model: Optional[Mapping[str, np.ndarray]],
    rank_state: Mapping[str, Any],
    attrs: Mapping[str, Any],
    keep: Optional[int] = None,
) -> str:
    """Write one checkpoint file atomically; a collective call on ``world``.

    Parameters
    ----------
    path : str or os.PathLike
        Where the file goes (same on every rank); :func:`checkpoint_path`
        gives the names that ``keep`` and :func:`find_latest` recognise.
    world : Comm
        Every rank that holds state (usually ``topology.world``).
    model : mapping of str to numpy.ndarray or None
        Rank 0's model state (``state_dict`` names to arrays); ignored on the
        other ranks.
    rank_state : mapping
        This rank's state: values are mappings (nested), numpy arrays, numpy
        scalars, bytes, None, bool, int, float or str.
    attrs : mapping
        Root attributes (step, algorithm, hyperparameters, configuration,
        torch version, ...); JSON-serialisable.  Rank 0's are written.
    keep : int, optional
        After a successful write, delete all but the newest ``keep``
        checkpoints (by step) named like :func:`checkpoint_path` in the same
        directory; the file just written is never deleted.

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    CheckpointError
        On every rank, when some rank's state cannot be stored (the message
        names the rank and the key), ranks pass different paths or
        different writers, or the write fails (disk full, permissions).
        Nothing is left at ``path`` then: a file already there is unchanged.

    Notes
    -----
    With h5py built with parallel HDF5, every rank writes its own state
    through the ``mpio`` driver; otherwise ranks hand their state to rank 0
    one at a time.  ``MPIOPT_CHECKPOINT_DRIVER=mpio|serial`` (same on every
    rank) forces either.  The file is the same either way.
    """
    path = os.fspath(path)
    error = None
    root_attrs = model_flat = driver = layout = None
    try:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < 1):
            raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
        entries, arrays = flatten(rank_state, "rank_state")
        if world.rank == 0:
            root_attrs, model_flat = _prepare_root(model, attrs, world.size)
        driver = _driver()
        if driver == "mpio":  # every rank must create every rank's objects: the layouts travel with the agreement
            model_entries = None if model_flat is None else model_flat[0]
            header = (_temporary(path), root_attrs, model_entries) if world.rank == 0 else None
            layout = (entries, header)
    except (TypeError, ValueError) as err:
        error = str(err)
    extras = _agree(world, path, error, "save", (driver, layout))
    if len({d for d, _ in extras}) > 1:
        listing = ", ".join(f"rank {r}: {d}" for r, (d, _) in enumerate(extras))
        raise CheckpointError(f"cannot save checkpoint {path}: ranks disagree on the writer ({DRIVER_ENV}): {listing}")
    failure: Optional[BaseException] = None
    message = None
    if driver == "mpio":
        model_arrays = None if model_flat is None else model_flat[1]
        message = _write_parallel(world, path, extras[0][1][1], [entries for _, (entries, _) in extras], model_arrays, arrays)
    elif world.rank == 0:
        failure = _write_file(world, path, root_attrs, model_flat, entries, arrays)
        if failure is not None:
            message = f"cannot save checkpoint {path}: writing on rank 0 failed: {type(failure).__name__}: {failure}"
    else:
        _hand_over(world, entries, arrays)
    if world.rank == 0 and message is None and keep is not None:
        _prune(path, int(keep))
    message = world.bcast_obj(message, root=0)
    if message is not None:
        raise CheckpointError(message) from failure
    return path


# -- load ------------------------------------------------------------------------------------
def _read(path: str, rank: int, size: int, allow_world_size_change: bool) -> Checkpoint:
    with _open(path) as f:
        _check(f)
        attrs = decode_root_attrs(f.attrs)
        saved = int(attrs["world_size"])
        if saved != size and not allow_world_size_change:
            raise _Invalid(
                f"written by {saved} rank{'s' * (saved != 1)}; this job has {size} (allow_world_size_change=True loads it anyway)"
            )
        model = read_group(f["model"]) if "model" in f else None
        if saved == size:
            return Checkpoint(path=path, attrs=attrs, model=model, rank_state=read_group(f["ranks"][str(rank)]))
        # Another world size: every rank needs every saved rank's state to redistribute it.
        states = [read_group(f["ranks"][str(r)]) for r in range(saved)]
    return Checkpoint(path=path, attrs=attrs, model=model, rank_state=states[rank] if rank < saved else None, rank_states=states)


def load_checkpoint(path: str, world: Comm, *, allow_world_size_change: bool = False) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`; a collective call on ``world``.

    Every rank opens the file read-only (a shared file system), reads the
    root attributes, the model and its own ``/ranks/<rank>``.

    Parameters
    ----------
    path : str or os.PathLike
        The file (same on every rank).
    world : Comm
        The job's ranks.
    allow_world_size_change : bool
        Load a checkpoint written by another number of ranks: ranks beyond
        the saved ones get ``rank_state=None``, every rank gets every saved
        rank's state in ``rank_states`` (memory: the whole file's rank
        states on each rank), and the caller decides what to do.

    Raises
    ------
    CheckpointError
        On every rank, with the same message naming the file and what is
        wrong: missing, truncated, corrupted, foreign or incomplete; written
        by another world size (both sizes named); ranks that disagree on the
        path or see different files under it.
    """
    path = os.fspath(path)
    result, error = None, None
    try:
        result = _read(path, world.rank, world.size, allow_world_size_change)
    except _Invalid as err:
        error = str(err)
    except Exception as err:  # h5py/OS errors reading data after a successful open
        error = f"cannot be read: {type(err).__name__}: {err}"
    identities = _agree(world, path, error, "load", None if result is None else result.attrs["id"])
    if len(set(identities)) > 1:
        listing = ", ".join(f"rank {r}: {i}" for r, i in enumerate(identities))
        raise CheckpointError(f"cannot load checkpoint {path}: ranks read different files under this name (ids {listing}); is the directory shared?")
    return result
