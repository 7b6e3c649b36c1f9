"""The torch front end: mpiopt's algorithms as a ``torch.optim.Optimizer``.

>>> import mpiopt.torch
>>> opt = mpiopt.torch.DistributedOptimizer(model.parameters(), "lsgd", lr=0.1)
>>> mpiopt.torch.broadcast_module(model)          # rank 0's buffers (BatchNorm statistics) everywhere
>>> for x, y in loader:
...     opt.zero_grad()
...     loss = loss_fn(model(x), y)
...     loss.backward()
...     opt.step(loss=loss)                        # LSGD elects its leaders by the loss
>>> mpiopt.torch.average_buffers(model)           # before evaluating

The parameters become views into one flat buffer, and their gradients views
into another, so the algorithms of :mod:`mpiopt.algorithms` read and write
the model without a copy.  Nothing below this package imports it.
"""

from .amp import GradScaler
from .modules import average_buffers, broadcast_module
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", "GradScaler", "broadcast_module", "average_buffers"]
