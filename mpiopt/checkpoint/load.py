"""``load_checkpoint``: every rank reads the attributes, the model and its own state, as one collective call."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..comm import Comm
from .agreement import CheckpointError, agree
from .files import InvalidFile, check_format, open_readonly
from .layout import decode_root_attrs, read_group

__all__ = ["Checkpoint", "load_checkpoint"]


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read: ``path``, ``attrs``, ``model`` (rank 0's, or None), ``rank_state``.

    At another world size (``allow_world_size_change=True``), or where the caller's ``read_all`` asks for them,
    ``rank_states`` holds every saved rank's state for the caller's redistribution (``rank_state`` is None beyond
    the saved ranks).
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


def _read(path: str, rank: int, size: int, allow_world_size_change: bool, read_all: Callable[[Dict[str, Any]], bool]) -> Checkpoint:
    with open_readonly(path) as f:
        check_format(f)
        attrs = decode_root_attrs(f.attrs)
        saved = int(attrs["world_size"])
        if saved != size and not allow_world_size_change:
            raise InvalidFile(
                f"written by {saved} rank{'s' * (saved != 1)}; this job has {size} (allow_world_size_change=True loads it anyway)"
            )
        model = read_group(f["model"]) if "model" in f else None
        if saved == size and not read_all(attrs):
            return Checkpoint(path=path, attrs=attrs, model=model, rank_state=read_group(f["ranks"][str(rank)]))
        # Another world size (or layout): every rank needs every saved rank's state to redistribute it.
        states = [read_group(f["ranks"][str(r)]) for r in range(saved)]
    return Checkpoint(path=path, attrs=attrs, model=model, rank_state=states[rank] if rank < saved else None, rank_states=states)


def load_checkpoint(path: str, world: Comm, *, allow_world_size_change: bool = False,
                    read_all: Optional[Callable[[Dict[str, Any]], bool]] = None) -> Checkpoint:
    """Read a checkpoint written by :func:`~mpiopt.checkpoint.save_checkpoint`; a collective call on ``world``.

    ``allow_world_size_change`` loads one of another world size (see :class:`Checkpoint`); ``read_all(attrs)``, true
    for the root attributes of a checkpoint whose states move between ranks at the same size, reads them all too.

    Raises
    ------
    CheckpointError
        On every rank, naming the file and what is wrong (missing, truncated, foreign, incomplete, another world
        size, ranks that disagree on the path or the file).
    """
    path = os.fspath(path)
    result, error = None, None
    try:
        result = _read(path, world.rank, world.size, allow_world_size_change, read_all or (lambda attrs: False))
    except InvalidFile as err:
        error = str(err)
    except Exception as err:  # h5py/OS errors reading data after a successful open
        error = f"cannot be read: {type(err).__name__}: {err}"
    identities = agree(world, path, error, "load", None if result is None else result.attrs["id"])
    if len(set(identities)) > 1:
        listing = ", ".join(f"rank {r}: {i}" for r, i in enumerate(identities))
        raise CheckpointError(f"cannot load checkpoint {path}: ranks read different files under this name (ids {listing}); is the directory shared?")
    return result
