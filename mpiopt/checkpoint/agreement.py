"""Collective verdicts: every rank reports, and all raise the same :class:`CheckpointError` or none does.

A failure on one rank (a value that cannot be stored, a full disk, a file it
cannot read) must not leave the others waiting in the next collective call,
nor let ranks go on with different checkpoints.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from ..comm import Comm

__all__ = ["CheckpointError", "agree", "on_all_ranks"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; raised on every rank with the same message."""


def agree(world: Comm, path: str, error: Optional[str], what: str, extra: Any = None) -> List[Any]:
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
