"""jobs/: the templates parse, check their settings, submit themselves, requeue on the warning
signal, and use only mpiopt commands and flags that exist.

Slurm is not needed: fake ``sbatch``, ``srun`` and ``scontrol`` on the PATH record how the
templates call them.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .launch import ROOT, library_pmi

JOBS = Path(ROOT) / "jobs"
SBATCH = sorted(JOBS.glob("*.sbatch"))
SCRIPTS = SBATCH + sorted(JOBS.glob("*.sh"))
SETTINGS = ("MODULES", "VENV", "CONFIG", "OUT")
SLURM_ONLY = {"ACCOUNT": "Slurm account", "PARTITION": "partition"}


def test_templates_exist():
    assert {p.name for p in SBATCH} == {"cpu.sbatch", "gpu-cuda-aware.sbatch"}
    assert (JOBS / "mpirun-example.sh").exists() and (JOBS / "README.md").exists()


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bash_parses_it(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_warning_signal_and_requeue_are_asked_for(path):
    text = path.read_text()
    for line in ("#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "#SBATCH -o %x-%j.out"):
        assert re.search(rf"^{re.escape(line)}\b", text, re.M), line
    assert 'srun "${srun_flags[@]}" ' in text


def fake_tools(folder: Path) -> Path:
    """sbatch, srun and scontrol that record their arguments; srun ends with $FAKE_SRUN_EXIT or, on USR1, 75.

    ``scontrol show config`` prints ``MpiDefault`` and ``TaskPlugin`` from ``$FAKE_MPI_DEFAULT`` and
    ``$FAKE_TASK_PLUGIN`` (default pmi2 and task/affinity, a cluster that chose both); ``python`` is this one.
    """
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    tools = {
        "python": f'exec "{sys.executable}" "$@"',
        "sbatch": 'echo "$@" > "$FAKE_LOG/sbatch"',
        "scontrol": (
            'if [[ "$*" == "show config" ]]; then\n'
            '    printf "%-23s = %s\\n" MpiDefault "${FAKE_MPI_DEFAULT:-pmi2}" TaskPlugin "${FAKE_TASK_PLUGIN:-task/affinity}"; exit\n'
            'fi\n'
            'echo "$@" > "$FAKE_LOG/scontrol"'
        ),
        "srun": (
            'echo "$@" > "$FAKE_LOG/srun"\n'
            "trap 'exit 75' USR1\n"
            'if [[ -n ${FAKE_SRUN_EXIT-} ]]; then exit "$FAKE_SRUN_EXIT"; fi\n'
            'sleep 0.2; touch "$FAKE_LOG/started"\n'
            "while :; do sleep 0.05; done"
        ),
    }
    for name, body in tools.items():
        tool = bin_dir / name
        tool.write_text(f"#!/bin/bash\n{body}\n")
        tool.chmod(0o755)
    return bin_dir


@pytest.fixture
def job_env(tmp_path):
    """A complete environment for the templates, outside Slurm, with the fake tools first on the PATH."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    log = tmp_path / "log"
    log.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(
        PATH=f"{fake_tools(tmp_path)}:{os.environ['PATH']}", FAKE_LOG=str(log), MODULES="none", VENV=str(venv),
        CONFIG="run.toml", OUT=str(tmp_path / "out"), ACCOUNT="acct42", PARTITION="part7",
    )
    return env, log


def run_template(path, env, timeout=60):
    return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
@pytest.mark.parametrize("missing", SETTINGS + tuple(SLURM_ONLY))
def test_a_missing_setting_stops_it_with_a_message(path, job_env, missing):
    env, log = job_env
    del env[missing]
    result = run_template(path, env)
    assert result.returncode != 0
    words = SLURM_ONLY.get(missing, "")
    assert re.search(rf"{missing}: set {missing} to .*{words}", result.stderr), result.stderr
    assert not (log / "sbatch").exists()


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_run_with_bash_it_submits_itself(path, job_env):
    env, log = job_env
    result = run_template(path, env)
    assert result.returncode == 0, result.stderr
    assert (log / "sbatch").read_text().split() == ["--account=acct42", "--partition=part7", str(path)]


def start_job(path, env, **extra):
    env = dict(env, SLURM_JOB_ID="4242", SLURM_CPUS_PER_TASK="4", **extra)
    return subprocess.Popen(["bash", str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_warning_signal_is_forwarded_and_the_job_requeued(path, job_env):
    env, log = job_env
    job = start_job(path, env)
    deadline = time.monotonic() + 60
    while not (log / "started").exists():
        assert job.poll() is None, job.communicate()[0]
        assert time.monotonic() < deadline, "the fake srun never started"
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    output, _ = job.communicate(timeout=60)
    assert job.returncode == 75, output
    assert "warning signal" in output and "requeueing job 4242" in output, output
    assert (log / "scontrol").read_text().split() == ["requeue", "4242"]
    srun = (log / "srun").read_text()
    assert srun.startswith("--mpi=pmi2 --cpu-bind=cores ") and "--resume auto" in srun, srun


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
@pytest.mark.parametrize("code", [0, 1])
def test_other_exits_are_passed_on_without_requeue(path, job_env, code):
    env, log = job_env
    job = start_job(path, env, FAKE_SRUN_EXIT=str(code))
    output, _ = job.communicate(timeout=60)
    assert job.returncode == code, output
    assert not (log / "scontrol").exists()


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "settings, flags",
    [
        # Slurm's defaults: no PMI, no binding (the case of issue 24, where srun started worlds of one)
        ({"FAKE_MPI_DEFAULT": "none", "FAKE_TASK_PLUGIN": "task/none"}, ["--mpi=LIBRARY"]),
        ({"FAKE_MPI_DEFAULT": "pmix", "FAKE_TASK_PLUGIN": "task/affinity,task/cgroup"}, ["--mpi=pmix", "--cpu-bind=cores"]),
        ({"FAKE_MPI_DEFAULT": "none", "FAKE_TASK_PLUGIN": "task/cgroup", "SLURM_MPI_TYPE": "cray_shasta"}, ["--mpi=cray_shasta", "--cpu-bind=cores"]),
        ({"FAKE_MPI_DEFAULT": "pmix", "SRUN_MPI": "pmi2", "SRUN_CPU_BIND": "none"}, ["--mpi=pmi2", "--cpu-bind=none"]),
    ],
    ids=["slurm-defaults", "site-pmix", "slurm-mpi-type", "given"],
)
def test_srun_gets_a_pmi_and_binds_only_where_the_cluster_can(path, job_env, settings, flags):
    env, log = job_env
    job = start_job(path, env, FAKE_SRUN_EXIT="0", **settings)
    output, _ = job.communicate(timeout=60)
    assert job.returncode == 0, output
    expected = [f.replace("LIBRARY", library_pmi()) for f in flags]
    srun = (log / "srun").read_text().split()
    assert srun[: len(expected) + 1] == expected + ["python" if "cpu" in path.name else "bash"], srun
    assert f"mpiopt job: srun {' '.join(expected)}\n" in output


# -- the mpiopt commands and flags the jobs use --------------------------------------------------
COMMAND = re.compile(r"python -m mpiopt (\w+)([^'#;&|\n]*)")


def used_commands():
    """``(file, command, flag)`` for every ``python -m mpiopt COMMAND --flag`` in jobs/ (continued lines joined)."""
    found = []
    for path in sorted(JOBS.iterdir()):
        text = path.read_text().replace("\\\n", " ")
        for command, rest in COMMAND.findall(text):
            found.append((path.name, command, None))
            found += [(path.name, command, flag) for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest)]
    return found


def cli_flags():
    from mpiopt.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(parser._option_string_actions) for name, parser in sub.choices.items()}


def test_every_mpiopt_command_and_flag_used_exists():
    used = used_commands()
    commands = {command for _, command, _ in used}
    assert {"train", "compare"} <= commands, used  # the parser below did find them
    flags = cli_flags()
    unknown = [(f, c, flag) for f, c, flag in used if c not in flags or (flag is not None and flag not in flags[c])]
    assert not unknown, f"commands or flags that python -m mpiopt lacks: {unknown}"


def test_lsgd_example_settings_are_valid(tmp_path):
    from mpiopt.cli.main import build_parser
    from mpiopt.training.flags import config_from_args

    # The example reads CIFAR-10 from data_dir; any existing folder passes the check.
    args = build_parser().parse_args(["train", "--config", str(JOBS / "lsgd-multinode.toml"), "--data-dir", str(tmp_path)])
    config, algorithms = config_from_args(args, "train")
    assert algorithms == ["lsgd"] and config.group_size is None  # the groups are the nodes
    assert config.algorithm_hyperparameters()["global_period"] == 16


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_islands_1_trains_each_node_as_one_worker_and_another_value_is_refused(path, job_env):
    env, log = job_env
    job = start_job(path, env, ISLANDS="1", FAKE_SRUN_EXIT="0")
    output, _ = job.communicate(timeout=60)
    assert job.returncode == 0, output
    srun = (log / "srun").read_text()
    assert "--islands" in srun, srun
    (log / "srun").unlink()
    job = start_job(path, env, FAKE_SRUN_EXIT="0")  # unset: the settings file's
    job.communicate(timeout=60)
    assert "--islands" not in (log / "srun").read_text()
    refused = start_job(path, env, ISLANDS="yes")
    output, _ = refused.communicate(timeout=60)
    assert refused.returncode == 2 and "ISLANDS must be 1 or 0, got 'yes'" in output


def test_diloco_islands_example_settings_are_valid():
    from mpiopt.cli.main import build_parser
    from mpiopt.training.flags import config_from_args

    args = build_parser().parse_args(["train", "--config", str(JOBS / "diloco-islands.toml")])
    config, algorithms = config_from_args(args, "train")
    assert algorithms == ["diloco"] and config.islands and config.islands_for("diloco") and config.group_size is None
    assert config.algorithm_hyperparameters()["period"] == 64
