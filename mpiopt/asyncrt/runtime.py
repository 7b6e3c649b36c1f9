"""The server runtime's code: :class:`Policy` (the extension point), :class:`Link` (a worker's end), the server loop.

Design: docs/async.md; the policy's contract: docs/internals-asyncrt.md.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from ..comm import ANY_TAG, Comm, PeerLost, Request
from ..comm.survival import INJECTION
from ..comm.waiting import Backoff
from .messages import DOWN, LAST, SERVER, TAG_DOWN, TAG_UP, UP, Message, Reply

__all__ = ["Poller", "Policy", "Link", "MPILink", "LocalLink", "Outcome", "run_policy", "DEFAULT_MAX_SLEEP", "Survivors",
           "ServerLost"]

#: Longest pause between two polls of an idle rank (seconds).
DEFAULT_MAX_SLEEP = 1e-3
# Worker messages carry at most one copy (a gradient, or the worker's parameters).
_MAX_UP_COPIES = 1


class Poller:
    """Wait for one of several requests by polling ``Request.Test`` (``Comm`` has no Waitany).

    Polling drives MPI progress; after 0.1 ms without news it sleeps with a doubling pause up to ``max_sleep`` (0: never), so
    an oversubscribed idle rank leaves the core to a busy one; ``idle_seconds`` sums it.  Round robin.
    """

    def __init__(self, max_sleep: float = DEFAULT_MAX_SLEEP) -> None:
        if not max_sleep >= 0:
            raise ValueError(f"max_sleep must be >= 0 seconds, got {max_sleep!r}")
        self.max_sleep = float(max_sleep)
        self.idle_seconds = 0.0
        self._next = 0

    def wait_any(self, requests: Sequence[Optional[Any]]) -> int:
        """Index of a completed request (anything with ``Test()``; None entries skipped); blocks until one completes."""
        if all(r is None for r in requests):
            raise ValueError("wait_any needs at least one request")
        started = time.perf_counter()
        backoff = Backoff(self.max_sleep)
        n = len(requests)
        while True:
            for i in range(n):
                j = (self._next + i) % n
                request = requests[j]
                if request is not None and request.Test():
                    self._next = (j + 1) % n
                    self.idle_seconds += time.perf_counter() - started
                    return j
            backoff.pause()

    def wait_all(self, requests: Sequence[Optional[Any]]) -> None:
        """Block until every request (None entries skipped) has completed."""
        pending: List[Optional[Any]] = list(requests)
        while any(r is not None for r in pending):
            pending[self.wait_any(pending)] = None


class Policy:
    """What the server does with each worker message: the one extension point of the runtime.

    Override :meth:`receive`, :meth:`stop` and :meth:`record`; the attributes are explained in
    docs/internals-asyncrt.md, "The policy's contract".
    """

    reply_copies: int = 1
    keeps_payloads: bool = False
    stopping: bool = False

    def receive(self, worker: int, message: Message) -> Optional[Reply]:
        """Handle ``message`` from world rank ``worker``; return the reply to send at once, or None."""
        raise NotImplementedError

    def stop(self) -> Reply:
        """The STOP that every worker gets once all runs have ended (at most :attr:`reply_copies` copies)."""
        raise NotImplementedError

    def record(self) -> Any:
        """The run's outcome as plain data (picklable): sent from the server to every rank at the end."""
        raise NotImplementedError

    def drop(self, worker: int) -> None:
        """World rank ``worker`` is lost (survival on): it sends nothing more; the run goes on with the others."""


class ServerLost(RuntimeError):
    """The server of an asynchronous run is lost: the only copy of its state went with it (docs/failures.md)."""


#: ``survivors()``, on every rank at the end of a run with survival on: None where no rank was lost, else the world
#: shrunk to the survivors (:class:`ServerLost` where the server was one of the lost).
Survivors = Callable[[], Optional[Comm]]


class _Dispatch:
    """The server's handling of one message, without transport: sequence check, policy, end of a worker's run."""

    def __init__(self, policy: Policy, size: int) -> None:
        self.policy = policy
        self.received = [0] * size
        self.cut_short = False  # some worker's run was ended by ``stopping``, not by its LAST

    def handle(self, worker: int, message: Message) -> Tuple[Optional[Reply], bool]:
        """``(reply to send now or None, whether the worker's run has ended)``."""
        self.received[worker] += 1
        INJECTION.served()  # the tests' kill point of a server
        if message.sequence != self.received[worker]:
            raise RuntimeError(
                f"asynchronous server: message {message.sequence} from rank {worker}, expected {self.received[worker]}"
            )
        reply = self.policy.receive(worker, message)
        last = bool(message.kind & LAST)
        if last or self.policy.stopping:
            self.cut_short = self.cut_short or not last
            return None, True
        return reply, False


class _Probe:
    """``Comm.Iprobe`` as a request for :class:`Poller`: ``Test()`` is True once a message from ``source`` waits."""

    def __init__(self, comm: Comm, source: int) -> None:
        self._comm, self._source = comm, source
        self.status: Any = None  # the MPI status of the message found

    def Test(self) -> bool:
        self.status = self._comm.Iprobe(self._source, ANY_TAG)
        return self.status is not None

    def copies(self, base: int, most: int) -> int:
        """The number of copies the found message carries, from its tag."""
        tag = self.status.Get_tag()
        if not 0 <= tag - base <= most:
            raise RuntimeError(f"asynchronous runtime: unexpected message with tag {tag:#x} from rank {self._source}")
        return tag - base


class Link:
    """A worker's end of the runtime: numbered messages to the server, at most one of them awaiting its reply."""

    reply: Message

    def __init__(self) -> None:
        self._sequence = 0

    @property
    def awaiting(self) -> bool:
        """A message sent is still waiting for its reply."""
        raise NotImplementedError

    def payload(self) -> np.ndarray:
        """The buffer of the next message's copy: write it, then :meth:`send` with ``copies=1``."""
        raise NotImplementedError

    def send(
        self,
        kind: int,
        version: int,
        loss: Optional[float] = None,
        *,
        copies: int = 0,
        answered: bool = True,
        reply_copies: Optional[int] = None,
    ) -> None:
        """Send a message without waiting for the server.

        ``answered=False``: the server only books it (an upload).  ``reply_copies`` known: the reply's receive is
        posted before the send; None: it is probed for.
        """
        if answered and self.awaiting:
            raise RuntimeError("asynchronous runtime: a message awaits its reply; take it (poll or wait) before sending another")
        message = self._next_message(copies)
        self._sequence += 1
        message.stamp_up(kind, version, self._sequence, loss)
        self._deliver(message, copies, answered, reply_copies)

    def poll(self) -> Optional[Message]:
        """The reply, if it has arrived; None otherwise (or when none is awaited)."""
        raise NotImplementedError

    def wait(self) -> Optional[Message]:
        """The reply, waiting for it (polling, see :class:`Poller`); None when none is awaited."""
        raise NotImplementedError

    def _next_message(self, copies: int) -> Message:
        raise NotImplementedError

    def _deliver(self, message: Message, copies: int, answered: bool, reply_copies: Optional[int]) -> None:
        raise NotImplementedError


class MPILink(Link):
    """A worker's end over MPI: ``Isend`` to the server; the reply posted for, or probed for and received."""

    def __init__(self, world: Comm, like: np.ndarray, reply_copies: int, poller: Poller) -> None:
        super().__init__()
        self._world, self._poller = world, poller
        # One buffer per size (a report may be in flight while an upload goes out), each with its send.
        self._outgoing = [Message(like.size, like.dtype, UP, copies) for copies in range(_MAX_UP_COPIES + 1)]
        self._sends: List[Optional[Request]] = [None] * len(self._outgoing)
        self.reply = Message(like.size, like.dtype, DOWN, reply_copies)
        self._awaited: Union[None, Request, _Probe] = None  # the reply's posted receive, or a probe for it
        self._answered = 0  # which buffer's send the awaited reply answers
        self._probe = _Probe(world, SERVER)

    @property
    def awaiting(self) -> bool:
        return self._awaited is not None

    def payload(self) -> np.ndarray:
        self._complete(1)
        return self._outgoing[1].payload

    def poll(self) -> Optional[Message]:
        if self._awaited is None or not self._awaited.Test():
            return None
        return self._take()

    def wait(self) -> Optional[Message]:
        if self._awaited is None:
            return None
        self._poller.wait_any([self._awaited])
        return self._take()

    def _next_message(self, copies: int) -> Message:
        self._complete(copies)
        return self._outgoing[copies]

    def _deliver(self, message: Message, copies: int, answered: bool, reply_copies: Optional[int]) -> None:
        if answered:
            self._answered = copies
            if reply_copies is None:
                self._awaited = self._probe
            else:
                self.reply.carried = reply_copies
                self._awaited = self._world.Irecv(self.reply.wire(reply_copies), SERVER, TAG_DOWN + reply_copies)
        self._sends[copies] = self._world.Isend(message.wire(copies), SERVER, TAG_UP + copies)

    def _take(self) -> Message:
        if self._awaited is self._probe:
            copies = self._probe.copies(TAG_DOWN, len(self.reply.copies))
            self._world.Recv(self.reply.wire(copies), SERVER, TAG_DOWN + copies)
            self.reply.carried = copies
        self._awaited = None
        self._complete(self._answered)  # at once: the server has received it
        return self.reply

    def _complete(self, copies: int) -> None:
        """Wait for the previous send from the buffer of that size, so it can be written again."""
        if self._sends[copies] is not None:
            self._sends[copies].Wait()
            self._sends[copies] = None


class LocalLink(Link):
    """The one rank's end at world size 1: it is its own server, the policy runs in process, no MPI."""

    def __init__(self, policy: Policy, like: np.ndarray) -> None:
        super().__init__()
        self._policy = policy
        self._dispatch = _Dispatch(policy, 1)
        self._header = Message(like.size, like.dtype, UP, 0)
        self._payloads = [Message(like.size, like.dtype, UP, 1) for _ in range(2 if policy.keeps_payloads else 1)]
        self.reply = Message(like.size, like.dtype, DOWN, policy.reply_copies)
        self._pending = False

    @property
    def awaiting(self) -> bool:
        return self._pending

    @property
    def stopped_early(self) -> bool:
        """The run was ended by the policy's ``stopping``, not by the worker's LAST."""
        return self._dispatch.cut_short

    def payload(self) -> np.ndarray:
        return self._payloads[-1].payload  # the spare, when the policy keeps the other

    def poll(self) -> Optional[Message]:
        if not self._pending:
            return None
        self._pending = False
        return self.reply

    wait = poll

    def _next_message(self, copies: int) -> Message:
        if not copies:
            return self._header
        self._payloads.reverse()  # the spare becomes the message; the policy's previous one, the next spare
        return self._payloads[0]

    def _deliver(self, message: Message, copies: int, answered: bool, reply_copies: Optional[int]) -> None:
        reply, ended = self._dispatch.handle(0, message)
        if ended:
            reply = self._policy.stop()
        if answered:
            if reply is None:
                raise RuntimeError(f"asynchronous runtime: the policy did not answer message {self._sequence}")
            self.reply.write_reply(reply)
            self._pending = True


def _serve(world: Comm, policy: Policy, like: np.ndarray, poller: Poller) -> bool:
    """The server loop: deliver each message to the policy, send its reply; at the end, STOP to every worker.

    Each worker's slot is polled round robin: a probe, then an ``Irecv`` of the size the tag announces (a large
    payload may need the sender's progress).  With survival on, a worker found lost is dropped (``policy.drop``) and
    the others go on.  Returns whether ``policy.stopping`` ended some worker's run.
    """
    n, dtype = like.size, like.dtype
    workers = list(range(1, world.size))
    dispatch = _Dispatch(policy, world.size)
    headers = {w: Message(n, dtype, UP, 0) for w in workers}
    # payloads[w][0] is the latest payload from w (the policy's, when it keeps them), [-1] the spare receiving.
    payloads = {w: [Message(n, dtype, UP, 1) for _ in range(2 if policy.keeps_payloads else 1)] for w in workers}
    outbox = {w: Message(n, dtype, DOWN, policy.reply_copies) for w in workers}
    sends: Dict[int, Optional[Request]] = dict.fromkeys(workers)
    probes = [_Probe(world, w) for w in workers]
    slots: List[Any] = list(probes)  # None once the worker's run has ended
    arriving: List[Optional[Message]] = [None] * len(workers)
    lost: List[int] = []

    def serve(i: int) -> None:
        w = workers[i]
        if slots[i] is probes[i]:
            copies = probes[i].copies(TAG_UP, _MAX_UP_COPIES)
            message = payloads[w][-1] if copies else headers[w]
            message.carried = copies
            arriving[i] = message
            slots[i] = world.Irecv(message.wire(copies), w, TAG_UP + copies)
            if not slots[i].Test():
                return
        message = arriving[i]
        if message.carried:
            payloads[w].reverse()  # the spare now holds the latest
        reply, ended = dispatch.handle(w, message)
        slots[i] = None if ended else probes[i]
        if reply is not None:
            if sends[w] is not None:
                sends[w].Wait()  # complete already: the worker has sent a message after receiving it
            copies = outbox[w].write_reply(reply)
            sends[w] = world.Isend(outbox[w].wire(copies), w, TAG_DOWN + copies)

    with world.faults.tolerating():
        while any(slot is not None for slot in slots):
            try:
                serve(poller.wait_any(slots))
            except PeerLost as gone:  # only with survival on: the others go on
                lost.append(gone.rank)
                slots[gone.rank - 1] = sends[gone.rank] = None
                policy.drop(gone.rank)
        live = [w for w in workers if w not in lost]
        _stop(world, policy, like, [sends[w] for w in live], live, poller)
    return dispatch.cut_short


def _stop(world: Comm, policy: Policy, like: np.ndarray, replies: List[Optional[Request]], live: List[int],
          poller: Poller) -> None:
    """Every worker's run has ended: STOP to each live one once its replies are out.  One STOP buffer for all
    (concurrent sends of one buffer are allowed since MPI-3); a worker found lost now is skipped (the survivors'
    agreement at the end finds it)."""
    stop = policy.stop()
    final = Message(like.size, like.dtype, DOWN, len(stop.copies))
    copies = final.write_reply(stop)
    pending = list(replies)
    for w in live:
        try:
            pending.append(world.Isend(final.wire(copies), w, TAG_DOWN + copies))
        except PeerLost:
            pass
    while True:
        try:
            poller.wait_all(pending)
            return
        except PeerLost as gone:
            pending = [r for r in pending if r is not None and not r.done and r.peer != gone.rank]


class Outcome(NamedTuple):
    """What :func:`run_policy` returns on every rank: the server's record, ``stopped_early``, idle time, ``work``'s result."""

    record: Any
    stopped_early: bool
    idle_seconds: float
    local: Any


def run_policy(
    world: Comm,
    policy: Policy,
    work: Callable[[Link], Any],
    like: np.ndarray,
    *,
    max_sleep: float = DEFAULT_MAX_SLEEP,
    survivors: Optional[Survivors] = None,
) -> Outcome:
    """Run an asynchronous algorithm (collective): rank 0 serves with ``policy``, every other rank runs ``work(link)``.

    No argument checks (callers agree first).  At world size 1 the rank runs ``work`` with a :class:`LocalLink`.
    With survival on (the world's ``faults.survives``), the server drops a lost worker and serves the others to the
    end, and ``survivors()`` (required then) moves every rank to the shrunk world before the record is shared.
    Contract: docs/internals-asyncrt.md.
    """
    if world.faults.survives and survivors is None:  # the setting is agreed: every rank raises
        raise ValueError("run_policy on a world that survives lost ranks needs survivors()")
    poller = Poller(max_sleep)
    if world.size == 1:
        link = LocalLink(policy, like)
        local = work(link)
        return Outcome(policy.record(), link.stopped_early, 0.0, local)
    if world.rank == SERVER:
        stopped = _serve(world, policy, like, poller)
        summary: Any = (policy.record(), stopped)
        local = None
    else:
        local = work(MPILink(world, like, policy.reply_copies, poller))
        summary = None
    if world.faults.survives:
        world = survivors() or world
    record, stopped = world.bcast_obj(summary, root=SERVER)
    return Outcome(record, stopped, poller.idle_seconds, local)
