"""Benchmark: what the torch front end adds to an ``sgd`` step over the flat API.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpiopt.bench.torch_overhead

Variants ``flat`` (``alg.step`` on numpy) and ``torch`` (``DistributedOptimizer.step()`` over ResNet-18's
shapes); ``--inner adamw`` compares fused AdamW alone with it as the inner optimizer.  The figure is the median
per-round ratio torch / flat.  Method: docs/internals-bench.md; results: docs/benchmarks-torch.md.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..algorithms import create
from ..comm import abort_on_exception
from ..comm.process import host
from mpiopt.bench._common import count, markdown_table, median, module_main, positive_int, rotated, say, slowest_seconds
from mpiopt.comm import Topology

if TYPE_CHECKING:
    import torch

#: The 5 % goal of the torch front end's overhead on a step.
GOAL = 1.05
#: With --inner: DistributedOptimizer's step over the inner optimizer, in units of that optimizer's own step.
INNER_GOAL = 1.1
LR = 1e-3
MOMENTUM = 0.9


def resnet18_shapes() -> List[Tuple[int, ...]]:
    """ResNet-18's parameter shapes (62 tensors, 11,689,512 values): convolutions, BatchNorm affine, classifier."""
    shapes: List[Tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inputs = 64
    for width, first_stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            block_in = inputs if block == 0 else width
            shapes += [(width, block_in, 3, 3), (width,), (width,), (width, width, 3, 3), (width,), (width,)]
            if block == 0 and (first_stride != 1 or block_in != width):
                shapes += [(width, block_in, 1, 1), (width,), (width,)]  # the downsampling shortcut
        inputs = width
    return shapes + [(1000, 512), (1000,)]


def layer_shapes(d: int) -> List[Tuple[int, ...]]:
    """ResNet-18's shapes, repeated as needed and cut so the values total ``d`` (the last one flattened)."""
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d!r}")
    shapes: List[Tuple[int, ...]] = []
    left = d
    while left:
        for shape in resnet18_shapes():
            n = int(np.prod(shape))
            shapes.append(shape if n <= left else (left,))
            left -= min(n, left)
            if not left:
                break
    return shapes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=count, default=11_000_000, help="float32 parameters (suffixes k, M, G)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=positive_int, default=9, help="interleaved rounds; medians are reported")
    parser.add_argument("--inner", choices=("adamw",), default=None,
                        help="time DistributedOptimizer(sgd, inner=AdamW(fused=True)) against the fused AdamW alone (run at one rank)")


def fill_grads(model: "torch.nn.Module", grad: np.ndarray) -> None:
    """Write ``grad`` into the parameters' gradients in order (they are views of the optimizer's flat buffer)."""
    import torch

    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(torch.from_numpy(grad[offset : offset + n]).view_as(p))
        offset += n


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (a collective call); rank 0 prints the table."""
    import torch

    from mpiopt.torch import DistributedOptimizer
    from mpiopt.torch.threads import set_threads

    abort_on_exception()
    set_threads(1)  # one core per rank, as the flat API's numpy
    topo = Topology()
    grad = np.random.default_rng(topo.rank).standard_normal(args.params).astype(np.float32)

    model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(shape)) for shape in layer_shapes(args.params))
    goal = GOAL
    if args.inner:  # the "flat" column is the optimizer alone, on a module of its own
        plain = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(shape)) for shape in layer_shapes(args.params))
        for p in plain:
            p.grad = torch.zeros_like(p)
        fill_grads(plain, grad)
        alone = torch.optim.AdamW(plain.parameters(), lr=LR, fused=True)
        opt = DistributedOptimizer(model.parameters(), "sgd", topology=topo, inner=torch.optim.AdamW(model.parameters(), lr=LR, fused=True))
        flat_step: Callable[[], object] = alone.step
        goal = INNER_GOAL
    else:
        params = np.zeros(args.params, np.float32)
        alg = create("sgd", topo, lr=LR, momentum=MOMENTUM)
        alg.setup(params)
        opt = DistributedOptimizer(model.parameters(), "sgd", topology=topo, lr=LR, momentum=MOMENTUM)
        flat_step = lambda: alg.step(params, grad)  # noqa: E731
    fill_grads(model, grad)
    steps: Dict[str, Callable[[], object]] = {"flat": flat_step, "torch": opt.step}
    for step in steps.values():
        step()  # warm-up: first-touch allocations, connections

    times: Dict[str, List[float]] = {name: [] for name in steps}
    ratios: List[float] = []
    zero: List[float] = []
    out = say(topo.rank)
    for rnd in range(args.rounds):
        fill_grads(model, grad)
        for name in rotated(list(steps), rnd):
            times[name].append(slowest_seconds(topo, steps[name], args.steps))
        ratios.append(times["torch"][-1] / times["flat"][-1])
        zero.append(slowest_seconds(topo, opt.zero_grad, args.steps))
        out(f"round {rnd + 1}/{args.rounds} done")

    flat, torch_step, ratio = median(times["flat"]), median(times["torch"]), median(ratios)
    out(
        f"\n{topo.size} ranks, d = {args.params} float32 in {len(model)} parameter tensors, "
        f"{args.steps} steps x {args.rounds} rounds, torch {torch.__version__}, host {host()}\n"
    )
    rows = [
        [label, *(f"{1e3 * stat(seconds):.2f}" for stat in (median, min, max))]
        for label, seconds in (
            ("AdamW(fused=True).step() alone" if args.inner else "flat API: alg.step(params, grad)", times["flat"]),
            ("torch: opt.step()" + (" with inner AdamW" if args.inner else ""), times["torch"]), ("torch: opt.zero_grad()", zero),
        )
    ]
    out(markdown_table(["variant", "ms/step (median)", "min", "max"], rows))
    out(f"\nratio of medians torch/flat: {torch_step / flat:.3f}")
    verdict = "met" if ratio <= goal else "missed"
    out(f"ratio torch/flat (median of per-round ratios): {ratio:.3f} (goal <= {goal:.2f}: {verdict})")
    topo.Free()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("torch_overhead", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
