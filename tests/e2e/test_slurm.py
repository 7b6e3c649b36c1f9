"""jobs/cpu.sbatch on a real Slurm (tools/slurm_cluster.sh): a private one-node cluster with Slurm's defaults
(MpiDefault=none, TaskPlugin=task/none), the template submitted as jobs/README.md says.

- 4 ranks in 2 groups (LSGD's local leaders); the warning signal sent to the batch script mid-run
  (``scancel -s USR1 -b``, what ``--signal=B:USR1@300`` does before the time limit); the ranks checkpoint and exit
  75, the script requeues the job, the requeued job resumes and finishes; its final checkpoint is bitwise the one
  of the same template and settings run without interruption.
- With no PMI (``SRUN_MPI=none``) the job fails with mpiopt's message instead of training four copies.

Needs root and Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them when it runs as root on Debian);
skipped elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpiopt.checkpoint import first_difference
from mpiopt.metrics import read_metrics

from .launch import ROOT, library_pmi

h5py = pytest.importorskip("h5py")
pytest.importorskip("torch")

from mpiopt.checkpoint.layout import read_group  # noqa: E402  (needs h5py)

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol")
MISSING = [tool for tool in DAEMONS if shutil.which(tool) is None]
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a private Slurm needs root (slurmd starts jobs as their users)"),
    pytest.mark.skipif(bool(MISSING), reason=f"no {', '.join(MISSING)}: install Debian's slurm-wlm and munge "
                       "(apt-get install slurm-wlm munge; .ci/run does when it runs as root on Debian)"),
    pytest.mark.timeout(1200),
]

STEPS = 1000  # about 7 s of training at 4 ranks on 2 cores: the signal comes well before the end
CONFIG = f"""
algorithm = "lsgd"
dataset = "synthetic"
steps = {STEPS}
batch_size = 16
width = 32
group_size = 2
eval_every = {STEPS}
log_every = 500

[hyperparameters]
period = 2
global_period = 4
"""
# The template's allocation, made to fit one small node (jobs/README.md: change the #SBATCH lines to yours).
ALLOCATION = {"--nodes": "1", "--ntasks-per-node": "4", "--cpus-per-task": "1", "--time": "00:30:00"}


@pytest.fixture(scope="module")
def slurm():
    """A running private Slurm: the environment that reaches it (SLURM_CONF), stopped after the module."""
    cluster = subprocess.Popen([os.path.join(ROOT, "tools", "slurm_cluster.sh")], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in cluster.stdout:
            lines.append(line)
            found = re.match(r"slurm_cluster: ready SLURM_CONF=(\S+)", line)
            if found:
                break
        else:
            pytest.fail("tools/slurm_cluster.sh did not start:\n" + "".join(lines))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "PMI_", "OMPI_"))}
        yield dict(env, SLURM_CONF=found.group(1))
    finally:
        cluster.send_signal(signal.SIGTERM)  # the script stops its jobs and daemons
        try:
            cluster.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(cluster.pid, signal.SIGKILL)
            cluster.communicate()


def template(folder: Path) -> Path:
    """jobs/cpu.sbatch with the allocation's #SBATCH lines changed for this node, as a user does."""
    text = (Path(ROOT) / "jobs" / "cpu.sbatch").read_text()
    for option, value in ALLOCATION.items():
        text, count = re.subn(rf"^#SBATCH {option}=\S+", f"#SBATCH {option}={value}", text, flags=re.M)
        assert count == 1, option
    path = folder / "cpu.sbatch"
    path.write_text(text)
    return path


def submit(slurm: dict, folder: Path, out: Path, **settings) -> int:
    """Submit the template with ``bash`` and its settings (jobs/README.md); the job id."""
    folder.mkdir()
    (folder / "run.toml").write_text(CONFIG)
    env = dict(slurm, ACCOUNT="test", PARTITION="debug", MODULES="none", VENV=sys.prefix,
               CONFIG=str(folder / "run.toml"), OUT=str(out), CHECKPOINT_EVERY="100000", **settings)
    result = subprocess.run(["bash", str(template(folder))], env=env, cwd=folder, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return int(re.search(r"Submitted batch job (\d+)", result.stdout).group(1))


def job_state(slurm: dict, job: int) -> dict:
    """``scontrol show job``'s KEY=VALUE fields."""
    result = subprocess.run(["scontrol", "show", "job", str(job)], env=slurm, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout))


def wait_for(job: int, slurm: dict, folder: Path, seconds: float = 540, after: str = "") -> dict:
    """The job's fields once it has ended with ``after`` in its log (the log in the failure message otherwise).

    A job that requeues itself shows an ended state (FAILED, exit 75) for a moment before it is pending again:
    ``after`` names what only its next run writes.

    Slurm holds a requeued job back until its revoked credential has expired (Reason=BeginTime;
    tools/slurm_cluster.sh sets that to 30 s).  Forcing an earlier start (``scontrol update StartTime=now``) loses
    the job: "Killing non-startable batch job: Job credential revoked".
    """
    deadline = time.monotonic() + seconds
    seen = []  # the states it went through, for the failure message
    while True:
        begun = after in log_of(folder, job)  # read before the state: an ended state read after it is that run's
        state = job_state(slurm, job)
        summary = " ".join(f"{key}={state.get(key)}" for key in ("JobState", "Reason", "Restarts", "ExitCode"))
        if not seen or seen[-1] != summary:
            seen.append(summary)
        if begun and state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state
        if time.monotonic() > deadline:
            logs = Path(slurm["SLURM_CONF"]).parent / "log"
            daemons = "".join(f"\n--- {path.name} (end):\n" + "".join(path.read_text().splitlines(True)[-40:])
                              for path in sorted(logs.glob("*.log")))
            pytest.fail(f"job {job} still {state['JobState']} after {seconds:.0f} s; its states:\n  " + "\n  ".join(seen)
                        + f"\nits log:\n{log_of(folder, job)}{daemons}")
        time.sleep(0.5)


def log_of(folder: Path, job: int) -> str:
    path = folder / f"mpiopt-cpu-{job}.out"  # the template's -o %x-%j.out
    return path.read_text() if path.exists() else "(no log)"


def _read(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        return {"model": read_group(f["model"]), "ranks": read_group(f["ranks"])}


def skip_without_the_pmi(slurm: dict) -> None:
    """Skip when this cluster's srun cannot give this MPI's PMI (Debian's PMIx plugin loads libpmix.so, which only
    libpmix-dev installs; Open MPI needs it, MPICH's pmi2 is built in)."""
    pmi = library_pmi()
    result = subprocess.run(["srun", "-n", "1", f"--mpi={pmi}", "true"], env=slurm, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        pytest.skip(f"srun --mpi={pmi} fails on this Slurm (Debian: apt-get install libpmix-dev): {result.stderr.strip()}")


def test_warning_signal_checkpoints_requeues_and_the_resumed_job_ends_bitwise_as_an_uninterrupted_one(slurm, tmp_path):
    skip_without_the_pmi(slurm)
    out, whole = tmp_path / "signalled" / "OUT", tmp_path / "whole" / "OUT"
    job = submit(slurm, tmp_path / "signalled", out)
    reference = submit(slurm, tmp_path / "whole", whole)  # the same template and settings, left alone
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and '"kind": "step"' in metrics.read_text()):  # training has started
        state = job_state(slurm, job)
        if time.monotonic() > deadline or state["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING"):
            pytest.fail(f"no step recorded; job {job} is {state['JobState']} ({state.get('Reason')}); its log:\n"
                        f"{log_of(tmp_path / 'signalled', job)}")
        time.sleep(0.2)
    # What Slurm does before the time limit (--signal=B:USR1@300): USR1 to the batch script only.
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm, check=True, timeout=30)

    state = wait_for(job, slurm, tmp_path / "signalled", after="resuming from")
    log = log_of(tmp_path / "signalled", job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", log
    assert state["Restarts"] == "1", state  # requeued once
    assert log.count(f"mpiopt job: srun --mpi={library_pmi()}\n") == 2, log  # MpiDefault=none, task/none: a PMI, no binding
    assert "warning signal" in log and f"the ranks checkpointed and stopped (exit 75); requeueing job {job}" in log, log
    saved = re.search(r"resuming from \S+ckpt-(\d+)\.h5 after step (\d+)", log)
    assert saved, log
    stopped = int(saved.group(2))
    assert 0 < stopped < STEPS, log
    assert "4 ranks in 2 groups" in log, log
    # The first part's steps and the resumed part's, each once: the second job started at the checkpoint.
    steps = [r["step"] for r in read_metrics(metrics).steps]
    assert steps == list(range(1, STEPS + 1)), (steps[:3], steps[-3:], len(steps))

    ref_state = wait_for(reference, slurm, tmp_path / "whole")
    assert ref_state["JobState"] == "COMPLETED" and ref_state["Restarts"] == "0", log_of(tmp_path / "whole", reference)
    last = f"ckpt-{STEPS:09d}.h5"
    resumed, uninterrupted = _read(out / "checkpoints" / last), _read(whole / "checkpoints" / last)
    assert first_difference(resumed, uninterrupted) is None
    middle = _read(out / "checkpoints" / f"ckpt-{stopped:09d}.h5")
    assert first_difference(middle["ranks"], resumed["ranks"]) is not None  # the resumed job did train


def test_without_a_pmi_the_job_fails_with_the_message_instead_of_training_four_copies(slurm, tmp_path):
    out = tmp_path / "nopmi" / "OUT"
    job = submit(slurm, tmp_path / "nopmi", out, SRUN_MPI="none")
    state = wait_for(job, slurm, tmp_path / "nopmi", seconds=120)
    log = log_of(tmp_path / "nopmi", job)
    assert state["JobState"] == "FAILED" and state["ExitCode"] != "0:0" and state["Restarts"] == "0", log
    message = "Slurm's srun started 4 processes (SLURM_STEP_NUM_TASKS=4), but MPI's world has 1 rank"
    assert log.count(message) == 4, log  # every task says it
    assert "srun --mpi=pmi2" in log and "1 rank in 1 group" not in log, log
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_a_lost_rank_is_survived_by_open_mpis_mpiexec_inside_an_allocation(slurm):
    """Open MPI only: in a Slurm allocation, `mpiexec --with-ft ulfm --mca btl tcp,self` (tools/survival_latency.py's
    launch) goes on without a rank killed with SIGKILL.  Not `srun --mpi=pmix`: Slurm's PMIx plugin cancels the whole
    step when a task dies (docs/failures.md)."""
    if library_pmi() != "pmix":
        pytest.skip("surviving a lost rank needs Open MPI's ULFM (MPIOPT_MPI=openmpi)")
    result = subprocess.run(["salloc", "-n", "4", sys.executable, os.path.join(ROOT, "tools", "survival_latency.py"), "--kills", "1"],
                            env=slurm, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Granted job allocation" in result.stderr, result.stderr
    assert re.search(r"median of 1: [\d.]+ s", result.stdout), result.stdout


def test_a_lost_rank_is_replaced_inside_an_allocation(slurm):
    """Open MPI only: `mpiopt train --on-failure respawn` under Open MPI's mpiexec in a Slurm allocation of 5 tasks for
    4 ranks: the process started for the killed rank joins (tools/respawn_latency.py checks the join and the step)."""
    if library_pmi() != "pmix":
        pytest.skip("surviving a lost rank needs Open MPI's ULFM (MPIOPT_MPI=openmpi)")
    result = subprocess.run(["salloc", "-n", "5", sys.executable, os.path.join(ROOT, "tools", "respawn_latency.py"), "--kills", "1"],
                            env=slurm, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Granted job allocation" in result.stderr, result.stderr
    assert re.search(r"median of 1: join [\d.]+ s, step [\d.]+ s", result.stdout), result.stdout
