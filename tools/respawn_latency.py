"""From a rank's death to the replacement's join and to the first step after it, ``mpiopt train --on-failure respawn``.

    MPIOPT_MPI=openmpi source tools/setup.sh && python tools/respawn_latency.py [--kills 3] [--algorithm sgd]
    PRTE_MCA_hwloc_default_binding_policy=none tools/emulated_cluster.sh --nodes 2 --ranks-per-node 3 --rate 1gbit -- \
        python tools/respawn_latency.py --map-by ppr:2:node [--islands]

(Across emulated nodes each node needs a free slot for the replacement: 3 slots a node, 2 ranks on each; and the
emulated nodes share this machine's cores, so Open MPI must not bind a rank to a core of its own.)

Runs ``mpiopt train`` (the digits MLP, 12 steps) at 4 ranks under ``mpiexec --with-ft ulfm`` ``--kills`` times; each
time rank 2 stops inside the exchange of step 7 and is killed with SIGKILL.  Two times from the kill, read off the
run's output as it comes: the replacement's join line (recovery, the survivors' checkpoint, spawn, merge, the data
re-read), and rank 0's progress line of step 7, redone by all 4 ranks from that checkpoint.  Prints each and the medians.
``--islands``: 2 islands of 2 (``--group-size 2``: under ``--map-by ppr:2:node`` each node one island), so rank 3 leaves
with rank 2's island and two processes start in their places.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.e2e.launch import ROOT, mpiexec  # noqa: E402  (the tests' launcher)


def one(folder: Path, algorithm: str, map_by: str, islands: bool) -> Tuple[float, float]:
    """(seconds to the join line, seconds to step 7's progress line) of one run with one kill."""
    pause = folder / "pause"
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPIOPT_TEST_PAUSE_AT="2@7:exchange", MPIOPT_TEST_PAUSE_FILE=str(pause),
               MPIOPT_FINALIZE_SECONDS="3")
    placing = ["--map-by", map_by] if map_by else ["--oversubscribe"]
    command = [mpiexec(), "--allow-run-as-root", *placing, "--with-ft", "ulfm", "--mca", "btl", "tcp,self", "-n", "4",
               sys.executable, "-m", "mpiopt", "train", "--algorithm", algorithm, "--steps", "12", "--batch-size", "16",
               "--progress", "lines", "--on-failure", "respawn", "--out", str(folder / "run"),
               *(["--islands", "--group-size", "2"] if islands else [])]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    killed = {}

    def kill() -> None:  # the paused rank holds the others: no output comes until it is killed
        while not (pause.exists() and pause.read_text().endswith("\n")):
            time.sleep(0.01)
        os.kill(int(pause.read_text()), signal.SIGKILL)
        killed["at"] = time.monotonic()

    threading.Thread(target=kill, daemon=True).start()
    joined = stepped = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        now = time.monotonic()
        if "at" in killed and joined is None and "a replacement for" in line:
            joined = now
        if joined is not None and stepped is None and re.search(rf"{algorithm} step +7/12", line):
            stepped = now
    code = proc.wait()
    if joined is None or stepped is None:
        raise SystemExit(f"the run did not join and step (exit {code}):\n{''.join(lines[-30:])}")
    if code != 0:  # the launcher's own end after a kill (docs/failures.md): the run itself joined and stepped
        print(f"(the launcher exited {code} after the run)", flush=True)
    return joined - killed["at"], stepped - killed["at"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3, help="runs, one kill each (default 3)")
    parser.add_argument("--algorithm", default="sgd", help="a synchronous algorithm (default sgd)")
    parser.add_argument("--map-by", default="", help="Open MPI's --map-by for the 4 ranks, leaving slots free for the "
                        "replacement (default: --oversubscribe on this host)")
    parser.add_argument("--islands", action="store_true", help="2 islands of 2: a whole island is replaced")
    args = parser.parse_args()
    times = []
    for _ in range(args.kills):
        with tempfile.TemporaryDirectory() as folder:
            times.append(one(Path(folder), args.algorithm, args.map_by, args.islands))
            print(f"kill to join {times[-1][0]:.2f} s, to step 7 redone at 4 ranks {times[-1][1]:.2f} s", flush=True)
    print(f"median of {len(times)}: join {statistics.median(t for t, _ in times):.2f} s, "
          f"step {statistics.median(s for _, s in times):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
