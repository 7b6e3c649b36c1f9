"""HDF5 checkpoints across ranks: each rank's own state back exactly, every algorithm's state through a file
and on to a bitwise resume, collective errors (a failed write on rank 0, bad input on one rank, another world
size, a truncated file) raised alike on every rank without a hang."""

from __future__ import annotations

import os
import re

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import mpiopt
import mpiopt.checkpoint.writers as writers_module
from mpiopt.algorithms.registry import algorithm_class
from mpiopt.checkpoint import CheckpointError, checkpoint_path, first_difference, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.mpi


def everyone(value):
    return MPI.COMM_WORLD.allgather(value)


def raised_alike(call, *args, **kwargs) -> str:
    """Call ``call``: it must raise a CheckpointError with the same message on every rank; that message."""
    with pytest.raises(CheckpointError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert set(everyone(message)) == {message}
    return message


def rank_state(rank: int, seed: int = 0) -> dict:
    """A state that differs per rank in values, sizes and kinds."""
    rng = np.random.default_rng([seed, rank])
    return {
        "params": rng.standard_normal(100 + 37 * rank).astype(np.float32),
        "algorithm": {"steps": 10 * rank, "arrays": {"buffer": rng.standard_normal((rank + 1, 3)), "none": None}},
        "rng": {"numpy": rng.bit_generator.state, "torch": rng.integers(0, 256, 5056, dtype=np.uint8)},
        "empty": np.zeros((0, rank), np.int32),
        "scalar": np.array(rank, np.int64),
        "blob": bytes(range(rank * 3)),
        "name": f"rank {rank}",
    }


def test_each_rank_gets_its_own_state_back_exactly(topology, shared_dir):
    world, rank = topology.world, topology.rank
    mine = rank_state(rank)
    model = {"layer.0.weight": np.full((4, 3), 1.5, np.float32), "layer.0.bias": np.zeros(4, np.float32)}
    path = checkpoint_path(shared_dir, 12)
    # The model of the other ranks is ignored: only rank 0's is written.
    given = model if rank == 0 else {"wrong": np.zeros(1)}
    assert save_checkpoint(path, world, model=given, rank_state=mine, attrs={"step": 12}) == path
    loaded = load_checkpoint(path, world)
    assert first_difference(mine, loaded.rank_state) is None
    assert first_difference(model, loaded.model, "model") is None
    assert loaded.world_size == topology.size and loaded.attrs["step"] == 12
    if rank == 0:  # the file itself, read independently: every rank's arrays under /ranks/<r>
        with h5py.File(path, "r") as f:
            assert sorted(f["ranks"], key=int) == [str(r) for r in range(topology.size)]
            for r in range(topology.size):
                assert np.array_equal(f[f"ranks/{r}/params"][()], rank_state(r)["params"])
                assert f[f"ranks/{r}"].attrs["name"] == f"rank {r}"
    # The hand-over left no message behind: the next collective checkpoint works.
    save_checkpoint(path, world, model=None, rank_state={"again": np.arange(rank + 1)}, attrs={})
    assert np.array_equal(load_checkpoint(path, world).rank_state["again"], np.arange(rank + 1))


# case: (algorithm, emulated group size or None, hyperparameters, steps before the save, steps in all)
CASES = {
    "sgd": ("sgd", None, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4), 4, 9),
    "easgd": ("easgd", None, dict(lr=0.05, beta=0.5, period=3, momentum=0.99, nesterov=True), 4, 9),
    # Local and global leaders in groups of two ranks; the proximal pull makes the leader copy state.
    "lsgd": ("lsgd", 2, dict(lr=0.05, period=2, global_period=4, loss_window=3, proximal=0.05), 5, 11),
    # The averaging started after step 4 is in flight (merged after step 7) when the state is saved after step 5.
    "dasgd": ("dasgd", None, dict(lr=0.05, period=4, delay_steps=3), 5, 10),
    **{
        f"signum-{mode}": ("signum", 2 if mode == "prevote" else None, dict(lr=1e-3, momentum=0.9, weight_decay=1e-4, exchange=mode), 5, 10)
        for mode in ("allgather", "twophase", "prevote", "auto")
    },
    "topk": ("topk", None, dict(lr=0.05, density=0.3, momentum=0.9), 5, 10),
    "regtopk": ("regtopk", None, dict(lr=0.05, density=0.3, mu=3.0, momentum=0.9), 5, 10),
}


@pytest.mark.parametrize("case", CASES)
def test_algorithm_state_through_a_checkpoint_resumes_bitwise(bitwise_resume, shared_dir, monkeypatch, case):
    """The saved ``state_dict`` reaches the fresh instance only through an HDF5 file, and the run continues bitwise."""
    name, group_size, hyper, split, steps = CASES[case]
    topo = mpiopt.Topology(group_size=group_size)
    world, rank = topo.world, topo.rank
    through_file = []
    cls = algorithm_class(name)
    original = cls.load_state_dict

    def load_via_checkpoint(self, state):
        path = os.path.join(shared_dir, "state.h5")
        save_checkpoint(path, world, model=None, rank_state={"algorithm": state}, attrs={"algorithm": name})
        loaded = load_checkpoint(path, world).rank_state["algorithm"]
        through_file.append((state, loaded))
        original(self, loaded)

    monkeypatch.setattr(cls, "load_state_dict", load_via_checkpoint)
    rng = np.random.default_rng([17, rank])
    params0 = rng.standard_normal(300).astype(np.float32)
    grads = rng.standard_normal((steps, 300)).astype(np.float32)
    losses = rng.uniform(size=steps) if name == "lsgd" else None
    alg, fresh = bitwise_resume(topo, name, hyper, params0, grads, split, losses)
    topo.Free()

    (saved, loaded), = through_file
    assert first_difference(saved, loaded) is None
    assert saved["steps"] == split and fresh.steps == alg.steps == steps
    if name == "dasgd":
        assert saved["scalars"]["merge_step"] == 7 and saved["arrays"]["pending_sum"] is not None
    if name == "lsgd":
        assert saved["arrays"]["leader_copy"] is not None and saved["scalars"]["last_local_leader"] >= 0


def test_a_failed_write_on_rank_0_is_the_same_error_everywhere(topology, shared_dir, monkeypatch):
    monkeypatch.setenv("MPIOPT_CHECKPOINT_DRIVER", "serial")  # the writer where rank 0 alone writes
    world, rank = topology.world, topology.rank
    path = checkpoint_path(shared_dir, 5)
    save_checkpoint(path, world, model=None, rank_state={"v": np.full(10, rank)}, attrs={"step": 5})
    if rank == 0:
        before = open(path, "rb").read()
        # The disk fills up while the last rank's arrays are written (rank 0's own at one rank).
        real = writers_module.write_entry

        def full_disk(root, entry, array):
            if root.name == f"/ranks/{topology.size - 1}" and entry.kind == "dataset":
                raise OSError(28, "No space left on device")
            real(root, entry, array)

        monkeypatch.setattr(writers_module, "write_entry", full_disk)
    message = raised_alike(save_checkpoint, path, world, model=None, rank_state={"v": np.zeros(10), "w": np.ones(3)}, attrs={"step": 6})
    assert message.startswith(f"cannot save checkpoint {path}: writing on rank 0 failed: OSError") and "No space left on device" in message
    monkeypatch.undo()
    if rank == 0:
        assert open(path, "rb").read() == before and os.listdir(shared_dir) == [os.path.basename(path)]
    loaded = load_checkpoint(path, world)
    assert loaded.attrs["step"] == 5 and np.array_equal(loaded.rank_state["v"], np.full(10, rank))
    # No message of the abandoned hand-over is left behind: the next checkpoint is whole.
    save_checkpoint(path, world, model=None, rank_state={"v": np.arange(rank + 2)}, attrs={"step": 6})
    assert np.array_equal(load_checkpoint(path, world).rank_state["v"], np.arange(rank + 2))


def test_a_directory_rank_0_cannot_create_stops_every_rank(topology, shared_dir, monkeypatch):
    monkeypatch.setenv("MPIOPT_CHECKPOINT_DRIVER", "serial")  # the writer where rank 0 alone writes
    if topology.rank == 0:
        with open(os.path.join(shared_dir, "file"), "w") as f:
            f.write("not a directory")
    topology.world.Barrier()
    path = checkpoint_path(os.path.join(shared_dir, "file"), 1)
    message = raised_alike(save_checkpoint, path, topology.world, model=None, rank_state={"x": np.ones(100)}, attrs={})
    assert message.startswith(f"cannot save checkpoint {path}: writing on rank 0 failed: ")


def test_bad_state_on_the_last_rank_is_the_same_error_everywhere(topology, shared_dir):
    last = topology.size - 1
    state = {"ok": np.ones(3), "nested": {"pair": (1, 2)}} if topology.rank == last else {"ok": np.ones(3)}
    path = checkpoint_path(shared_dir, 1)
    message = raised_alike(save_checkpoint, path, topology.world, model=None, rank_state=state, attrs={})
    which = "" if topology.size == 1 else f"\n  rank {last}:"  # with several ranks, the one at fault is named
    assert message.startswith(f"cannot save checkpoint {path}:{which} rank_state['nested']['pair']: cannot store a tuple")
    assert not os.path.exists(path)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_on_the_path_are_refused(topology, shared_dir):
    path = checkpoint_path(shared_dir, 10 + topology.rank % 2)
    message = raised_alike(save_checkpoint, path, topology.world, model=None, rank_state={}, attrs={})
    assert re.match("ranks disagree on the checkpoint to save: rank 0: .*ckpt-000000010.h5', rank 1: .*ckpt-000000011.h5'", message)
    assert os.listdir(shared_dir) == []


@pytest.mark.mpi(min_size=2)
def test_another_world_size_is_refused_on_every_rank(topology, shared_dir):
    world, rank, size = topology.world, topology.rank, topology.size
    alone = mpiopt.Comm(MPI.COMM_SELF, name="self")
    one_rank = checkpoint_path(shared_dir, 1)
    if rank == 0:  # a checkpoint written by a one-rank job
        save_checkpoint(one_rank, alone, model=None, rank_state={"x": np.arange(4)}, attrs={})
    world.Barrier()
    message = raised_alike(load_checkpoint, one_rank, world)
    assert message.startswith(f"cannot load checkpoint {one_rank}: written by 1 rank; this job has {size}")
    loaded = load_checkpoint(one_rank, world, allow_world_size_change=True)
    assert (loaded.rank_state is None) == (rank > 0) and loaded.world_size == 1
    if rank == 0:
        assert np.array_equal(loaded.rank_state["x"], np.arange(4))
    # Every rank gets every saved rank's state, to redistribute it.
    assert len(loaded.rank_states) == 1 and np.array_equal(loaded.rank_states[0]["x"], np.arange(4))

    many = checkpoint_path(shared_dir, 2)  # and the other way round: written by all ranks, read by one
    save_checkpoint(many, world, model=None, rank_state={"r": rank}, attrs={})
    with pytest.raises(CheckpointError, match=f"written by {size} ranks; this job has 1"):
        load_checkpoint(many, alone)
    shrunk = load_checkpoint(many, alone, allow_world_size_change=True)
    assert shrunk.rank_state == {"r": 0} and shrunk.rank_states == [{"r": r} for r in range(size)]  # rank 0 of the one-rank job
    assert load_checkpoint(many, world, allow_world_size_change=True).rank_states is None  # the saved size: own state only
    alone.Free()


def test_a_truncated_file_is_the_same_error_everywhere(topology, shared_dir):
    world = topology.world
    path = checkpoint_path(shared_dir, 3)
    save_checkpoint(path, world, model=None, rank_state=rank_state(world.rank), attrs={})
    if world.rank == 0:
        data = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(data[: len(data) * 2 // 3])
    world.Barrier()
    message = raised_alike(load_checkpoint, path, world)
    assert message.startswith(f"cannot load checkpoint {path}: not a readable HDF5 file")
