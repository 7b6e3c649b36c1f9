"""Ledger arithmetic (no MPI)."""

from __future__ import annotations

import pytest

from mpiopt.comm import Ledger, OpStats


def test_record_accumulates_and_snapshots_subtract():
    ledger = Ledger()
    ledger.record("world.Allreduce", 40, 40, 0.5)
    before = ledger.snapshot()
    ledger.record("world.Allreduce", 8, 8, 0.25)
    ledger.record("group.Bcast", 0, 100, 0.1)
    delta = ledger.since(before)
    assert delta["world.Allreduce"] == OpStats(1, 8, 8, 0.25, 0.0)
    assert delta["group.Bcast"] == OpStats(1, 0, 100, 0.1, 0.0)
    assert (delta.bytes_sent, delta.bytes_recv) == (8, 108)
    assert ledger["world.Allreduce"].calls == 2 and before["world.Allreduce"].calls == 1


def test_blocked_seconds_split_blocking_and_waiting():
    ledger = Ledger()
    ledger.record("world.Allreduce", 4, 4, 1.0)
    ledger.record("world.Iallreduce", 4, 4)
    ledger.add_time("world.Iallreduce", seconds=3.0, wait_seconds=0.5)
    assert ledger.blocked_seconds() == pytest.approx((1.0, 0.5))


def test_dict_round_trip_and_table():
    ledger = Ledger()
    ledger.record("world.Allgather", 1, 3, 0.1)
    again = Ledger.from_dict(ledger.as_dict())
    assert again.as_dict() == ledger.as_dict()
    assert "| world.Allgather | 1 | 1 | 3 |" in ledger.table("t")
    ledger.reset()
    assert list(ledger) == [] and ledger.total() == OpStats()


def test_opstats_arithmetic_covers_every_field():
    """+, - and as_tuple name the fields one by one (for speed): a field added to OpStats must be added there too."""
    from dataclasses import fields

    names = [f.name for f in fields(OpStats)]
    a, b = OpStats(*range(1, len(names) + 1)), OpStats(*(10 * v for v in range(1, len(names) + 1)))
    assert (b - a).as_tuple() == tuple(9 * v for v in range(1, len(names) + 1))
    assert (a + b).as_tuple() == tuple(11 * v for v in range(1, len(names) + 1))
    assert a.as_tuple() == tuple(getattr(a, name) for name in names)
