"""``tools/emulated_cluster.sh``: nodes as network namespaces that MPI sees as nodes, a link at the asked rate,
and nothing left behind when the command fails.  Needs root, ip/tc/unshare/nsenter and network namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .launch import ROOT, emulated_cluster_unavailable, mpiexec

SCRIPT = os.path.join(ROOT, "tools", "emulated_cluster.sh")


WHY_NOT = emulated_cluster_unavailable()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "runs")


def cluster(args, command, timeout=120):
    """Run COMMAND on an emulated cluster; return (exit status, output).  PATH leads to this Python's mpiexec."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PATH=os.path.dirname(mpiexec()) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run([SCRIPT, *args, "--", *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, cwd=ROOT, env=env)
    return proc.returncode, proc.stdout


def network_state():
    netns = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], stdout=subprocess.PIPE, text=True).stdout
    names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())
    mounts = [line for line in open("/proc/self/mounts") if "/run/netns/mpc" in line]
    etc = sorted(n for n in os.listdir("/etc/netns") if n.startswith("mpc")) if os.path.isdir("/etc/netns") else []
    return sorted(n.split()[0] for n in netns.splitlines() if n.startswith("mpc")), [n for n in names if n.startswith("mpc")], mounts, etc


TOPOLOGY = """
import json
from mpi4py import MPI
from mpiopt.comm import Topology
t = Topology()
rows = t.world.allgather_obj(t.describe())
if t.rank == 0:
    print("TOPOLOGY " + json.dumps(rows), flush=True)
"""


def test_two_nodes_of_two_ranks_are_two_groups_on_two_hosts():
    code, output = cluster(["--nodes", "2", "--ranks-per-node", "2", "--rate", "1gbit"],
                           ["mpiexec", "-n", "4", sys.executable, "-c", TOPOLOGY])
    assert code == 0, output
    rows = json.loads(next(line for line in output.splitlines() if line.startswith("TOPOLOGY "))[len("TOPOLOGY "):])
    assert [r["host"] for r in rows] == ["node0", "node0", "node1", "node1"], rows
    assert {r["num_groups"] for r in rows} == {2} and {r["group_size"] for r in rows} == {2}, rows
    assert [r["group_index"] for r in rows] == [0, 0, 1, 1], rows


# One rank per node: an Allreduce of N bytes between the two crosses both nodes' links (each way at the rate).
RATE_CHECK = """
import json, time
import numpy as np
from mpi4py import MPI
from mpiopt.bench.model.costs import collective_seconds
c = MPI.COMM_WORLD
n = 4_000_000
x = np.ones(n // 8); y = np.empty_like(x)
c.Allreduce(x, y)                                  # connections up
times = []
for _ in range(3):
    c.Barrier(); t = time.perf_counter(); c.Allreduce(x, y); times.append(time.perf_counter() - t)
if c.rank == 0:
    predicted = collective_seconds("allreduce", c.size, n, alpha=0.0, beta=8 / 100e6)
    print("RATE " + json.dumps({"measured": min(times), "predicted": predicted,
                                "hosts": c.allgather(MPI.Get_processor_name())}), flush=True)
else:
    c.allgather(MPI.Get_processor_name())
"""


def test_the_link_has_the_asked_rate():
    code, output = cluster(["--nodes", "2", "--ranks-per-node", "1", "--rate", "100mbit"],
                           ["mpiexec", "-n", "2", sys.executable, "-c", RATE_CHECK])
    assert code == 0, output
    result = json.loads(next(line for line in output.splitlines() if line.startswith("RATE "))[len("RATE "):])
    assert result["hosts"] == ["node0", "node1"], result
    assert abs(result["measured"] / result["predicted"] - 1) <= 0.25, result


def test_a_failing_command_leaves_nothing_behind_and_its_status_comes_back():
    before = network_state()
    code, output = cluster(["--nodes", "2", "--ranks-per-node", "1"], ["sh", "-c", "ip netns list >&2; exit 7"])
    assert code == 7, output
    assert "mpc" in output, output  # the namespaces did exist while it ran
    assert network_state() == before
    code, output = cluster(["--nodes", "2", "--ranks-per-node", "1"],
                           ["mpiexec", "-n", "2", sys.executable, "-c", "import sys; from mpi4py import MPI; sys.exit(3)"])
    assert code != 0, output
    assert network_state() == before


def test_refuses_without_a_command_and_documents_itself():
    proc = subprocess.run([SCRIPT, "--nodes", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 2 and "no command given" in proc.stdout, proc.stdout
    proc = subprocess.run([SCRIPT, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0 and "HYDRA_LAUNCHER_EXEC" in proc.stdout and "--ranks-per-node" in proc.stdout


TINY = ["--dataset", "synthetic", "--steps", "2", "--eval-every", "2", "--batch-size", "16"]


@pytest.mark.parametrize("algorithm", ["sgd", "ddp"])
def test_training_runs_across_the_two_nodes(tmp_path, algorithm):
    code, output = cluster(["--nodes", "2", "--ranks-per-node", "1", "--rate", "1gbit"],
                           ["mpiexec", "-n", "2", sys.executable, "-m", "mpiopt", "train", "--algorithm", algorithm,
                            *TINY, "--out", str(tmp_path / algorithm)], timeout=240)
    assert code == 0, output
