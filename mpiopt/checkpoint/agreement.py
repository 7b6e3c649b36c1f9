"""Collective verdicts: all ranks raise the same :class:`CheckpointError` or none does, so no rank waits or diverges."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from ..comm import Comm, SetupMismatchError
from ..comm.communicator import Failure

__all__ = ["CheckpointError", "agree", "on_all_ranks"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; raised on every rank with the same message."""


class _Failed(Exception):
    """This rank's failure, as the caller found it (its text), for :meth:`~mpiopt.comm.Comm.decide`."""


def agree(world: Comm, path: str, error: Optional[str], what: str, extra: Any = None) -> List[Any]:
    """Decide together: the same :class:`CheckpointError` everywhere if any rank failed or paths differ; every rank's ``extra``."""

    def check() -> None:
        if error is not None:
            raise _Failed(error)

    def failed(failures: List[Failure], own: Optional[BaseException]) -> CheckpointError:
        if len(failures) == world.size and len({f.message for f in failures}) == 1:
            return CheckpointError(f"cannot {what} checkpoint {path}: {failures[0].message}")
        return CheckpointError(f"cannot {what} checkpoint {path}:\n" + "\n".join(f"  rank {f.rank}: {f.message}" for f in failures))

    try:
        world.decide(check, f"checkpoint to {what}", catch=(_Failed,), agree_on={"path": path}, error=failed)
    except SetupMismatchError:
        listing = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(world.allgather_obj(path)))
        raise CheckpointError(f"ranks disagree on the checkpoint to {what}: {listing}") from None
    return world.allgather_obj(extra)


def on_all_ranks(world: Comm, path: str, message: Optional[str], step: Callable[[], None]) -> Optional[str]:
    """Run ``step()`` on every rank unless an earlier step failed (``message``); what failed anywhere, same on every rank."""
    if message is not None:
        return message
    error = None
    try:
        step()
    except Exception as err:  # disk full, quota, ...: reported collectively
        error = f"{type(err).__name__}: {err}"
    try:
        agree(world, path, error, "save")
    except CheckpointError as err:
        return str(err)
    return None
