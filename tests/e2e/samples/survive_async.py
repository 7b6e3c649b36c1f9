"""A flat-API asynchronous run that goes on without a lost worker: ``survive_async.py NAME HYPER_JSON STEPS RUNS OUT``.

``RUNS`` runs of ``STEPS`` gradients per worker, each a gradient of the worker's first world rank and its step.
A worker's injection point is its gradient (counted from 1 over the runs), the server's the messages it handled.
The server drops a lost worker and serves the others; a lost server raises ServerLost on every survivor, which
prints it and exits 3.  Each survivor prints one line per loss and saves, to OUT/<first rank>.npz, the final
parameters, the last run's record and whether a fresh instance loads its state at the shrunk size.
"""

import json
import os
import sys

import numpy as np

import mpiopt
from mpiopt.asyncrt import ServerLost
from mpiopt.comm.survival import INJECTION

name, hyper, steps, runs, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
D = 40
topo = mpiopt.Topology(on_failure="shrink")
me = topo.first_ranks[topo.rank]
params = np.random.default_rng(5).standard_normal(D).astype(np.float32)
alg = mpiopt.create(name, topo, **hyper)
alg.setup(params)


def gradient(current, step, grad_out):
    INJECTION.current = step + 1
    INJECTION.reached("step", me)
    grad_out[...] = current - 1.0 + 0.1 * np.random.default_rng([11, me, step]).standard_normal(D).astype(np.float32)
    return float(np.linalg.norm(current - 1.0))


told = 0
for run in range(runs):
    try:
        result = alg.run(params, gradient, steps)
    except ServerLost as lost:
        print(f"rank {me}: {lost}; lost ranks {alg.dropped[-1].lost}", flush=True)
        sys.exit(3)
    for recovery in alg.dropped[told:]:
        print(f"rank {me}: lost ranks {recovery.lost} in run {run + 1}; the world is now {recovery.size}", flush=True)
    told = len(alg.dropped)
state = alg.state_dict()
fresh = mpiopt.create(name, topo, **hyper)
fresh.setup(params.copy())
fresh.load_state_dict(state)
loaded = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(fresh.state_dict()["arrays"].values(), state["arrays"].values()))
record = {key: np.asarray(value) for key, value in vars(result).items() if key in ("version", "applied", "steps", "global_leader")}
np.savez(os.path.join(out, f"{me}.npz"), params=params, size=topo.size, loaded=loaded, counts=getattr(alg, "applied", 0), **record)
print(f"rank {me}: done at world size {topo.size}", flush=True)
