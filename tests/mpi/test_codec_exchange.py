"""The ``codec`` hyperparameter of diloco, streaming_diloco, dasgd, easgd and sgd: ``codec="none"`` is today's
algorithm bit for bit, the plan's bytes are the ledger's for every codec, shared values stay the same on every
rank, a resume with error feedback in flight is bitwise, and bad settings are refused before any communication."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mpiopt
from mpiopt.bench.algorithms import expected_bytes
from mpiopt.codecs import CODECS

pytestmark = pytest.mark.mpi

D = 1001
ALGORITHMS = {
    "sgd": dict(lr=0.05, momentum=0.9),
    "easgd": dict(lr=0.05, period=3, momentum=0.9),
    "dasgd": dict(lr=0.05, period=4, delay_steps=2),
    "diloco": dict(lr=0.05, period=3, momentum=0.9),
    "streaming_diloco": dict(lr=0.05, period=4, fragments=2, overlap_steps=1),
}
SPARSELOCO = dict(lr=0.05, period=3, momentum=0.9)
# Small chunks, so that d = 1001 makes many of them and a ragged last one.
CODEC_SETTINGS = {name: ({"codec_chunk": 64} if "chunk" in CODECS[name].defaults else {}) for name in CODECS if name != "none"}
CODEC_SETTINGS["topk"] = {"codec_chunk": 64, "codec_k": 5, "codec_bits": 3}
# sha256 (first 16 hex digits) of each rank's parameters after 10 steps at 2 ranks, d = 257, from the code before
# codecs existed (commit f8936d4): codec="none" must give these bits.
TODAY = {
    "sgd": ["d7fcae776c35263a", "c93a76730eddd5fa"], "easgd": ["ee8128f52b3446fa", "e301071471f14e94"],
    "dasgd": ["ebb550b0d667b8ff", "ccc15157108dc0f0"], "diloco": ["4b05d11b910210ed", "38750ce97eae642e"],
    "streaming_diloco": ["02f6b5abcdb5d602", "129ad602c5566ed5"],
}


def _run(topology, name, hyper, d, steps, seed=2, same_start=False):
    params = np.random.default_rng([1, 0 if same_start else topology.rank]).standard_normal(d).astype(np.float32)
    alg = mpiopt.create(name, topology, **hyper)
    alg.setup(params)
    for step in range(steps):
        alg.step(params, np.random.default_rng([seed, step, topology.rank]).standard_normal(d).astype(np.float32))
    return alg, params


@pytest.mark.parametrize("name", ALGORITHMS)
def test_codec_none_is_today_s_algorithm_bitwise(topology, name):
    if topology.size != 2:
        pytest.skip("the recorded bits are of 2 ranks")
    alg, params = _run(topology, name, {**ALGORITHMS[name], "codec": "none"}, 257, 10)
    alg.finish(params)
    digest = hashlib.sha256(params.tobytes()).hexdigest()[:16]
    assert digest == TODAY[name][topology.rank]
    assert not any("gather" in op for op in alg.ledger), list(alg.ledger)  # today's Allreduce, nothing else
    assert "codec" not in alg.hyperparameters() and alg.state_dict()["arrays"]["codec_residual"] is None


@pytest.mark.parametrize("codec", CODEC_SETTINGS)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_plan_bytes_equal_the_ledger_for_every_codec(name, codec):
    topology = mpiopt.Topology()
    try:
        P, start, steps = topology.size, 4, 9
        hyper = {**ALGORITHMS[name], "codec": codec, **CODEC_SETTINGS[codec]}
        params = np.random.default_rng([3, topology.rank]).standard_normal(D).astype(np.float32)
        alg = mpiopt.create(name, topology, **hyper)
        alg.setup(params)
        for step in range(1, start + steps):
            if step == start:
                before = topology.ledger.snapshot()
            alg.step(params, np.random.default_rng([4, step, topology.rank]).standard_normal(D).astype(np.float32))
        delta = topology.ledger.since(before)
        alg.finish(params)
        assert all("Allreduce" not in op for op in delta), list(delta)  # the codec's Allgather replaced it
        sent, recv = topology.world.allreduce_obj(np.array([delta.bytes_sent, delta.bytes_recv]))
        expected = expected_bytes(name, D, P, hyper, steps=steps, start=start)
        assert expected["sent"] * P * steps == pytest.approx(sent, rel=1e-12, abs=1e-9)
        assert expected["recv"] * P * steps == pytest.approx(recv, rel=1e-12, abs=1e-9)
        if P > 1:  # Allgather: each rank sends its payload once and receives the P - 1 others
            assert delta.bytes_recv == (P - 1) * delta.bytes_sent
            if name != "streaming_diloco":  # one payload of d entries per exchange
                calls = delta[f"world.{'Iallgather' if name == 'dasgd' else 'Allgather'}"].calls
                codec_object = CODECS[codec](**{k[6:]: v for k, v in CODEC_SETTINGS[codec].items()})
                assert calls > 0 and delta.bytes_sent == calls * codec_object.payload_nbytes(D)
    finally:
        topology.Free()


SHARED = {"diloco": "theta_start", "streaming_diloco": "theta_start", "easgd": "center", "dasgd": "last_average"}


@pytest.mark.parametrize("codec", ["int8", "topk"])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_what_was_the_same_on_every_rank_stays_so(topology, name, codec):
    alg, params = _run(topology, name, {**ALGORITHMS[name], "codec": codec, **CODEC_SETTINGS[codec]}, D, 9, same_start=True)
    alg.finish(params)
    shared = params if name in ("sgd", "diloco") else getattr(alg, SHARED[name])
    everyone = topology.world.allgather_obj(hashlib.sha256(np.ascontiguousarray(shared).tobytes()).hexdigest())
    assert len(set(everyone)) == 1
    residual = alg.codec_residual
    assert residual is not None and residual.any() and np.isfinite(residual).all()


def _resume_bitwise(topology, name, hyper, split, steps, through=None):
    """Run ``steps`` steps, saving the state after ``split``; a fresh instance given that state (through ``through``,
    e.g. an HDF5 file) and this rank's parameters must end bitwise where the first did, state and all."""
    rng = np.random.default_rng([17, topology.rank])
    params = rng.standard_normal(D).astype(np.float32)
    grads = rng.standard_normal((steps, D)).astype(np.float32)
    alg = mpiopt.create(name, topology, **hyper)
    alg.setup(params)
    for t in range(split):
        alg.step(params, grads[t])
    state, saved = alg.state_dict(), params.copy()
    for t in range(split, steps):
        alg.step(params, grads[t])
    alg.finish(params)
    fresh = mpiopt.create(name, topology, **hyper)
    resumed = saved.copy()
    fresh.setup(resumed)
    resumed[...] = saved  # setup's common start (diloco's mean) is not where this rank was
    fresh.load_state_dict(state if through is None else through(state))
    for t in range(split, steps):
        fresh.step(resumed, grads[t])
    fresh.finish(resumed)
    assert np.array_equal(params, resumed), "parameters differ after the resume"
    final, again = alg.state_dict(), fresh.state_dict()
    for key in alg.state_arrays:
        a, b = final["arrays"][key], again["arrays"][key]
        assert (a is None and b is None) or np.array_equal(a, b), key
    assert final["scalars"] == again["scalars"]
    return state


RESUMES = [
    ("diloco", "topk", 4, 9),  # the residual of the outer step after step 3 is carried over the save after step 4
    ("streaming_diloco", "fp4", 6, 11),  # fragment 1's exchange, started after step 6, merges after step 7
    ("dasgd", "int4", 5, 10),  # the averaging started after step 4 merges after step 6
    ("easgd", "sign", 4, 9),
    ("sgd", "bf16", 3, 7),
    ("sparseloco", "topk", 4, 9),
    ("sparseloco", "int8", 7, 10),
]


def _through_a_checkpoint(topology):
    """``state`` written to and read back from an HDF5 checkpoint in a directory every rank sees."""
    from mpiopt.checkpoint import first_difference, load_checkpoint, save_checkpoint

    def through(state):
        path = os.path.join(directory, "state.h5")
        save_checkpoint(path, topology.world, model=None, rank_state={"algorithm": state}, attrs={})
        loaded = load_checkpoint(path, topology.world).rank_state["algorithm"]
        assert first_difference(state, loaded) is None
        return loaded

    directory = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="mpiopt-codec-") if topology.rank == 0 else None)
    return through, directory


@pytest.mark.parametrize("file", [False, True], ids=["state_dict", "hdf5"])
@pytest.mark.parametrize("name, codec, split, steps", RESUMES, ids=lambda v: str(v))
def test_resume_with_error_feedback_in_flight_is_bitwise(topology, name, codec, split, steps, file):
    hyper = {**ALGORITHMS.get(name, SPARSELOCO), "codec": codec, **CODEC_SETTINGS[codec]}
    through, directory = _through_a_checkpoint(topology) if file else (None, None)
    try:
        state = _resume_bitwise(topology, name, hyper, split, steps, through)
    finally:
        MPI.COMM_WORLD.Barrier()
        if directory and topology.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    residual = state["arrays"]["codec_residual"]
    assert residual is not None and residual.any()  # error feedback was in flight at the save
    if name == "dasgd":
        assert state["scalars"]["merge_step"] == 6 and state["arrays"]["pending_sum"] is not None
    if name == "streaming_diloco":
        assert state["arrays"]["merge_steps"].any() and state["arrays"]["pending_sum"] is not None


def test_the_saved_residual_is_the_one_in_flight(topology):
    """The residual a state carries is the live one after the outer step (not zeros), and loading restores it."""
    hyper = {**ALGORITHMS["diloco"], "codec": "topk", **CODEC_SETTINGS["topk"]}
    alg, params = _run(topology, "diloco", hyper, D, 4)
    state = alg.state_dict()
    assert state["arrays"]["codec_residual"].any()
    assert state["hyperparameters"] == {**state["hyperparameters"], "codec": "topk", "codec_k": 5, "codec_bits": 3, "codec_chunk": 64,
                                        "codec_feedback": True, "codec_beta": 1.0}
    fresh = mpiopt.create("diloco", topology, **hyper)
    fresh.setup(params.copy())
    fresh.load_state_dict(state)
    assert np.array_equal(fresh.codec_residual, alg.codec_residual)
    other = mpiopt.create("diloco", topology, **{**hyper, "codec_k": 6})
    other.setup(params.copy())
    with pytest.raises(ValueError, match="hyperparameter codec_k: saved 5, here 6"):
        other.load_state_dict(state)


BAD = [
    (dict(codec="zip"), r"codec must be one of 'none', 'bf16', 'int8', 'int4', 'fp4', 'sign', 'topk'; got 'zip'"),
    (dict(codec="topk", codec_k=5000), r"codec 'topk': codec_k must be >= 1 and <= 4096, got 5000"),
    (dict(codec="topk", codec_bits=9), r"codec_bits must be >= 1 and <= 8, got 9"),
    (dict(codec="int8", codec_k=8), r"codec_k=8 does nothing: codec='int8' takes codec_chunk"),
    (dict(codec="none", codec_chunk=32), r"codec_chunk=32 does nothing: codec='none' takes no parameters"),
    (dict(codec="int4", codec_feedback=False, codec_beta=0.9), r"codec_beta=0.9 does nothing"),
    (dict(codec="int8", codec_beta=1.5), r"codec_beta must be in \[0.0, 1.0\], got 1.5"),
]


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("settings, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_codec_is_refused_on_every_rank_before_any_communication(topology, name, settings, message):
    with pytest.raises(ValueError, match=message) as caught:
        mpiopt.create(name, topology, **ALGORITHMS[name], **settings)
    assert topology.ledger.total().calls == 0  # refused in the constructor: nothing was sent
    assert len(set(MPI.COMM_WORLD.allgather(str(caught.value)))) == 1


def test_torch_state_dict_keeps_the_residual_and_torch_load_reads_it(topology):
    """DistributedOptimizer.state_dict() with sparseloco and AdamW: the accumulator is a CPU tensor that
    ``torch.load``'s default reads, and a fresh optimizer given it continues bitwise."""
    torch = pytest.importorskip("torch")
    import io

    from mpiopt.torch import DistributedOptimizer

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(40, 30)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, DistributedOptimizer(model.parameters(), "sparseloco", topology=topology, inner=inner, period=2,
                                           codec_chunk=64, codec_k=6)

    def steps(model, opt, first, last):
        for t in range(first, last):
            x = torch.randn(8, 40, generator=torch.Generator().manual_seed(100 * topology.rank + t))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    model, opt = make()
    steps(model, opt, 0, 3)  # an outer step after step 2, a local step after it
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    steps(model, opt, 3, 7)
    buffer.seek(0)
    saved = torch.load(buffer)  # the default: weights_only where torch has it
    residual = saved["opt"]["mpiopt"]["algorithm"]["arrays"]["codec_residual"]
    fresh_model, fresh = make()
    fresh_model.load_state_dict(saved["model"])
    fresh.load_state_dict(saved["opt"])
    steps(fresh_model, fresh, 3, 7)
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)
    assert isinstance(residual, torch.Tensor) and residual.abs().sum() > 0


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_state_saved_before_codecs_existed_still_loads(topology, name):
    alg, params = _run(topology, name, ALGORITHMS[name], D, 5)
    state = alg.state_dict()
    old = {**state, "arrays": {k: v for k, v in state["arrays"].items() if k not in ("codec_residual", "last_average")}}
    fresh = mpiopt.create(name, topology, **ALGORITHMS[name])
    fresh.setup(params.copy())
    fresh.load_state_dict(old)
    assert fresh.steps == 5 and fresh.codec_residual is None
    alg.finish(params)
    fresh.finish(params.copy())
