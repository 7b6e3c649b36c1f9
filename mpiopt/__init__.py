"""mpiopt: communication-efficient distributed training on MPI clusters.

>>> import mpiopt
>>> topology = mpiopt.Topology()                 # world, node groups, leaders
>>> alg = mpiopt.create("sgd", topology, lr=0.1)
>>> alg.setup(params)                            # params: flat float array
>>> alg.step(params, grad, loss=loss)
"""

from ._version import __version__
from .algorithms import Algorithm, StepRecord, available, create
from .comm import Comm, Ledger, SetupMismatchError, Topology, abort_on_exception

__all__ = [
    "Algorithm",
    "StepRecord",
    "available",
    "create",
    "Comm",
    "Ledger",
    "SetupMismatchError",
    "Topology",
    "abort_on_exception",
    "__version__",
]
