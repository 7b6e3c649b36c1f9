"""A checkpoint file on disk: its name, the format check, atomic publication (write, fsync, rename) and pruning."""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, List, Optional, Tuple

import h5py
import numpy as np

from .layout import attr_decoded

__all__ = [
    "FORMAT", "FORMAT_VERSION", "InvalidFile", "checkpoint_path", "list_checkpoints", "open_readonly", "check_format",
    "validate_checkpoint", "find_latest", "temporary_path", "publish", "discard", "prune", "remove_abandoned",
]

FORMAT = "mpiopt-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"ckpt-(\d+)\.h5")
_TEMPORARY = re.compile(r"\.ckpt-(\d+)\.h5\.tmp-\d+")  # temporary_path's names


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


class InvalidFile(Exception):
    """What is wrong with a checkpoint file (the message), before the path is put in front."""


def open_readonly(path: str) -> h5py.File:
    """``path`` opened read-only as HDF5, or :class:`InvalidFile` saying why not."""
    if not os.path.exists(path):
        raise InvalidFile("no such file")
    try:
        # best-effort locking: reads work on file systems without POSIX locks (some NFS and Lustre mounts).
        return h5py.File(path, "r", locking="best-effort")
    except OSError as err:
        raise InvalidFile(f"not a readable HDF5 file (truncated or corrupted?): {err}") from None


def _root_attr(f: h5py.File, name: str) -> Any:
    """A root attribute as a Python value (None when absent), for the checks and their messages."""
    value = f.attrs.get(name)
    try:
        return attr_decoded(value)
    except ValueError:
        return value


def check_format(f: h5py.File) -> None:
    """Raise :class:`InvalidFile` unless the open file is a whole mpiopt checkpoint (reads attributes only)."""
    fmt = _root_attr(f, "format")
    if fmt != FORMAT:
        raise InvalidFile(f"not an mpiopt checkpoint (root attribute 'format' is {fmt!r}, expected {FORMAT!r})")
    version = _root_attr(f, "format_version")
    if version != FORMAT_VERSION:
        raise InvalidFile(f"format version {version!r} is not supported (this mpiopt reads version {FORMAT_VERSION})")
    if _root_attr(f, "complete") is not True:
        raise InvalidFile("incomplete: no completeness marker (root attribute 'complete'); the write did not finish")
    size = _root_attr(f, "world_size")
    ranks = set(f["ranks"]) if isinstance(f.get("ranks"), h5py.Group) else set()
    if type(size) is not int or ranks != {str(r) for r in range(size)}:
        raise InvalidFile(f"/ranks does not hold one group per rank of the world size {size!r}")


def validate_checkpoint(path: str) -> Optional[str]:
    """None if ``path`` is a whole, readable mpiopt checkpoint, else what is wrong (cheap: reads no arrays)."""
    try:
        with open_readonly(os.fspath(path)) as f:
            check_format(f)
    except InvalidFile as err:
        return str(err)
    except Exception as err:  # an attribute that cannot be read
        return f"cannot be read: {type(err).__name__}: {err}"
    return None


def find_latest(directory: str, *, warn: bool = True) -> Optional[str]:
    """The valid checkpoint with the highest step in ``directory``, or None (not collective; invalid files skipped, warned)."""
    for _, path in reversed(list_checkpoints(os.fspath(directory))):
        problem = validate_checkpoint(path)
        if problem is None:
            return path
        if warn:
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
    return None


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_path(path: str) -> str:
    """The name a checkpoint is written under before it is renamed to ``path``: same directory, hidden."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")


def publish(tmp: str, path: str) -> None:
    """Rank 0, after the closed ``tmp`` is whole: fsync it, rename it to ``path``, fsync the directory."""
    _fsync(tmp)
    os.replace(tmp, path)
    try:
        _fsync(os.path.dirname(tmp))  # so that the rename itself survives a crash
    except OSError:
        pass  # some file systems cannot fsync a directory; the new file is in place either way


def discard(f: Optional[h5py.File], tmp: Optional[str]) -> None:
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


def prune(path: str, keep: int) -> None:
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


def remove_abandoned(path: str) -> None:
    """Rank 0, after publishing ``path``: delete the temporary files next to it of its step or older.

    Saves are collective and one at a time, so their writer is gone: a rank lost in the middle of a write (its
    process, or the node under it) leaves one behind, which :func:`find_latest` never reads but which holds a
    checkpoint's size of disk.
    """
    directory, published = os.path.split(os.path.abspath(path))
    named = _NAME.fullmatch(published)
    if named is None:  # not a checkpoint_path name: its step is unknown
        return
    step = int(named.group(1))
    for name in os.listdir(directory):
        match = _TEMPORARY.fullmatch(name)
        if match and int(match.group(1)) <= step:
            try:
                os.remove(os.path.join(directory, name))
            except OSError as err:
                warnings.warn(f"could not delete an abandoned temporary checkpoint {name}: {err}", stacklevel=3)
