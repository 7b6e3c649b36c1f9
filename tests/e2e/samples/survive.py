"""A flat-API run that goes on without a lost rank: ``survive.py NAME HYPER_JSON STEPS OUT``.

Each rank steps on a gradient of its first world rank and the step alone; a RankLost is answered by shrinking the
topology, moving the algorithm to the survivors and redoing the step (with islands, the other ranks of an island that
lost a rank leave with it).  With ``"on_failure": "respawn"`` in HYPER_JSON a process of this program starts in each
lost rank's place, takes its state from the survivors in its set-up and goes on from the step they redo
(``SURVIVE_SPAWN_REFUSED=1``: the spawn is refused, as MPI refuses it without a free slot).  Each
survivor prints one line per loss (a replacement: one as it joins) and
saves its parameters after every step, whether its state resumed bitwise on a fresh instance, and the model the
algorithm evaluates, to OUT/<first rank>.npz.
"""

import json
import os
import socket
import sys
import time

import numpy as np

import mpiopt
from mpiopt.comm import IslandLeft, RankLost
from mpiopt.comm.survival import INJECTION

name, hyper, steps, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if os.environ.get("SURVIVE_SPAWN_REFUSED"):  # as MPI refuses where no slot is free (a killed process frees its own)
    mpiopt.Topology.spawn = lambda self, replaced, args: (None, "refused by the test")
D = 40
topo = mpiopt.Topology(on_failure=hyper.pop("on_failure", "shrink"), group_size=hyper.pop("group_size", None))
me = topo.first_ranks[topo.rank]
replacement = topo.joining
print(f"rank {me}: on {socket.gethostname()}", flush=True)
params = np.random.default_rng(5).standard_normal(D).astype(np.float32)
alg = mpiopt.create(name, topo, **hyper)
alg.setup(params)  # a replacement's: the survivors' parameters and state
history, t, recovered_at, first_step, joined_with = [], 1, None, 1, params.copy()
if replacement:  # the survivors redo the step after the last one they all completed
    t = first_step = alg.steps + 1
    print(f"rank {me}: joined at step {t}; the world is {topo.size}", flush=True)
while t <= steps:
    INJECTION.current = t
    INJECTION.reached("step", me)
    grad = np.random.default_rng([11, me, t]).standard_normal(D).astype(np.float32)
    try:
        alg.step(params, grad, loss=float(np.linalg.norm(params - 1.0)))
    except RankLost:
        while True:  # a rank lost while the survivors move the state over: recover from that one too
            try:
                recovery = topo.recover()
            except IslandLeft as left:  # islands: this rank's island lost a rank, and its part ends
                print(f"rank {me}: left with its island at step {t}; the world is now {left.size}", flush=True)
                sys.exit(0)
            print(f"rank {me}: lost ranks {recovery.lost} at step {t}; the world is now {recovery.size}", flush=True)
            try:
                alg = alg.recovered(params)
                break
            except RankLost:
                continue
        recovered_at = t
        continue
    if recovered_at == t:  # the wall clock when the redone step completed (tools/survival_latency.py)
        print(f"rank {me}: step {t} completed again at {time.time():.6f}", flush=True)
    history.append(params.copy())
    t += 1
# The state after the loss resumes bitwise at the shrunk size: a fresh instance loaded from state_dict() takes one
# more step as this one does.
state, twin = alg.state_dict(), params.copy()
fresh = mpiopt.create(name, topo, **hyper)
fresh.setup(twin)
twin[...] = params  # the set-up's own start (a mean, a broadcast) gives way to the state's
fresh.load_state_dict(state)
extra = np.random.default_rng([12, me]).standard_normal(D).astype(np.float32)
for instance, values in ((alg, params), (fresh, twin)):
    instance.step(values, extra, loss=float(np.linalg.norm(values - 1.0)))
    instance.finish(values)
resumed = bool(np.array_equal(params, twin))
evaluated = params.astype(np.float64)
if alg.evaluates == "average":
    topo.world.Allreduce(evaluated)
    evaluated /= topo.size
np.savez(os.path.join(out, f"{me}.npz"), history=np.array(history), evaluated=evaluated, size=topo.size, resumed=resumed,
         first_step=first_step, joined_with=joined_with)
print(f"rank {me}: done at world size {topo.size}", flush=True)
