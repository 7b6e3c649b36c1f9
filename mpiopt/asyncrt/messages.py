"""The wire format of every asynchronous algorithm: a 32-byte header, then copies of the parameters.

A message carries 0, 1 or 2 copies of the parameters (a gradient, the
server's parameters, a worker's upload, leaders' copies), and its tag says
how many (``TAG_UP + copies`` from a worker, ``TAG_DOWN + copies`` from the
server).  A receiver that knows the size in advance posts its receive early;
one that does not probes, reads the count from the tag and receives exactly
that size.  Either way a receive gets exactly the bytes the ledger books for
it, and header and payload cost one latency, not two.

Headers (both 32 bytes):

==============  =========  ====================================================
field           type       meaning
==============  =========  ====================================================
worker -> server (:data:`UP`)
-------------------------------------------------------------------------------
``kind``        int64      bit flags below
``version``     int64      the sender's version: Async-MSGD, the server version
                           its gradient was computed at; async LSGD, the steps
                           it has done (in all its runs)
``sequence``    int64      1, 2, ... per worker and run (checked by the server:
                           nothing lost, nothing handled twice)
``loss``        float64    the worker's loss (NaN for none)
server -> worker (:data:`DOWN`)
-------------------------------------------------------------------------------
``kind``        int64      bit flags below
``version``     int64      Async-MSGD: the version of the parameters sent;
                           async LSGD: the total step count ``T``
``ranks``       2 x int64  world ranks the policy names; async LSGD: per kind
                           of pull (local, global), the rank whose copy it goes
                           towards, or that settled it as leader (-1: none)
==============  =========  ====================================================
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "Message",
    "Reply",
    "UP",
    "DOWN",
    "SERVER",
    "TAG_UP",
    "TAG_DOWN",
    "MAX_COPIES",
    "GRADIENT",
    "LAST",
    "PARAMS",
    "STOP",
    "UPLOAD",
    "PULL_LOCAL",
    "PULL_GLOBAL",
]

#: World rank of the parameter server.
SERVER = 0
#: Most parameter copies in one message.
MAX_COPIES = 2
#: Tags: worker -> server and server -> worker, plus the number of copies carried
#: (the world communicator is a Dup of the user's, so these never meet an application's messages).
TAG_UP = 0x5A10
TAG_DOWN = 0x5A20

# Kinds (bit flags), every asynchronous algorithm's in one place.
#: Worker -> server: the payload is a gradient to apply (Async-MSGD).
GRADIENT = 1
#: Worker -> server: the worker's final message; answered STOP once every worker has sent its own.
LAST = 2
#: Server -> worker: the payload is the server's parameters; go on (Async-MSGD).
PARAMS = 4
#: Server -> worker: the run is over (Async-MSGD: the payload is the final parameters).
STOP = 8
#: Server -> worker: send your parameters; worker -> server: here they are (async LSGD).
UPLOAD = 16
#: Server -> worker: the reply's copies serve a pull towards the local / global leader (async LSGD).
PULL_LOCAL = 32
PULL_GLOBAL = 64

UP = np.dtype([("kind", "<i8"), ("version", "<i8"), ("sequence", "<i8"), ("loss", "<f8")])
DOWN = np.dtype([("kind", "<i8"), ("version", "<i8"), ("ranks", "<i8", (2,))])


class Reply(NamedTuple):
    """What the server answers to one message (a policy's description; the runtime writes the message).

    Attributes
    ----------
    kind : int
        Flags (``PARAMS``, ``STOP``, ``UPLOAD``, ``PULL_LOCAL``, ``PULL_GLOBAL``).
    version : int
        The header's ``version``.
    copies : sequence of numpy.ndarray
        Parameter-sized arrays to send (at most the policy's ``reply_copies``);
        copied into the message when it is sent.
    ranks : tuple of int
        The header's ``ranks``.
    """

    kind: int
    version: int
    copies: Sequence[np.ndarray] = ()
    ranks: Tuple[int, int] = (-1, -1)


class Message:
    """A reusable message buffer: :attr:`buffer` goes to MPI, :attr:`copies` are views into it.

    Parameters
    ----------
    num_params : int
        Elements of one copy of the parameters.
    dtype : numpy.dtype
        Their type.
    header : numpy.dtype
        :data:`UP` or :data:`DOWN`.
    capacity : int
        Copies the buffer can hold (0 to :data:`MAX_COPIES`).

    Attributes
    ----------
    header : numpy.ndarray
        The one-record view of the header.
    copies : list of numpy.ndarray
        One view per copy the buffer can hold.
    carried : int
        Copies in the message now in the buffer (set by whoever fills it).
    """

    def __init__(self, num_params: int, dtype: np.dtype, header: np.dtype = UP, capacity: int = 1) -> None:
        if not 0 <= capacity <= MAX_COPIES:
            raise ValueError(f"capacity must be in [0, {MAX_COPIES}], got {capacity!r}")
        self._copy_bytes = num_params * np.dtype(dtype).itemsize
        self.buffer = np.zeros(header.itemsize + capacity * self._copy_bytes, dtype=np.uint8)
        self.header = self.buffer[: header.itemsize].view(header)
        body = self.buffer[header.itemsize:].view(dtype)
        self.copies = [body[i * num_params : (i + 1) * num_params] for i in range(capacity)]
        self.carried = 0

    def wire(self, copies: int) -> np.ndarray:
        """The bytes of a message with ``copies`` copies: what is sent, or what a receive of that size fills."""
        if not 0 <= copies <= len(self.copies):
            raise ValueError(f"a message in this buffer carries 0 to {len(self.copies)} copies, got {copies}")
        return self.buffer[: self.header.itemsize + copies * self._copy_bytes]

    @property
    def payload(self) -> np.ndarray:
        """The first copy (a gradient, or the parameters)."""
        return self.copies[0]

    @property
    def kind(self) -> int:
        return int(self.header["kind"][0])

    @property
    def version(self) -> int:
        return int(self.header["version"][0])

    @property
    def sequence(self) -> int:
        return int(self.header["sequence"][0])

    @property
    def loss(self) -> Optional[float]:
        value = float(self.header["loss"][0])
        return None if math.isnan(value) else value

    @property
    def ranks(self) -> Tuple[int, int]:
        first, second = self.header["ranks"][0]
        return int(first), int(second)

    def stamp_up(self, kind: int, version: int, sequence: int, loss: Optional[float]) -> None:
        """Write a worker's header."""
        self.header[0] = (kind, version, sequence, math.nan if loss is None else float(loss))

    def write_reply(self, reply: Reply) -> int:
        """Write ``reply`` (header and copies) into this buffer; the number of copies it carries."""
        if len(reply.copies) > len(self.copies):
            raise ValueError(f"a reply in this buffer carries at most {len(self.copies)} copies, got {len(reply.copies)}")
        self.header[0] = (reply.kind, reply.version, reply.ranks)
        for i, copy in enumerate(reply.copies):
            self.copies[i][...] = copy
        self.carried = len(reply.copies)
        return self.carried
