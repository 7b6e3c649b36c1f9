"""Benchmark: each algorithm's own time per step at one rank, in units of torch.optim.SGD(fused=True)'s step.

``python -m mpiopt.bench.update [--d 11M] [--rounds 5] [--steps 16] [--algorithms sgd,topk] [--threads N] [--device cuda] [--json FILE]
[--profile FILE]`` (one process; plain ``python`` is one MPI rank).

Beside the algorithms: fused and foreach torch SGD, the local update through the C loop and the array code,
and ``np.copyto``.  Goals (issue 11): ``sgd`` <= 1.2, ``easgd``/``lsgd``/``dasgd`` <= 1.5, ``signum`` <= 2,
``topk`` <= 2.5, ``regtopk`` <= 3 (the CPU's; on ``--device cuda`` a measurement only).
Method: docs/internals-bench.md; results: docs/benchmarks-update.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..algorithms import algorithm_class, create
from ..arrays import array_module
from ..algorithms.local import LocalSGD
from ..comm import Topology
from ..kernels import threads
from ..kernels import update as update_kernels
from ..training.config import TrainConfig, UsageError
from ._common import check_choices, comma_list, count, environment, markdown_table, median, module_main, positive_int, rotated, write_json
from .algorithms import synchronous
from .profile import markdown as profile_markdown
from .profile import profile as profile_variants

__all__ = ["add_arguments", "measure", "run", "main"]

MOMENTUM = 0.9
UNIT = "torch.optim.SGD(fused=True)"
DEVICES = ("cpu", "cuda")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algorithms", type=comma_list(str), default=None, metavar="A,B,...", help="synchronous algorithms to time (default: all)")
    parser.add_argument("--d", type=count, default=11_000_000, help="parameters (suffixes k, M, G)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds")
    parser.add_argument(
        "--steps", type=positive_int, default=16,
        help="timed consecutive steps of every variant per round (their mean is the round's sample; 16 covers every default period)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random gradients")
    parser.add_argument(
        "--threads", type=positive_int, default=None,
        help="threads of torch and of mpiopt's C kernels alike (default: torch's own choice of intra-op threads)",
    )
    parser.add_argument(
        "--device", choices=DEVICES, default="cpu",
        help="where the vectors live: cpu (numpy, torch CPU tensors) or cuda (cupy arrays, torch CUDA tensors of the current GPU)",
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results to FILE")
    parser.add_argument(
        "--profile", default=None, metavar="FILE",
        help="--device cuda: then run every variant's steps under torch.profiler and write, as Markdown to FILE, each one's "
        "device time, kernels and host waits a step and its costliest kernels",
    )


def _algorithm(topology: Topology, name: str, grads: Sequence[Any], sync: Optional[Callable[[], None]]) -> Callable[[], float]:
    """One step of ``name`` on its own vector; returns the step's ``algo_seconds`` (with ``sync``: its synchronized wall time)."""
    hyper = TrainConfig().algorithm_hyperparameters(name)
    if "momentum" in (algorithm_class(name).__init__.__kwdefaults__ or {}):
        hyper["momentum"] = MOMENTUM
    alg = create(name, topology, **hyper)
    params = array_module(grads[0]).zeros_like(grads[0])
    alg.setup(params)
    steps = [0]

    def step() -> float:
        steps[0] += 1
        return alg.step(params, grads[steps[0] % len(grads)], loss=1.0 + 1.0 / steps[0]).algo_seconds

    return step if sync is None else _timed(step, sync)


def _timed(fn: Callable[[], object], sync: Optional[Callable[[], None]] = None) -> Callable[[], float]:
    """``fn`` timed from its call to its return, or with ``sync`` to the end of ``sync()`` (the device's work done)."""

    def step() -> float:
        started = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        return time.perf_counter() - started

    return step


def _torch_sgd(grad: Any, sync: Optional[Callable[[], None]], **flags: bool) -> Callable[[], float]:
    import torch

    param = torch.zeros_like(torch.from_dlpack(grad), requires_grad=True)  # on the gradient's device
    param.grad = torch.from_dlpack(grad)
    opt = torch.optim.SGD([param], lr=0.05, momentum=MOMENTUM, **flags)
    return _timed(opt.step, sync)


@contextlib.contextmanager
def _fused_loops(enabled: bool) -> Iterator[None]:
    """As where neither ``mpiopt.kernels._updatec`` nor the CUDA kernels exist, unless ``enabled``."""
    saved = update_kernels._updatec, update_kernels._cuda.takes
    if not enabled:
        update_kernels._updatec, update_kernels._cuda.takes = None, lambda x: False
    try:
        yield
    finally:
        update_kernels._updatec, update_kernels._cuda.takes = saved


def _local_update(grad: Any, fused: bool, sync: Optional[Callable[[], None]]) -> Callable[[], float]:
    """LocalSGD.apply alone, through the fused loop or (``fused=False``) the array code."""
    params = array_module(grad).zeros_like(grad)
    local = LocalSGD(momentum=MOMENTUM)
    with _fused_loops(fused):
        local.allocate(params)

    def apply() -> None:
        with _fused_loops(fused):
            local.apply(params, grad, 0.05)

    return _timed(apply, sync)


def measure(
    d: int = 11_000_000,
    rounds: int = 5,
    steps: int = 16,
    algorithms: Optional[Sequence[str]] = None,
    seed: int = 0,
    topology: Optional[Topology] = None,
    device: str = "cpu",
    profile: bool = False,
) -> Dict[str, Any]:
    """Time every variant; the results as a dict (what :func:`run` prints and writes as JSON).

    ``device``: ``"cpu"`` (numpy, CPU tensors) or ``"cuda"`` (cupy, CUDA tensors).  ``profile`` (cuda only): then
    ``steps`` more steps of each variant under the profiler, in ``"profile"`` (:func:`mpiopt.bench.profile.profile`).
    ``UsageError`` for an algorithm that is not synchronous, a topology of more than one rank, or a CPU profile.
    """
    import torch

    algorithms = list(algorithms or synchronous())
    check_choices("--algorithms", algorithms, synchronous())
    check_choices("--device", [device], DEVICES)
    if profile and device != "cuda":
        raise UsageError(f"--profile needs --device cuda: on the CPU the profiler sees torch's ops, not numpy's or the C loops' (got --device {device})")
    xp, sync = np, None
    if device == "cuda":
        import cupy

        xp, sync = cupy, cupy.cuda.Device().synchronize
    own = topology is None
    topology = Topology() if own else topology
    if topology.size != 1:
        raise UsageError(f"the update benchmark times one rank; run it without mpiexec (got {topology.size} ranks)")
    rng = np.random.default_rng(seed)
    grads = [xp.asarray(rng.standard_normal(d, dtype=np.float32) * 1e-2) for _ in range(2)]
    copy_out = xp.empty_like(grads[0])
    fused = "LocalSGD.apply (C loop)" if device == "cpu" else "LocalSGD.apply (CUDA kernel)"
    variants: Dict[str, Callable[[], float]] = {
        UNIT: _torch_sgd(grads[0], sync, fused=True),
        "torch.optim.SGD(foreach=True)": _torch_sgd(grads[0], sync, foreach=True),
        fused: _local_update(grads[0], True, sync),
        "LocalSGD.apply (array code)": _local_update(grads[0], False, sync),
        f"{xp.__name__}.copyto (one read + write)": _timed(lambda: xp.copyto(copy_out, grads[0]), sync),
    }
    variants.update({name: _algorithm(topology, name, grads, sync) for name in algorithms})
    if not update_kernels.fused_update_available(grads[0]):
        del variants[fused]  # it would time the array code twice
    samples: Dict[str, List[float]] = {name: [] for name in variants}  # per round: the mean step
    for name, step in variants.items():  # untimed: allocations and first steps
        step()
        step()
    for round_ in range(rounds):
        for name in rotated(list(variants), round_):
            variants[name]()  # untimed: it would pay for the previous variant's dirty cache lines and spinning threads
            samples[name].append(sum(variants[name]() for _ in range(steps)) / steps)
    profiled = profile_variants(variants, steps) if profile else None
    if own:
        topology.Free()
    seconds = {name: median(values) for name, values in samples.items()}
    goals = {name: algorithm_class(name).update_goal for name in algorithms if algorithm_class(name).update_goal is not None}
    ratio = {name: value / seconds[UNIT] for name, value in seconds.items()}
    return {
        "d": d,
        "rounds": rounds,
        "steps": steps,
        "unit": UNIT,
        "threads": torch.get_num_threads(),
        "kernel_threads": threads.get_num_threads(),
        "c_update_loop": update_kernels._updatec is not None,
        "device": device,
        "seconds": seconds,
        "ratio": ratio,
        "goals": {name: {"goal": goal, "ratio": ratio[name], "met": ratio[name] <= goal} for name, goal in goals.items()},
        "samples": {name: steps * len(values) for name, values in samples.items()},
        **({"profile": profiled} if profiled is not None else {}),
    }


def table(results: Dict[str, Any]) -> str:
    """The Markdown table of :func:`measure`'s results."""
    rows = []
    for name, seconds in results["seconds"].items():
        goal = results["goals"].get(name)
        verdict = f"<= {goal['goal']:g}: {'met' if goal['met'] else 'MISSED'}" if goal else ("unit" if name == UNIT else "-")
        rows.append([name, f"{1e3 * seconds:.2f}", f"{results['ratio'][name]:.2f}", verdict])
    return markdown_table(["variant", "ms/step", f"x {UNIT}", "goal"], rows, align="lrrl")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table (and write the JSON); returns 0 (missed goals are reported, not failed)."""
    from ..torch.threads import set_threads

    set_threads(args.threads)
    topology = Topology()
    results = measure(args.d, args.rounds, args.steps, args.algorithms, args.seed, topology, args.device, args.profile is not None)
    if args.device == "cpu":
        where = ""
        host = (
            f"; torch's OpenMP wait policy {os.environ.get('OMP_WAIT_POLICY', 'default')}; {results['threads']} thread(s) for torch "
            f"and the C kernels; fused C update loop {'built' if results['c_update_loop'] else 'NOT built'}"
        )
    else:
        where, host = f" on the GPU ({_gpu_name()}; each step timed to a device sync)", ""
    print(
        f"\n## update: one rank{where}, d = {args.d:,} float32, momentum {MOMENTUM}; median over {args.rounds} interleaved rounds of the mean of "
        f"{args.steps} steps{host}\n",
        flush=True,
    )
    print(table(results))
    if args.profile:
        os.makedirs(os.path.dirname(args.profile) or ".", exist_ok=True)
        with open(args.profile, "w", encoding="utf-8") as f:
            f.write(f"# Profile: update, d = {args.d:,}, {args.steps} steps a variant ({_gpu_name()})\n\n{profile_markdown(results['profile'])}")
        print(f"\nwrote the profile to {args.profile}", file=sys.stderr)
    if args.json:
        write_json(args.json, {"benchmark": "update", **environment(topology, None), **results})
        print(f"\nwrote {args.json}", file=sys.stderr)
    topology.Free()
    return 0


def _gpu_name() -> str:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("update", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
