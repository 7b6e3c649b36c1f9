"""Resuming on another number of ranks: each algorithm's rule (mpiopt.algorithms.resize) on synthetic states,
and real algorithms' states moved by the rules and loaded back."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpiopt
from mpiopt.algorithms import algorithm_class, available
from mpiopt.algorithms import SYNCHRONOUS as SYNC
from mpiopt.algorithms.resize import ResizeError, hyperparameter_differences, resize_states, rules_of

SYNCHRONOUS = sorted(available(SYNC))
D = 12


def state(name: str, rank: int, arrays: dict, scalars: dict = None, steps: int = 5) -> dict:
    """A state_dict of ``name`` as old rank ``rank`` of a world of its own would write it."""
    return {
        "algorithm": name, "world_size": 99, "steps": steps, "lr": 0.05, "hyperparameters": {"old": True},
        "arrays": arrays, "scalars": scalars or {},
    }


def vec(seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(D).astype(dtype)


def test_every_synchronous_algorithm_has_a_rule_for_exactly_its_state_entries():
    assert {name for name in available() if algorithm_class(name).resize_rules is not None} == set(SYNCHRONOUS)
    for name in SYNCHRONOUS:
        cls = algorithm_class(name)
        assert set(rules_of(name)) == set(cls.state_arrays) | set(cls.state_scalars), name


@pytest.mark.parametrize("old,new", [(2, 4), (4, 2), (2, 3), (3, 3)])
def test_sgd_copies_the_momentum_and_sets_the_new_world(old, new):
    momentum = vec(1)
    olds = [state("sgd", r, {"momentum_buffer": momentum.copy()}) for r in range(old)]
    states, notes = resize_states("sgd", olds, new, {"momentum": 0.9})
    assert len(states) == new and notes == []
    for s in states:
        assert np.array_equal(s["arrays"]["momentum_buffer"], momentum)
        assert s["world_size"] == new and s["hyperparameters"] == {"momentum": 0.9}
        assert s["steps"] == 5 and s["lr"] == 0.05 and s["algorithm"] == "sgd"


@pytest.mark.parametrize("old,new", [(2, 4), (4, 2), (3, 5)])
def test_signum_momentum_follows_rank_r_mod_old(old, new):
    olds = [state("signum", r, {"momentum_buffer": vec(r)}) for r in range(old)]
    states, notes = resize_states("signum", olds, new, {})
    for r, s in enumerate(states):
        assert np.array_equal(s["arrays"]["momentum_buffer"], vec(r % old))
    assert notes == [f"momentum_buffer: redistributed, new rank r takes old rank r % {old}'s"]


@pytest.mark.parametrize("old,new", [(2, 4), (4, 2), (3, 5), (4, 1)])
def test_topk_error_mean_keeps_the_update_the_residuals_still_owe(old, new):
    errors = [vec(10 + r) * (r + 1) for r in range(old)]
    momentum = vec(3)
    olds = [state("topk", r, {"error": errors[r], "momentum_buffer": momentum}) for r in range(old)]
    states, _ = resize_states("topk", olds, new, {})
    # The aggregate divides by the worker count: (1/M) sum_new e must equal (1/P) sum_old e.
    owed_before = np.sum([e.astype(np.float64) for e in errors], axis=0) / old
    owed_after = np.sum([s["arrays"]["error"].astype(np.float64) for s in states], axis=0) / new
    np.testing.assert_allclose(owed_after, owed_before, rtol=1e-6, atol=1e-7)
    for s in states:
        assert s["arrays"]["error"].dtype == np.float32
        assert np.array_equal(s["arrays"]["momentum_buffer"], momentum)


def test_regtopk_keeps_the_aggregate_and_resets_the_selection_history():
    aggregate = vec(7)
    olds = [
        state("regtopk", r, {
            "error": vec(r), "sent_indices": np.array([r, 3, 5], dtype=np.int32), "sent_values": vec(r)[:3],
            "aggregate": aggregate, "momentum_buffer": None,
        }, {"has_history": True})
        for r in range(2)
    ]
    states, notes = resize_states("regtopk", olds, 3, {})
    for s in states:
        a = s["arrays"]
        assert a["sent_indices"].dtype == np.int32 and not a["sent_indices"].any() and a["sent_indices"].shape == (3,)
        assert a["sent_values"].dtype == np.float32 and not a["sent_values"].any()
        assert s["scalars"]["has_history"] is False
        assert np.array_equal(a["aggregate"], aggregate) and a["momentum_buffer"] is None
        np.testing.assert_allclose(a["error"], (vec(0).astype(np.float64) + vec(1)) / 2, rtol=1e-6)
    assert [n.split(":")[0] for n in notes] == ["error", "has_history", "sent_indices", "sent_values"]
    assert "reset" in notes[1] and "reset" in notes[2]


def test_easgd_copies_the_centre_and_the_momentum_follows_the_parameters():
    center = vec(9)
    olds = [state("easgd", r, {"center": center, "momentum_buffer": vec(r)}) for r in range(4)]
    states, _ = resize_states("easgd", olds, 2, {})
    for r, s in enumerate(states):
        assert np.array_equal(s["arrays"]["center"], center)
        assert np.array_equal(s["arrays"]["momentum_buffer"], vec(r))


def test_lsgd_history_follows_the_parameters_and_the_leaders_are_forgotten():
    olds = [
        state("lsgd", r, {"momentum_buffer": vec(r), "leader_copy": vec(20 + r), "recent_losses": np.array([1.0 + r, 2.0])},
              {"losses_seen": 7 + r, "last_local_leader": 1, "last_global_leader": 1})
        for r in range(2)
    ]
    states, notes = resize_states("lsgd", olds, 4, {})
    for r, s in enumerate(states):
        assert np.array_equal(s["arrays"]["momentum_buffer"], vec(r % 2))
        assert np.array_equal(s["arrays"]["leader_copy"], vec(20 + r % 2))
        assert np.array_equal(s["arrays"]["recent_losses"], [1.0 + r % 2, 2.0])
        assert s["scalars"] == {"losses_seen": 7 + r % 2, "last_local_leader": -1, "last_global_leader": -1}
    assert any(n.startswith("last_global_leader: reset") for n in notes)


@pytest.mark.parametrize("old,new", [(2, 4), (4, 2)])
def test_dasgd_in_flight_sum_is_rescaled_so_the_merge_finds_the_old_average(old, new):
    snapshots = [vec(30 + r) for r in range(old)]
    total = np.sum(snapshots, axis=0, dtype=np.float32)  # what the Iallreduce delivered to every old rank
    olds = [state("dasgd", r, {"momentum_buffer": vec(r), "pending_snapshot": snapshots[r], "pending_sum": total},
                  {"merge_step": 6}) for r in range(old)]
    states, _ = resize_states("dasgd", olds, new, {})
    average = np.mean([s.astype(np.float64) for s in snapshots], axis=0)
    for r, s in enumerate(states):
        np.testing.assert_allclose(s["arrays"]["pending_sum"] / new, average, rtol=1e-5, atol=1e-6)  # what _merge divides by
        assert np.array_equal(s["arrays"]["pending_snapshot"], snapshots[r % old])
        assert s["scalars"]["merge_step"] == 6


def test_dasgd_without_a_pending_average_moves_only_the_momentum():
    olds = [state("dasgd", r, {"momentum_buffer": vec(r), "pending_snapshot": None, "pending_sum": None}, {"merge_step": 0}) for r in range(2)]
    states, notes = resize_states("dasgd", olds, 3, {})
    assert all(s["arrays"]["pending_sum"] is None and s["arrays"]["pending_snapshot"] is None for s in states)
    assert [n.split(":")[0] for n in notes] == ["momentum_buffer"]


def test_ranks_builds_only_the_states_asked_for():
    olds = [state("signum", r, {"momentum_buffer": vec(r)}) for r in range(2)]
    every, _ = resize_states("signum", olds, 4, {})
    (third,), _ = resize_states("signum", olds, 4, {}, ranks=[3])
    assert np.array_equal(third["arrays"]["momentum_buffer"], every[3]["arrays"]["momentum_buffer"])
    with pytest.raises(ValueError, match=r"ranks must lie in \[0, 4\), got \[4\]"):
        resize_states("signum", olds, 4, {}, ranks=[4])


@pytest.mark.parametrize("name", ["async_msgd", "async_lsgd"])
def test_asynchronous_algorithms_are_refused(name):
    with pytest.raises(ResizeError, match=f"'{name}' cannot resume on another number of ranks: the server's"):
        resize_states(name, [state(name, 0, {})], 2, {})


def test_states_that_do_not_fit_the_rule_are_refused():
    with pytest.raises(ResizeError, match=r"old rank 1's state is for algorithm 'sgd', not 'signum'"):
        resize_states("signum", [state("signum", 0, {"momentum_buffer": None}), state("sgd", 1, {"momentum_buffer": None})], 2, {})
    with pytest.raises(ResizeError, match=r"entries \['extra', 'momentum_buffer'\]; the resize rule knows \['momentum_buffer'\]"):
        resize_states("sgd", [state("sgd", 0, {"momentum_buffer": None, "extra": None})], 2, {})
    steps = [state("sgd", r, {"momentum_buffer": None}, steps=4 + r) for r in range(2)]
    with pytest.raises(ResizeError, match=r"different steps \[4, 5\]"):
        resize_states("sgd", steps, 3, {})
    with pytest.raises(ValueError, match="new_size must be an integer >= 1, got 0"):
        resize_states("sgd", steps[:1], 0, {})


def test_hyperparameters_must_match_except_easgd_s_pair_at_another_size():
    assert hyperparameter_differences("sgd", {"momentum": 0.9}, {"momentum": 0.9}, 2, 4) == []
    assert hyperparameter_differences("sgd", {"momentum": 0.9}, {"momentum": 0.5}, 2, 4) == ["momentum: saved 0.9, here 0.5"]
    # beta = N alpha: beta kept (the default way) or alpha kept both resume; neither does not.
    saved = {"alpha": 0.45, "beta": 0.9, "period": 4}
    assert hyperparameter_differences("easgd", saved, {"alpha": 0.225, "beta": 0.9, "period": 4}, 2, 4) == []
    assert hyperparameter_differences("easgd", saved, {"alpha": 0.45, "beta": 1.8, "period": 4}, 2, 4) == []
    assert hyperparameter_differences("easgd", saved, {"alpha": 0.2, "beta": 0.8, "period": 4}, 2, 4) == [
        "alpha: saved 0.45, here 0.2", "beta: saved 0.9, here 0.8",
    ]
    assert hyperparameter_differences("easgd", saved, {"alpha": 0.225, "beta": 0.9, "period": 4}, 2, 2) == ["alpha: saved 0.45, here 0.225"]
    assert hyperparameter_differences("easgd", saved, {"alpha": 0.225, "beta": 0.9, "period": 8}, 2, 4) == ["period: saved 4, here 8"]
    # A table (the inner optimizer's settings) is named by the entries that differ, not printed whole.
    optimizer = {"name": "adamw", "keywords": {"betas": "0.9,0.95"}, "clip_grad_norm": 0.5}
    changed = {"optimizer": {**optimizer, "keywords": {"betas": "0.9,0.99"}, "clip_grad_norm": 1.0}}
    assert hyperparameter_differences("sgd", {"optimizer": optimizer}, changed, 2, 2) == [
        "optimizer.clip_grad_norm: saved 0.5, here 1.0", "optimizer.keywords.betas: saved '0.9,0.95', here '0.9,0.99'",
    ]


# -- real states: moved by the rules, loaded by the algorithm -------------------------------------
SETTINGS = {
    "sgd": {"momentum": 0.9}, "signum": {}, "topk": {"k": 3, "momentum": 0.9}, "regtopk": {"k": 3},
    "easgd": {"period": 2}, "lsgd": {"period": 1, "global_period": 2, "proximal": 0.1}, "dasgd": {"period": 2, "delay_steps": 1},
    "diloco": {"period": 3, "momentum": 0.9},
    "streaming_diloco": {"period": 4, "fragments": 2, "overlap_steps": 1, "momentum": 0.9},
    "sparseloco": {"period": 3, "momentum": 0.9, "codec_chunk": 4, "codec_k": 1},
}


@pytest.fixture(scope="module")
def topology():
    topo = mpiopt.Topology(MPI.COMM_SELF)
    yield topo
    topo.world.Free()


# The strided layout gathers its fragments into the sum buffer: its pending sum is in fragment order.
STRIDED = {"streaming_diloco": {**SETTINGS["streaming_diloco"], "layout": "strided", "stride_blocks": 3}}


@pytest.mark.parametrize("name, settings", [(n, SETTINGS[n]) for n in SYNCHRONOUS] + list(STRIDED.items()),
                         ids=[*SYNCHRONOUS, "streaming_diloco-strided"])
def test_real_states_moved_by_the_rule_load_into_the_algorithm(topology, name, settings):
    """Two one-rank runs on different gradients stand for two old ranks; their states, resized to one rank, load."""
    def run(seed: int, steps: int = 4):
        alg = mpiopt.create(name, topology, lr=0.01, **settings)
        params = np.random.default_rng(0).standard_normal(D).astype(np.float32)
        alg.setup(params)
        for step in range(steps):
            alg.step(params, np.random.default_rng(seed * 100 + step).standard_normal(D).astype(np.float32), loss=1.0 + seed)
        return alg

    olds = [run(seed).state_dict() for seed in (1, 2)]
    fresh = run(3, steps=0)
    (moved,), _ = resize_states(name, olds, 1, fresh.hyperparameters(), ranks=[0])
    fresh.load_state_dict(moved)
    assert fresh.steps == 4
    if name == "dasgd":  # the averaging started after step 4 is in flight: its sum moved too
        assert moved["scalars"]["merge_step"] == 5 and moved["arrays"]["pending_sum"] is not None
    loaded = fresh.state_dict()
    for key, value in moved["arrays"].items():
        assert (value is None and loaded["arrays"][key] is None) or np.array_equal(loaded["arrays"][key], value), key
    assert loaded["scalars"] == moved["scalars"]
    fresh.finish(np.zeros(D, dtype=np.float32))


@pytest.mark.parametrize("name", ["sgd", "easgd", "dasgd", "diloco", "streaming_diloco", "sparseloco"])
@pytest.mark.parametrize("old,new", [(2, 4), (4, 2), (3, 5), (4, 1)])
def test_codec_residuals_move_as_their_mean_so_what_is_owed_is_kept(name, old, new):
    """Each exchange delivers the ranks' mean: the residuals owe (1/P) sum e, which each new rank taking the mean keeps."""
    cls = algorithm_class(name)
    residuals = [vec(40 + r) * (r + 1) for r in range(old)]
    arrays = {key: None for key in cls.state_arrays}
    scalars = {key: 0 for key in cls.state_scalars}
    if "merge_steps" in arrays:
        arrays["merge_steps"] = np.zeros(2, np.int64)
    olds = [state(name, r, {**arrays, "codec_residual": residuals[r]}, scalars) for r in range(old)]
    states, notes = resize_states(name, olds, new, {})
    owed = np.mean([e.astype(np.float64) for e in residuals], axis=0)
    for s in states:
        assert s["arrays"]["codec_residual"].dtype == np.float32
        np.testing.assert_allclose(s["arrays"]["codec_residual"], owed, rtol=1e-6, atol=1e-7)
    assert "codec_residual: redistributed, the mean over the old ranks on every new rank" in notes
    # A state saved before codecs existed has no residual: it moves as None.
    before = [state(name, r, {k: v for k, v in arrays.items() if k not in ("codec_residual", "last_average")}, scalars) for r in range(old)]
    assert all(s["arrays"]["codec_residual"] is None for s in resize_states(name, before, new, {})[0])
