"""How many threads the C kernels may use: one setting for all of them.

The fused loops of :mod:`mpiopt.kernels` (the SGD update, the non-finite
check, Signum's momentum and packing, Top-k's scan, ...) are memory-bound,
and one thread does not reach a socket's memory bandwidth.  They split long
vectors across this many threads (at least 2**18 elements per thread for
streamed passes, 2**15 indices for the random-access loops at sparse
indices); the result is the same bits whatever the count.

The default is 1, right for one MPI rank per core.  ``MPIOPT_NUM_THREADS``
in the environment sets another at import; :func:`set_num_threads` at run
time.  ``mpiopt train`` gives the kernels ``--threads`` when given, else
``MPIOPT_NUM_THREADS`` when set, else torch's count (the cores of a node
divided by its ranks).
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
    """Threads the C kernels use (see the module docstring)."""
    return _threads


def set_num_threads(threads: int, *, clamp: bool = False) -> None:
    """Let the C kernels use ``threads`` threads.

    Parameters
    ----------
    threads : int
        1 to :data:`MAX_THREADS`.
    clamp : bool
        Take :data:`MAX_THREADS` for a larger count instead of refusing it
        (for a count that comes from the machine, such as torch's).

    Raises
    ------
    ValueError
        ``threads`` is not an integer in that range.
    """
    global _threads
    if clamp and isinstance(threads, int) and not isinstance(threads, bool):
        threads = min(threads, MAX_THREADS)
    _threads = _check(threads, "threads")
