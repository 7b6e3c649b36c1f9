"""The alpha-beta cost of one collective: its latency terms and wire bytes over ``P`` ranks on a medium.

The forms (MPICH's algorithms for large messages) are tabled in docs/scaling.md, "Method".
"""

from __future__ import annotations

import math

__all__ = ["MEDIA", "COLLECTIVES", "BCAST_MIN_PROCS", "latency_terms", "wire_bytes", "collective_seconds"]

MEDIA = ("switched", "shared")
#: ``allreduce-gloo``: torch.distributed's Allreduce on gloo (DDP's exchange), costed as MPICH's and fitted apart.
COLLECTIVES = ("allreduce", "iallreduce", "allreduce-gloo", "allgather", "allgatherv", "bcast", "twophase")
ALLREDUCES = ("allreduce", "iallreduce", "allreduce-gloo")
#: MPICH's MPIR_CVAR_BCAST_MIN_PROCS: fewer ranks broadcast along a binomial tree, more scatter and allgather.
BCAST_MIN_PROCS = 8


def _log2(P: int) -> int:
    return max(0, math.ceil(math.log2(P)))


def latency_terms(op: str, P: int) -> int:
    """Message hops on the critical path of ``op`` over ``P`` ranks (the ``alpha`` multiplier)."""
    if P < 2:
        return 0
    if op in ALLREDUCES:
        return 2 * _log2(P)
    if op in ("allgather", "allgatherv"):
        return P - 1
    if op == "bcast":
        return _log2(P) + P - 1 if P >= BCAST_MIN_PROCS else _log2(P)
    if op == "twophase":
        return 2 * (P - 1)
    raise ValueError(f"op must be one of {', '.join(COLLECTIVES)}, got {op!r}")


def wire_bytes(op: str, P: int, n: float, medium: str = "switched") -> float:
    """The ``beta`` multiplier: bytes one rank sends on the critical path (switched) or all ranks together (shared).

    ``n`` is the op's message: the vector's bytes (allreduce, bcast), one
    rank's contribution (allgather) or the chunk width ``w`` (twophase).
    """
    if medium not in MEDIA:
        raise ValueError(f"medium must be one of {', '.join(MEDIA)}, got {medium!r}")
    if P < 2:
        return 0.0
    shared = medium == "shared"
    if op in ALLREDUCES:
        return 2 * (P - 1) * n if shared else 2 * (P - 1) / P * n
    if op in ("allgather", "allgatherv"):
        return P * (P - 1) * n if shared else (P - 1) * n
    if op == "bcast" and P < BCAST_MIN_PROCS:  # binomial tree: every non-root receives n once
        return (P - 1) * n if shared else _log2(P) * n
    if op == "bcast":  # binomial scatter (n/2 per level) + ring allgather
        return (_log2(P) / 2 + P - 1) * n if shared else 2 * (P - 1) / P * n
    if op == "twophase":
        return 2 * P * (P - 1) * n if shared else 2 * (P - 1) * n
    raise ValueError(f"op must be one of {', '.join(COLLECTIVES)}, got {op!r}")


def collective_seconds(op: str, P: int, n: float, alpha: float, beta: float, medium: str = "switched") -> float:
    """``latency_terms * alpha + wire_bytes * beta``."""
    return latency_terms(op, P) * alpha + wire_bytes(op, P, n, medium) * beta
