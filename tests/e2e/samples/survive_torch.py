"""A torch-API run that survives a lost rank: ``survive_torch.py ALGORITHM ON_FAILURE STEPS OUT``.

A float64 linear model under ``DistributedOptimizer`` with an AdamW inner optimizer; each rank's batch depends on its
first world rank and the step alone.  A RankLost is answered by ``topology.recover()`` and ``opt.recover()`` and the
step is redone; under ``respawn`` a process of this program takes the lost rank's place, its ``DistributedOptimizer``
takes a survivor's parameters and both states, and it goes on from the step the survivors redo.  Each rank saves its
parameters after every step, the step it started at, its parameters then and AdamW's moments to OUT/<first rank>.npz.
"""

import os
import sys

import numpy as np
import torch

import mpiopt
from mpiopt.comm import RankLost
from mpiopt.comm.survival import INJECTION
from mpiopt.torch import DistributedOptimizer

algorithm, on_failure, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
topo = mpiopt.Topology(on_failure=on_failure)
me = topo.first_ranks[topo.rank]
replacement = topo.joining
torch.manual_seed(0)
model = torch.nn.Linear(5, 1, dtype=torch.float64)
hyper = {"period": 3} if algorithm == "diloco" else {}
opt = DistributedOptimizer(model.parameters(), algorithm, topology=topo, inner=torch.optim.AdamW(model.parameters(), lr=0.05),
                           **hyper)
t = first_step = opt.algorithm.steps + 1  # a replacement's: the step the survivors redo
joined_with = opt.flat_params.detach().clone().numpy()
if replacement:
    print(f"rank {me}: joined at step {t}; the world is {topo.size}", flush=True)
history = []
while t <= steps:
    INJECTION.current = t
    INJECTION.reached("step", me)
    rng = np.random.default_rng([11, me, t])
    x, y = torch.from_numpy(rng.standard_normal((8, 5))), torch.from_numpy(rng.standard_normal((8, 1)))
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    try:
        opt.step()
    except RankLost:
        recovery = topo.recover()
        print(f"rank {me}: lost ranks {recovery.lost} at step {t}; the world is now {recovery.size}", flush=True)
        opt.recover()
        continue
    history.append(opt.flat_params.detach().clone().numpy())
    t += 1
moments = [opt.inner.state[p]["exp_avg_sq"].detach().clone().numpy().ravel() for p in model.parameters()]
np.savez(os.path.join(out, f"{me}.npz"), history=np.array(history), first_step=first_step, joined_with=joined_with,
         moments=np.concatenate(moments), size=topo.size)
print(f"rank {me}: done at world size {topo.size}", flush=True)
