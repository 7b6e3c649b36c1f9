"""The wire format of every asynchronous algorithm: a 32-byte header, then 0, 1 or 2 copies of the parameters.

The tag carries the number of copies, so a receive gets exactly the bytes the ledger books.
Header fields: docs/internals-asyncrt.md.
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
    """What the server answers to one message (``copies``: at most the policy's ``reply_copies``, copied at send)."""

    kind: int
    version: int
    copies: Sequence[np.ndarray] = ()
    ranks: Tuple[int, int] = (-1, -1)


class Message:
    """A reusable message buffer: :attr:`buffer` goes to MPI; :attr:`header` and :attr:`copies` are views into it.

    ``capacity`` copies fit (0 to :data:`MAX_COPIES`); :attr:`carried` counts those in the message now in it.
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
