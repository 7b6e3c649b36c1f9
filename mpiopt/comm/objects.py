"""The calls of :class:`~mpiopt.comm.Comm` on small Python objects (pickled) and its ledger's totals over its ranks."""

from __future__ import annotations

import pickle
from typing import Any, Callable, List

import numpy as np
from mpi4py import MPI

from .ledger import Ledger

__all__ = ["ObjectCalls"]


class ObjectCalls:
    """Mixin of :class:`~mpiopt.comm.Comm`: its collectives of small Python objects, recorded like any call."""

    _comm: MPI.Intracomm
    ledger: Ledger
    name: str
    rank: int
    _run: Callable[..., Any]
    _others: Callable[[int], int]
    _check_rank: Callable[[int, str], None]
    faults: Any

    # -- small control data (pickled objects) ---------------------------------------------
    def allreduce_obj(self, obj: Any, op: MPI.Op = MPI.SUM) -> Any:
        """Reduce a small Python object (a number, a tuple) over all ranks."""
        n = self._others(len(pickle.dumps(obj)))
        return self._run("allreduce_obj", n, n, lambda: self._comm.allreduce(obj, op), [])

    def allgather_obj(self, obj: Any) -> List[Any]:
        """Every rank's small Python object, in rank order."""
        n = len(pickle.dumps(obj))
        result = self._run("allgather_obj", self._others(n), 0, lambda: self._comm.allgather(obj), [])
        self.ledger.record(f"{self.name}.allgather_obj", 0, sum(len(pickle.dumps(o)) for o in result) - n, calls=0)
        return result

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """The root's small Python object on every rank."""
        self._check_rank(root, "root")
        is_root = self.rank == root
        n = len(pickle.dumps(obj)) if is_root else 0
        result = self._run("bcast_obj", self._others(n), 0, lambda: self._comm.bcast(obj, root), [])
        if not is_root:
            self.ledger.record(f"{self.name}.bcast_obj", 0, len(pickle.dumps(result)), calls=0)
        return result

    # -- agreement and totals --------------------------------------------------------------
    def ledger_totals(self) -> Ledger:
        """The ledger summed over the ranks of this communicator (a collective call; not itself recorded)."""
        with self.faults.guard(self.name):
            ops = sorted(set().union(*self._comm.allgather(sorted(self.ledger.ops))))
            table = np.array([self.ledger[op].as_tuple() for op in ops], dtype=np.float64).reshape(len(ops), -1)
            self._comm.Allreduce(MPI.IN_PLACE, table, MPI.SUM)
        out = Ledger()
        for op, row in zip(ops, table):
            out.record(op, int(row[1]), int(row[2]), float(row[3]), calls=int(row[0]))
            out.ops[op].wait_seconds = float(row[4])
        return out
