"""The passive wait policy's pauses between polls."""

from __future__ import annotations

import pytest

from mpiopt.comm import waiting
from mpiopt.comm.waiting import Backoff


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
