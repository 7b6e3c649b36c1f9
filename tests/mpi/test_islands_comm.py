"""Islands as workers: each collective over the islands against the same collective over one rank per island.

Every island's ranks hold the same buffers; the sharded collectives must give every rank the result a whole-buffer
collective among the islands' first ranks gives, send 1/G of the bytes along the rail, and reassemble in the island.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpiopt import Topology
from mpiopt.comm.islands import shard_counts

pytestmark = pytest.mark.mpi


def island_size(world_size: int) -> int:
    """Islands of 2 where the ranks pair up, else of 1 (3 ranks: 3 islands of one)."""
    return 2 if world_size % 2 == 0 else 1


@pytest.fixture
def islands(world_size):
    topo = Topology(group_size=island_size(world_size))
    yield topo.islands()
    topo.Free()


def _data(island: int, n: int, dtype=np.float64, seed: int = 0) -> np.ndarray:
    """Island ``island``'s buffer: the same on each of its ranks."""
    return np.random.default_rng([seed, island]).standard_normal(n).astype(dtype)


@pytest.mark.parametrize("n", [1, 5, 64, 1001])
@pytest.mark.parametrize("nonblocking", [False, True])
def test_allreduce_sums_the_islands_buffers_on_every_rank(islands, n, nonblocking):
    P = islands.size
    buf = _data(islands.rank, n)
    out = np.full(n, np.nan)
    op = islands.Iallreduce if nonblocking else islands.Allreduce
    request = op(buf, out=out)
    if nonblocking:
        sharded = islands.size > 1 and islands.island.size > 1
        assert not (sharded and request.Test())  # the reassembly happens in Wait, on every rank at the same point
        request.Wait()
    expected = np.sum([_data(i, n) for i in range(P)], axis=0)
    np.testing.assert_allclose(out, expected, rtol=1e-15, atol=1e-15)
    np.testing.assert_array_equal(buf, _data(islands.rank, n))  # the input untouched
    whole = islands.island.allgather_obj(out.tobytes())
    assert all(w == whole[0] for w in whole)  # bitwise the same on the island's ranks
    inplace = buf.copy()
    islands.Allreduce(inplace)
    np.testing.assert_array_equal(inplace, out)


@pytest.mark.parametrize("n", [1, 7, 64, 999])
@pytest.mark.parametrize("nonblocking", [False, True])
def test_allgather_gives_every_islands_bytes_in_island_order(islands, n, nonblocking):
    P = islands.size
    send = np.random.default_rng([1, islands.rank]).integers(0, 256, n, dtype=np.uint8)
    recv = np.zeros((P, n), dtype=np.uint8)
    op = islands.Iallgather if nonblocking else islands.Allgather
    request = op(send, recv)
    if nonblocking:
        request.Wait()
    expected = np.stack([np.random.default_rng([1, i]).integers(0, 256, n, dtype=np.uint8) for i in range(P)])
    np.testing.assert_array_equal(recv, expected)


@pytest.mark.parametrize("block", [1, 9, 40])
def test_alltoall_sends_block_q_to_island_q(islands, block):
    P = islands.size
    send = np.array([[(11 * islands.rank + 3 * q + i) % 256 for i in range(block)] for q in range(P)], dtype=np.uint8)
    recv = np.zeros((P, block), dtype=np.uint8)
    islands.Ialltoall(send, recv).Wait()
    expected = np.array([[(11 * q + 3 * islands.rank + i) % 256 for i in range(block)] for q in range(P)], dtype=np.uint8)
    np.testing.assert_array_equal(recv, expected)


def test_rail_bytes_are_a_share_of_one_islands(islands):
    """Along the rail each rank sends its slice; the island's ranks together send one worker's bytes (padding aside)."""
    P, G, n = islands.size, islands.island.size, 1000
    ledger = islands.ledger
    before = ledger.snapshot()
    islands.Allreduce(_data(islands.rank, n, np.float32))
    islands.Allgather(np.zeros(n, np.uint8), np.zeros((P, n), np.uint8))
    delta = ledger.since(before)
    if P == 1 or G == 1:  # nothing sharded: the rail is the world's exchange (or a copy)
        return
    sent = delta["rail.Allreduce"].bytes_sent
    assert sum(islands.island.allgather_obj(sent)) == 4 * n  # one worker's float32 vector, split among the island
    gathered = islands.island.allgather_obj(delta["rail.Allgather"].bytes_sent)
    assert gathered == [-(-n // G)] * G  # equal padded slices: at most G - 1 bytes of padding in all
    mine = shard_counts(n, G)[islands.island.rank]
    assert delta["island.Allgatherv"].bytes_recv == 4 * (n - mine)  # the other slices, over the island's links


def test_unequal_groups_are_refused_before_any_communication(world_size):
    if world_size != 3:
        pytest.skip("groups of unequal size need 3 ranks in groups of 2")
    topo = Topology(group_size=2)
    assert topo.group_sizes == [2, 1]
    with pytest.raises(ValueError, match=r"groups of \[2, 1\].*divisor of 3"):
        topo.islands()
    topo.Free()
