"""One nonblocking collective in flight, and who pokes it: shared by ``dasgd`` and ``streaming_diloco``.

Their three execution knobs (:data:`PROGRESS`: who pokes, how often, how many ``Test`` calls) change who drives MPI,
never what is computed; :func:`check_progress` refuses a helper thread where MPI or the buffers cannot have one.
Notes: docs/algorithm-notes.md.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from ..comm import Request, Topology, is_gpu_array
from .schema import Hyperparameter, Schema, choice, positive

__all__ = ["PROGRESS_MODES", "PROGRESS", "check_progress", "progress_rounds", "poke", "ProgressThread", "InFlight", "PendingBuffer"]

PROGRESS_MODES = ("test", "thread", "none")

#: The progress knobs (execution knobs: they never change a result, nor refuse a resume).
PROGRESS = Schema(
    Hyperparameter("progress", "test", choice(*PROGRESS_MODES), "how the averaging in flight is made to progress", execution=True),
    Hyperparameter("progress_interval", 0.002, positive(), "progress='thread': seconds between the thread's tests", execution=True),
    Hyperparameter("tests_per_poke", 8, positive(integer=True), "progress='test': MPI_Test calls per step", execution=True),
)


def progress_rounds(progress: str, steps: int) -> Optional[int]:
    """Rounds of a nonblocking collective's schedule done before its ``Wait``, ``steps`` steps after its start.

    For the cost model (docs/internals-comm.md, "Communication plans"): the start posts the first round and
    each step's poke (``progress="test"``) the next, so ``steps`` rounds; ``"none"`` only the first; a
    ``"thread"`` pokes throughout (None).
    """
    if progress == "thread":
        return None
    return min(steps, 1) if progress == "none" else steps


def check_progress(algorithm_name: str, progress: str, topology: Topology, params: Any) -> None:
    """Refuse ``progress="thread"`` where MPI or the buffers cannot be used from a helper thread.

    Raises
    ------
    ValueError
        Without ``MPI_THREAD_MULTIPLE``, or for GPU buffers that a
        non-GPU-aware MPI stages through host memory (the copy back would
        run in the helper thread, outside the training stream).
    """
    if progress != "thread":
        return
    if not topology.world.thread_multiple:
        raise ValueError(
            f"{algorithm_name}: progress='thread' calls MPI from a helper thread, which needs MPI_THREAD_MULTIPLE; this MPI "
            "was initialised with less (mpi4py.rc.thread_level): use progress='test'"
        )
    if is_gpu_array(params) and not topology.gpu_aware:
        raise ValueError(
            f"{algorithm_name}: progress='thread' needs host buffers or a GPU-aware MPI: staged GPU buffers would be copied "
            "back in the helper thread, outside the training stream; use progress='test'"
        )


def poke(request: Request, tests: int) -> bool:
    """Up to ``tests`` back-to-back ``Test`` calls; True once the request has completed."""
    for _ in range(tests):
        if request.Test():
            return True
    return False


class ProgressThread:
    """Pokes a request every ``interval`` seconds in a helper thread until it completes or :meth:`stop`.

    Only this thread touches the request until :meth:`stop` has joined it, so
    MPI never sees the request in two threads at once.
    """

    def __init__(self, request: Request, interval: float, tests: int, name: str = "mpiopt-progress") -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(request, interval, tests), name=name, daemon=True)
        self._thread.start()

    def _run(self, request: Request, interval: float, tests: int) -> None:
        while not self._stop.wait(interval):
            if poke(request, tests):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class InFlight:
    """At most one request in flight, with its optional progress thread."""

    def __init__(self) -> None:
        self.request: Optional[Request] = None
        self.thread: Optional[ProgressThread] = None

    @property
    def active(self) -> bool:
        """Whether a request has been started and not yet completed."""
        return self.request is not None and not self.request.done

    def start(self, request: Request, *, thread_interval: Optional[float] = None, tests: int = 1, name: str = "mpiopt-progress") -> None:
        """Hold ``request``; with ``thread_interval``, a helper thread pokes it that often."""
        self.request = request
        if thread_interval is not None:
            self.thread = ProgressThread(request, thread_interval, tests, name)

    def complete(self) -> None:
        """Wait for the request, if any (stopping its thread first)."""
        if self.thread is not None:
            self.thread.stop()
            self.thread = None
        if self.request is not None:
            self.request.Wait()
            self.request = None

    def poke(self, tests: int) -> bool:
        """``tests`` ``Test`` calls unless a thread pokes; True when nothing is left in flight."""
        if self.thread is not None:
            return not self.active
        if self.request is not None and poke(self.request, tests):
            self.request = None
        return self.request is None


class PendingBuffer:
    """A state attribute for a scratch buffer: the buffer while ``pending(alg)`` (a merge is due), else None.

    So checkpoints carry a snapshot or a received sum only when they matter;
    loading one copies it into the preallocated buffer.
    """

    def __init__(self, buffer: str, pending: Callable[[Any], Any]) -> None:
        self.buffer = buffer
        self.pending = pending

    def __get__(self, alg: Any, owner: Any = None) -> Any:
        if alg is None:
            return self
        return getattr(alg, self.buffer) if self.pending(alg) else None

    def __set__(self, alg: Any, value: Optional[Any]) -> None:
        buffer = getattr(alg, self.buffer)
        if value is not None and buffer is not None:  # no buffer: the merge rule never reads it
            buffer[...] = value
