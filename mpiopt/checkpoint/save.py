"""``save_checkpoint``: every rank's state into one file, atomically, as one collective call."""

from __future__ import annotations

import datetime
import os
import uuid
from typing import Any, Dict, Mapping, Optional

import h5py
import mpi4py
import numpy as np

from .._version import __version__
from ..comm import Comm
from ..comm.process import library_version
from .agreement import CheckpointError, agree
from .files import FORMAT, FORMAT_VERSION, prune, remove_abandoned, temporary_path
from .layout import JSON_ATTRS, encode_root_attrs, flatten
from .writers import DRIVER_ENV, choose_writer, hand_over, write_parallel, write_serial

__all__ = ["save_checkpoint"]


def _own_attrs(world_size: int) -> Dict[str, Any]:
    """The root attributes save_checkpoint writes itself: format, world size, a random id, when, and the versions."""
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
        "mpi_library_version": library_version(),
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
    model : mapping of str to numpy.ndarray or None
        Rank 0's model state; ignored on the other ranks.
    rank_state : mapping
        This rank's state: nested mappings, numpy arrays and scalars, bytes, None, bool, int, float or str.
    attrs : mapping
        Root attributes (JSON-serialisable); rank 0's are written.
    keep : int, optional
        After a successful write, delete all but the newest ``keep`` checkpoints named by ``checkpoint_path``.

    Raises
    ------
    CheckpointError
        On every rank, when a state cannot be stored, ranks disagree on path or writer, or the write fails;
        nothing is left at ``path`` then.  Writers (``MPIOPT_CHECKPOINT_DRIVER``): docs/internals-checkpoint.md.
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
        driver = choose_writer()
        if driver == "mpio":  # every rank must create every rank's objects: the layouts travel with the agreement
            model_entries = None if model_flat is None else model_flat[0]
            header = (temporary_path(path), root_attrs, model_entries) if world.rank == 0 else None
            layout = (entries, header)
    except (TypeError, ValueError) as err:
        error = str(err)
    extras = agree(world, path, error, "save", (driver, layout))
    if len({d for d, _ in extras}) > 1:
        listing = ", ".join(f"rank {r}: {d}" for r, (d, _) in enumerate(extras))
        raise CheckpointError(f"cannot save checkpoint {path}: ranks disagree on the writer ({DRIVER_ENV}): {listing}")
    failure: Optional[BaseException] = None
    message = None
    if driver == "mpio":
        model_arrays = None if model_flat is None else model_flat[1]
        message = write_parallel(world, path, extras[0][1][1], [entries for _, (entries, _) in extras], model_arrays, arrays)
    elif world.rank == 0:
        failure = write_serial(world, path, root_attrs, model_flat, entries, arrays)
        if failure is not None:
            message = f"cannot save checkpoint {path}: writing on rank 0 failed: {type(failure).__name__}: {failure}"
    else:
        hand_over(world, entries, arrays)
    if world.rank == 0 and message is None:
        remove_abandoned(path)
        if keep is not None:
            prune(path, int(keep))
    message = world.bcast_obj(message, root=0)
    if message is not None:
        raise CheckpointError(message) from failure
    return path
