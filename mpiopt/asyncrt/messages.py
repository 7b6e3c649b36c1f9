"""The wire format: one buffer per message, a 32-byte header then the payload.

Header and payload travel in one message (one latency, not two) and every
message of a run has the same size, so a posted receive always gets exactly
the bytes the ledger records for it.

============  =======  ========================================================
field         type     meaning
============  =======  ========================================================
``kind``      int64    bit flags below
``version``   int64    worker -> server: the version the payload was computed
                       at; server -> worker: the version of the parameters sent
``sequence``  int64    worker -> server: 1, 2, ... per worker (checked by the
                       server: nothing lost, nothing applied twice)
``loss``      float64  the worker function's return value (NaN for None)
============  =======  ========================================================
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

__all__ = ["Message", "HEADER", "TAG_UPDATE", "TAG_REPLY", "GRADIENT", "LAST", "PARAMS", "STOP", "SERVER"]

#: World rank of the parameter server.
SERVER = 0
#: Tags: worker -> server and server -> worker (the world communicator is a
#: Dup of the user's, so these never meet an application's messages).
TAG_UPDATE = 0x5A1
TAG_REPLY = 0x5A2

# Kinds (bit flags).  Worker -> server: GRADIENT (payload to apply) and/or
# LAST (the worker's final message).  Server -> worker: PARAMS (go on with
# these parameters) or STOP (the run is over; the payload is the final parameters).
GRADIENT = 1
LAST = 2
PARAMS = 4
STOP = 8

HEADER = np.dtype([("kind", "<i8"), ("version", "<i8"), ("sequence", "<i8"), ("loss", "<f8")])


class Message:
    """A reusable message buffer: :attr:`buffer` goes to MPI, :attr:`payload` is a view into it.

    Parameters
    ----------
    num_params : int
        Payload elements.
    dtype : numpy.dtype
        Payload element type (the parameters').
    header : numpy.dtype
        Layout of the header (default :data:`HEADER`, which :meth:`stamp` and
        the properties below read and write).  Another protocol may pass its
        own structured dtype (a multiple of 8 bytes keeps the payload aligned)
        and use :attr:`header`, the one-record view, directly.
    """

    def __init__(self, num_params: int, dtype: np.dtype, header: np.dtype = HEADER) -> None:
        self.buffer = np.zeros(header.itemsize + num_params * np.dtype(dtype).itemsize, dtype=np.uint8)
        self.header = self.buffer[: header.itemsize].view(header)
        self.payload = self.buffer[header.itemsize:].view(dtype)

    def stamp(self, kind: int, version: int, sequence: int = 0, loss: Optional[float] = None) -> None:
        """Write the header."""
        self.header[0] = (kind, version, sequence, math.nan if loss is None else float(loss))

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
