"""From a rank's death to the survivors' next completed step, under Open MPI's ULFM (docs/failures.md).

    MPIOPT_MPI=openmpi source tools/setup.sh && python tools/survival_latency.py [--kills 5] [--algorithm sgd]
    tools/emulated_cluster.sh --nodes 2 --ranks-per-node 2 --rate 1gbit -- python tools/survival_latency.py  # across nodes

Runs tests/e2e/samples/survive.py at 4 ranks ``--kills`` times; each time rank 2 stops inside the exchange of step
6 and is killed with SIGKILL; the time is from the kill to the wall clock at which the slowest survivor completed
the step it found the loss in again (shrink, agreement, state moved, the step redone): step 6, or step 7 where rank 2
had given its part of step 6's exchange before it stopped.  Prints each and the median.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.e2e.test_survival import SYNCHRONOUS, survive  # noqa: E402  (the tests' launcher and kill)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5, help="runs, one kill each (default 5)")
    parser.add_argument("--algorithm", default="sgd", choices=sorted(SYNCHRONOUS), help="the algorithm (default sgd)")
    args = parser.parse_args()
    times = []
    for run in range(args.kills):
        with tempfile.TemporaryDirectory() as folder:
            killed = {}
            code, output, _ = survive(Path(folder), args.algorithm, SYNCHRONOUS[args.algorithm], 8, ["2@6:exchange"],
                                      on_kill=lambda: killed.setdefault("at", time.time()))
        # Inside step 6's exchange, or after it where rank 2 had given its part first: the step the survivors name.
        found = re.search(r"lost ranks \[2\] at step (\d+)", output)
        done = [float(t) for t in re.findall(rf"step {found.group(1)} completed again at ([\d.]+)", output)] if found else []
        if code != 0 or len(done) != 3:
            print(output)
            return 1
        times.append(max(done) - killed["at"])
        host = re.search(r"rank 2: on (\S+)", output)
        print(f"kill {run + 1}: {times[-1]:.3f} s from the kill of rank 2 (on {host.group(1) if host else '?'}) to the "
              f"survivors' step {found.group(1)} redone", flush=True)
    print(f"median of {len(times)}: {statistics.median(times):.3f} s ({args.algorithm}, 4 ranks, "
          f"{os.cpu_count()} cores, Open MPI --with-ft ulfm --mca btl tcp,self)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
