"""async_lsgd's leader book when a worker is lost (no MPI): dropped in a run, renumbered for the survivors."""

from __future__ import annotations

import numpy as np

from mpiopt.algorithms.async_lsgd_server import GLOBAL, LOCAL, LeaderBook

WORLD = -1  # the book's scope id of the global leader


def _book():
    """Ranks 1, 2 in group 0, rank 3 in group 1; rounds every 6 (local) and 12 (global) steps in all."""
    book = LeaderBook({1: 0, 2: 0, 3: 1}, period=2, global_period=4, pulls_on=(True, True))
    book.note(1, 4, 0.5)  # rank 1 leads group 0 and the world
    book.note(2, 3, 0.7)
    book.note(3, 2, 0.9)
    return book


def test_a_dropped_leader_is_replaced_and_the_lost_worker_owes_nothing():
    book = _book()
    assert book.leader[0] == 1 and book.leader[WORLD] == 1
    crossings = book.crossings[1].copy()
    book.drop(1)
    assert book.leader[0] == 2 and book.leader[WORLD] == 2  # the lowest loss among the others
    assert book.want_upload[2] and not book.want_upload[1]  # the new global leader is asked for a copy
    assert list(book.owed[1]) == [-1, -1] and 1 not in book.members[0] and 1 not in book.members[WORLD]
    book.note(2, 13, 0.6)  # T = 4 + 13 + 2 = 19: local rounds 2 and 3, the global round 1
    assert book.rounds == [3, 1]
    np.testing.assert_array_equal(book.crossings[1], crossings)  # no round opened for the lost worker
    assert book.crossings[3, LOCAL] == 3 and book.crossings[3, GLOBAL] == 1  # round 1 came before the drop


def test_renumbered_for_the_survivors_keeps_their_rows_and_elects_a_lost_leaders_successor():
    book = _book()
    like = np.zeros(4)
    for w, steps, loss in ((1, 10, 0.5), (2, 10, 0.7), (3, 10, 0.6)):  # every LAST arrived: each has a final copy
        book.latest[w] = np.full(4, float(w))
        book.uploaded(w, steps, loss, final=True)
    assert book.global_leader == 1
    # Rank 1 lost after its LAST (found by the survivors' agreement): old ranks 0, 2, 3 become 0, 1, 2.
    fresh = book.renumbered([0, 2, 3], {1: 0, 2: 1}, period=2, global_period=4)
    np.testing.assert_array_equal(fresh.steps, book.steps[[0, 2, 3]])
    np.testing.assert_array_equal(fresh.pulls, book.pulls[[0, 2, 3]])
    assert fresh.total == book.total == 30
    # The lowest loss of the survivors (old rank 3, now 2) leads the world, from its final upload.
    assert fresh.global_leader == 2 and fresh.source[WORLD] == 2
    np.testing.assert_array_equal(fresh.latest[2], np.full(4, 3.0))
    assert set(fresh.latest) == {1, 2}
    # Rounds go on at the new cadence (2 workers: every 4 and 8 steps) from the next multiple, not in a burst.
    assert fresh.every == (4, 8)
    assert fresh.rounds == [30 // 4, 30 // 8]
    fresh.note(1, 12, 0.7)  # T = 32: one more local round, one more global
    assert fresh.rounds == [8, 4]
    assert fresh.loader(fresh.state_dict(), like) is not None  # its state fits a book of the shrunk world
