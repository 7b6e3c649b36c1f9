"""Benchmark: mpiopt against torch ``DistributedDataParallel`` on gloo, same model, data and ranks, in one run.

``mpiexec -n 4 python -m mpiopt bench ddp [--model mlp --width 1024] [--algorithms sgd,signum] [--json FILE]``
(inside the emulated link: ``mpiopt bench --link 1gbit --ranks 4 ddp ...``).

Variants ``ddp``, each ``<algorithm>`` through ``DistributedOptimizer``, and with ``--blocking``
``sgd+blocking``; reports ms per step, samples per second and the ratio to ddp (below 1 is faster).
Method: docs/internals-bench.md; results and gloo's set-up: docs/benchmarks-ddp.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..comm import Topology
from ..training.config import TrainConfig, UsageError
from ._common import check_choices, comma_list, environment, link_rate, markdown_table, median, module_main, positive_int, rotated, say
from ._common import slowest_seconds, write_json
from .algorithms import synchronous

__all__ = ["add_arguments", "run", "main"]

MODELS = ("mlp", "cnn", "resnet20")
#: The goal for ``sgd``'s step time over DDP's: over shared memory, and over the (emulated) link.
GOALS = {"shared memory": 0.95, "link": 1.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algorithms", type=comma_list(str), default=None, metavar="A,B,...", help="mpiopt algorithms to compare with DDP (default: every synchronous one)")
    parser.add_argument("--model", choices=MODELS, default="mlp", help="model (mpiopt.tasks.models.build_model)")
    parser.add_argument("--width", type=positive_int, default=1024, help="the model's width (mlp: hidden units; cnn, resnet20: first channels)")
    parser.add_argument("--input-shape", type=comma_list(int), default=[1, 8, 8], metavar="C,H,W", help="shape of one synthetic sample")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=positive_int, default=8, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds (medians reported)")
    parser.add_argument("--threads", type=positive_int, default=1, help="threads per rank, for torch and mpiopt's C kernels alike")
    parser.add_argument("--blocking", action="store_true", help="add sgd+blocking: DistributedOptimizer(..., overlap=False), the exchange after backward")
    parser.add_argument("--optimizer", choices=("adamw",), default=None,
                        help="both sides step with torch.optim.AdamW(lr=1e-3, fused=True): DDP's optimizer and mpiopt's inner= "
                        "(algorithms that take one; default: SGD with sgd's rate and momentum)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results to FILE")


def _check(args: argparse.Namespace) -> None:
    args.algorithms = args.algorithms or synchronous()
    check_choices("--algorithms", args.algorithms, synchronous())
    if len(args.input_shape) != 3:
        raise UsageError(f"--input-shape must be C,H,W, got {','.join(map(str, args.input_shape))}")


def _batches(args: argparse.Namespace, topology: Topology, count: int = 8) -> List[tuple]:
    """This rank's ``count`` batches of a synthetic dataset (every rank its own shard)."""
    import torch

    from ..tasks.images import make_synthetic

    per_batch = args.batch_size * topology.size
    data = make_synthetic(seed=args.seed, n_train=per_batch * count, n_test=1, input_shape=tuple(args.input_shape))
    out = []
    for i in range(count):
        start = i * per_batch + topology.rank * args.batch_size
        rows = slice(start, start + args.batch_size)
        out.append((torch.from_numpy(data.x_train[rows]), torch.from_numpy(data.y_train[rows])))
    return out


class _Variant:
    """One model and its optimizer; ``step()`` trains on the next batch."""

    def __init__(self, name: str, args: argparse.Namespace, topology: Topology, batches: Sequence[tuple]) -> None:
        import torch
        from torch.nn import functional as F

        from ..tasks.models import build_model
        from ..torch import DistributedOptimizer

        torch.manual_seed(args.seed)
        self.model = build_model(args.model, input_shape=tuple(args.input_shape), num_classes=10, width=args.width)
        sgd = TrainConfig().algorithm_hyperparameters("sgd")
        adamw = (lambda: torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)) if args.optimizer == "adamw" else None
        if name == "ddp":
            with warnings.catch_warnings():
                # torch 2.13 deprecates broadcast_buffers, but its replacement still syncs at set-up.
                warnings.filterwarnings("ignore", message=".*broadcast_buffers", category=FutureWarning)
                self.net = torch.nn.parallel.DistributedDataParallel(self.model, broadcast_buffers=False)
            self.opt = adamw() if adamw else torch.optim.SGD(self.model.parameters(), lr=sgd["lr"], momentum=sgd.get("momentum", 0.0))
            update: Callable[[Any], None] = lambda loss: self.opt.step()
        else:
            algorithm, _, option = name.partition("+")
            extra = {"overlap": False} if option == "blocking" else {}
            hyper = TrainConfig(optimizer=args.optimizer).algorithm_hyperparameters(algorithm)
            if adamw:
                extra["inner"] = adamw()
            self.net = self.model
            self.opt = DistributedOptimizer(self.model.parameters(), algorithm, topology=topology, **extra, **hyper)
            update = lambda loss: self.opt.step(loss=loss)
        self.batches, self.steps = batches, 0

        def step() -> None:
            x, y = self.batches[self.steps % len(self.batches)]
            self.opt.zero_grad()
            loss = F.cross_entropy(self.net(x), y)
            loss.backward()
            update(loss)
            self.steps += 1

        self.step = step

    def finish(self) -> None:
        if hasattr(self.opt, "finish"):
            self.opt.finish()


def _parameter_difference(a: Any, b: Any) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def run(args: argparse.Namespace) -> int:
    """Run the comparison (a collective call); rank 0 prints the table and writes the JSON."""
    import torch
    import torch.distributed as dist

    from ..torch.threads import set_threads
    from ..training.ddp import init_gloo  # torch's gloo: imported when this benchmark runs, not by every mpiopt command

    _check(args)
    link = link_rate(getattr(args, "link", None))
    set_threads(args.threads)  # mpiopt's side uses as many as torch's
    topology = Topology()
    out = say(topology.rank)
    init_gloo(topology)
    names = ["ddp", *args.algorithms] + (["sgd+blocking"] if args.blocking else [])
    batches = _batches(args, topology)
    variants = {name: _Variant(name, args, topology, batches) for name in names}
    params = sum(p.numel() for p in variants["ddp"].model.parameters())
    for variant in variants.values():  # warm-up: allocations, connections, DDP's buckets
        for _ in range(2):
            variant.step()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for rnd in range(args.rounds):
        for name in rotated(names, rnd):
            times[name].append(slowest_seconds(topology, variants[name].step, args.steps))
        out(f"round {rnd + 1}/{args.rounds}: " + ", ".join(f"{n} {1e3 * times[n][-1]:.1f} ms" for n in names), file=sys.stderr)
    for variant in variants.values():
        variant.finish()
    difference = _parameter_difference(variants["ddp"].model, variants["sgd"].model) if "sgd" in variants else None

    samples = args.batch_size * topology.size
    setting = "link" if os.environ.get("EMULATED_LINK_RATE") else "shared memory"
    results = {}
    for name in names:
        ratios = [t / d for t, d in zip(times[name], times["ddp"])]
        results[name] = {
            "seconds": times[name], "median_seconds": median(times[name]), "min_seconds": min(times[name]),
            "samples_per_second": samples / median(times[name]), "ratios_to_ddp": ratios, "median_ratio_to_ddp": median(ratios),
        }
    rows = [
        [name, f"{1e3 * r['median_seconds']:.2f}", f"{1e3 * r['min_seconds']:.2f}", f"{r['samples_per_second']:.0f}", f"{r['median_ratio_to_ddp']:.3f}"]
        for name, r in results.items()
    ]
    out(f"\n## mpiopt vs DDP on gloo: {topology.size} ranks, {setting} (link {link or 'not given'}), {args.model} width {args.width} "
        f"({params:,} parameters), batch {args.batch_size} per rank, {args.steps} steps x {args.rounds} rounds, "
        f"{args.threads} torch thread(s) per rank, torch {torch.__version__}\n")
    out(markdown_table(["variant", "ms/step (median)", "min", "samples/s", "time / ddp (median of rounds)"], rows))
    if difference is not None:
        out(f"\nlargest |ddp - sgd| parameter difference after {variants['sgd'].steps} steps: {difference:.3g}")
    goal = GOALS[setting]
    for name in ("sgd", "sgd+blocking"):
        if name in results:
            ratio = results[name]["median_ratio_to_ddp"]
            out(f"goal, {name} step time <= {goal:.2f} x DDP's ({setting}): {ratio:.3f} ({'met' if ratio <= goal else 'missed'})")
    if args.json and topology.rank == 0:
        write_json(args.json, {
            "benchmark": "ddp", **environment(topology, link), "torch": torch.__version__, "setting": setting,
            "model": args.model, "width": args.width, "input_shape": args.input_shape, "parameters": params,
            "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
            "sgd_parameter_difference": difference, "goal": goal, "results": results,
        })
        out(f"\nwrote {args.json}")
    # The DDP wrappers go before their process group (collected now: a module and its reducer hold each other, and
    # a reducer freed after its group aborts the process), and the ranks end it together.
    variants.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    topology.Free()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("ddp", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
