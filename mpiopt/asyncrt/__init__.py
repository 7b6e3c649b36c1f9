"""The asynchronous runtime: a parameter server on MPI whose policy is the algorithm's, and its workers.

Every asynchronous algorithm of mpiopt runs on this one runtime: world rank
0 serves, ranks 1..P-1 work and never wait for each other.  The runtime
moves messages, checks that none is lost or handled twice, polls without
spinning, and ends the run so that no rank hangs and no receive is left
posted; what the server *does* with a message is the algorithm's
:class:`Policy`:

==================  ==========================================================
algorithm           policy
==================  ==========================================================
``async_msgd``      :class:`ApplyPolicy` (through :func:`run_async`): apply
                    each gradient at once, answer with the new parameters
``async_lsgd``      :class:`~mpiopt.algorithms.async_lsgd_server.LeaderBook`:
                    count the steps workers report, elect leaders, keep
                    their uploads, answer with the leaders' copies to pull
                    towards
==================  ==========================================================

Adding a third
--------------
An algorithm that is an update rule on the server needs only that rule::

    def apply(params, payload, arrival):        # once per payload, in arrival order
        params -= lr * payload                  # arrival: worker, step, version, staleness, loss

    result = asyncrt.run_async(world, params, apply, worker_fn, steps)

One whose server decides more (whom to answer, with what, when) adds a
policy and a worker loop; the runtime does the rest.  Schematically, an
elastic-averaging server (EASGD's asynchronous form)::

    class Centre(asyncrt.Policy):               # runs on the server only
        def __init__(self, centre, alpha):
            self.centre, self.alpha, self.version = centre, alpha, 0
        def receive(self, worker, message):     # message.kind/.version/.loss/.payload
            self.centre += self.alpha * (message.payload - self.centre)
            self.version += 1
            return asyncrt.Reply(asyncrt.PARAMS, self.version, copies=(self.centre,))
        def stop(self):                         # once every worker has sent LAST
            return asyncrt.Reply(asyncrt.STOP, self.version, copies=(self.centre,))
        def record(self):                       # broadcast to every rank at the end
            return self.version

    def work(link, x):                          # a worker's whole run, on its parameters x
        for k in range(rounds):
            local_steps(x)
            link.payload()[...] = x
            last = asyncrt.LAST if k == rounds - 1 else 0
            link.send(asyncrt.UPLOAD | last, k, copies=1, reply_copies=1)
            x -= alpha * (x - link.wait().payload)   # the reply to LAST is the STOP

    outcome = asyncrt.run_policy(world, Centre(centre, alpha), lambda link: work(link, x), x)
    outcome.record                              # the server's record, on every rank

New message flags go in :mod:`~mpiopt.asyncrt.messages`, beside everyone's.

Design of the runtime
---------------------
messages
    One buffer each: a 32-byte header (kind flags, version, per-worker
    sequence number, loss; replies: kind, version, two ranks) and 0, 1 or 2
    copies of the parameters, the count in the tag
    (:mod:`~mpiopt.asyncrt.messages`).  A receiver that knows the size posts
    its receive early; one that does not probes and receives exactly what
    the tag announces: every receive gets exactly the bytes the ledger books
    for it.  Everything goes through :class:`~mpiopt.comm.Comm` on the world
    communicator.
worker (:class:`Link`)
    Sends numbered messages (``Isend``, :class:`MPILink`), at most one
    awaiting its reply; it takes the reply when it wants (:meth:`Link.poll`,
    never blocking, or :meth:`Link.wait`).  It waits only for the server's
    answer to its own message, never for another worker; a slow worker
    slows nobody else.
server
    One slot per worker, polled round robin (:class:`Poller`; ``Comm`` has
    no ``Waitany``): a probe for the worker's next message, then its
    ``Irecv`` (a large payload may need the sender's progress; the others
    are served meanwhile).  Each message goes to ``policy.receive``, which
    returns the reply to send at once (a copy of the server's parameters, of
    a worker's upload, or none).  With ``policy.keeps_payloads`` each
    worker's payloads land in two alternating buffers, so a copy the policy
    keeps is never read half-received.
shutdown
    A worker's final message is flagged LAST (``policy.stopping``, e.g.
    Async-MSGD's ``until``, makes every worker's next message its last; the
    payloads in flight are still handled).  When every worker's last message
    has been handled, the server answers each one ``policy.stop()`` (STOP)
    and broadcasts ``policy.record()``.  So every answered message gets
    exactly one reply, every message is handled exactly once (sequence
    numbers), every rank ends with the same record, and no receive is left
    posted.  A worker that finished early waits for its STOP by polling, not
    in a spinning collective.
between runs
    A run returns quiescent (the STOP handshake): the natural checkpoint
    point.  An algorithm's server state (Async-MSGD's version, histogram
    and counts; async LSGD's book) outlives the run, so a second run
    continues it, and ``state_dict`` carries it under ``"server"``
    (:mod:`~mpiopt.asyncrt.state`).
arguments
    Checked on every rank and agreed in one small collective before the
    first message (:func:`~mpiopt.asyncrt.result.agree_on_arguments`): a bad
    ``steps`` on one rank raises the same error, naming it, on every rank.
failure
    An exception on any rank during the run (a non-finite gradient on the
    server, say) would leave the others polling for a message that never
    comes, as in any MPI program: mpiopt's abort hooks (installed with every
    :class:`~mpiopt.comm.Topology` unless turned off) end the job instead.
idle ranks
    A waiting rank polls ``Request.Test`` (which drives MPI progress) and,
    after 0.1 ms without news, sleeps between polls with a doubling pause up
    to ``max_sleep`` (default 1 ms): ranks are often oversubscribed on one
    machine, and MPICH's blocking waits spin on a core that a worker needs.
    The time spent so is in the result (``idle_seconds``; the ledger's wait
    time covers only blocking ``Wait`` calls).
one rank
    The rank is its own server (:class:`LocalLink`): each message goes to
    the policy in process, the same code without MPI (for Async-MSGD: the
    rank computes and applies in turn, staleness 0).

Why a server: the update rule of Async-MSGD (ALGORITHMS.md) is defined on one
sequence of iterates ``x_k``, each update made with a gradient computed at
some earlier ``x_{k - tau_k}``; a single owner of ``x`` gives exactly that
sequence, measurable staleness, and needs only point-to-point messages that
every MPI implements well (one-sided MPI would need passive-target locks and
atomics over the whole buffer to get the same sequence); asynchronous LSGD
needs one place that counts every worker's steps and knows every leader.  The
price: the server computes no gradients, and its link carries the copies, so
it is the bottleneck at large P (a sharded server would spread it; not needed
at the scales tested here).

The deterministic one-process twin with a chosen delay is
:func:`mpiopt.asyncrt.simulated.simulate`.
"""

from .apply import ApplyPolicy, run_async
from .messages import GRADIENT, LAST, PARAMS, SERVER, STOP, UPLOAD, Message, Reply
from .result import ApplyFn, Arrival, AsyncResult, UntilFn, WorkerFn, agree_on_arguments, check_run_arguments
from .runtime import DEFAULT_MAX_SLEEP, Link, LocalLink, MPILink, Outcome, Policy, Poller, run_policy

__all__ = [
    "run_async",
    "run_policy",
    "Policy",
    "ApplyPolicy",
    "Link",
    "MPILink",
    "LocalLink",
    "Outcome",
    "Reply",
    "Message",
    "Arrival",
    "AsyncResult",
    "ApplyFn",
    "WorkerFn",
    "UntilFn",
    "Poller",
    "SERVER",
    "GRADIENT",
    "LAST",
    "PARAMS",
    "STOP",
    "UPLOAD",
    "DEFAULT_MAX_SLEEP",
    "agree_on_arguments",
    "check_run_arguments",
]
