"""The wait policy's pure parts: what ``auto`` means for a node, and the pauses between polls."""

from __future__ import annotations

import pytest

from mpiopt.comm import waiting
from mpiopt.comm.waiting import Backoff, choose_wait_policy


@pytest.mark.parametrize(
    "ranks, masks, expect",
    [
        (4, [[0, 1]] * 4, "passive"),  # 4 unbound ranks on a 2-CPU machine
        (2, [[0, 1]] * 2, "active"),
        (4, [[0], [1], [2], [3]], "active"),  # bound one rank per core, as srun --cpu-bind=cores does
        (4, [[0], [0], [1], [1]], "passive"),  # bound two ranks per core
        (1, [[7]], "active"),
    ],
)
def test_auto_compares_the_node_ranks_with_their_cpus_together(ranks, masks, expect):
    assert choose_wait_policy("auto", ranks, masks) == expect


@pytest.mark.parametrize("policy", ["active", "passive"])
def test_an_explicit_policy_is_kept_whatever_the_node(policy):
    assert choose_wait_policy(policy, 8, [[0]] * 8) == policy
    assert choose_wait_policy(policy, 1, [[0, 1, 2]]) == policy


@pytest.mark.parametrize("bad", ["spin", "", None, 1])
def test_a_bad_policy_is_named(bad):
    with pytest.raises(ValueError, match="auto, active, passive; got " + repr(bad).replace("(", r"\(")):
        choose_wait_policy(bad, 1, [[0]])


def test_backoff_spins_first_then_sleeps_doubling_up_to_the_longest(monkeypatch):
    slept = []
    now = [100.0]
    monkeypatch.setattr(waiting.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(waiting.time, "sleep", slept.append)
    backoff = Backoff(longest=8e-5, spin=1e-3)
    backoff.pause()
    now[0] += 0.9e-3
    backoff.pause()
    assert slept == []  # still spinning
    now[0] += 0.2e-3
    for _ in range(5):
        backoff.pause()
    assert slept == pytest.approx([1e-5, 2e-5, 4e-5, 8e-5, 8e-5])


def test_backoff_with_no_longest_pause_never_sleeps(monkeypatch):
    monkeypatch.setattr(waiting.time, "sleep", lambda s: pytest.fail(f"slept {s}"))
    backoff = Backoff(longest=0.0, spin=-1.0)  # spinning over at once
    for _ in range(3):
        backoff.pause()


def test_backoff_checks_its_longest_pause():
    with pytest.raises(ValueError, match="longest must be >= 0 seconds, got -1"):
        Backoff(longest=-1)
