"""One nonblocking collective in flight, and who pokes it: shared by ``dasgd`` and ``streaming_diloco``.

MPI progresses a nonblocking collective only inside MPI calls (without an
asynchronous progress thread of the library's own), and one call advances
it only so far: :func:`poke` makes several back-to-back ``Test`` calls; a
:class:`ProgressThread` pokes from a helper thread (needs
``MPI_THREAD_MULTIPLE``); :class:`InFlight` holds a request and its thread
and completes it (``Wait``) when the result is needed.
"""

from __future__ import annotations

import threading
from typing import Optional

from ..comm import Request

__all__ = ["poke", "ProgressThread", "InFlight"]


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
