"""How many threads the C kernels may use: one setting for all, 1 by default (one rank per core); same bits at any count.

``MPIOPT_NUM_THREADS`` sets it at import; why and how ``mpiopt train`` chooses: docs/internals-kernels.md.
"""

from __future__ import annotations

import os

__all__ = ["get_num_threads", "set_num_threads", "MAX_THREADS", "THREADS_ENV"]

#: The most threads a kernel uses (the C loops' limit).
MAX_THREADS = 64
#: The environment variable that sets the kernels' count at import.
THREADS_ENV = "MPIOPT_NUM_THREADS"


def _check(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_THREADS}], got {value!r}")
    return value


def _from_environment() -> int:
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return 1
    try:
        value = int(text)
    except ValueError:
        value = None
    return _check(value if value is not None else text, THREADS_ENV)


_threads = _from_environment()


def get_num_threads() -> int:
    """Threads the C kernels use."""
    return _threads


def set_num_threads(threads: int, *, clamp: bool = False) -> None:
    """Let the C kernels use ``threads`` (1 to :data:`MAX_THREADS`; ``clamp`` takes the maximum for a machine's larger count)."""
    global _threads
    if clamp and isinstance(threads, int) and not isinstance(threads, bool):
        threads = min(threads, MAX_THREADS)
    _threads = _check(threads, "threads")
