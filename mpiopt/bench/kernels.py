"""Benchmark of the sign and sparse kernels (numpy, one process), as ratios to numpy baselines.

``python -m mpiopt.bench.kernels [--d 25000000] [--P 8] [--repeat 5] [--density 0.001]``

Interleaved rounds, medians; baselines ``np.copyto`` (throughput) and ``np.abs`` (top-k).
Goals and method: docs/internals-bench.md; results: docs/benchmarks-kernels.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..kernels import density_to_k, majority_vote, pack_signs, packed_nbytes, regtopk_scores, signs, topk_indices, unpack_signs
from ._common import count, module_main, positive_int

__all__ = ["add_arguments", "run", "main"]

THROUGHPUT_GOAL = 0.3  # x the copy's bytes per second
TOPK_GOAL = 5.0  # x the time of one np.abs pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d", type=count, default=25_000_000, help="vector length (suffixes k, M, G)")
    parser.add_argument("--P", dest="voters", type=positive_int, default=8, help="voters in the majority vote")
    parser.add_argument("--repeat", type=positive_int, default=5, help="timed rounds; medians are reported")
    parser.add_argument("--density", type=float, default=0.001, help="top-k density")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the inputs")


def _numpy_vote(stack: np.ndarray, d: int) -> np.ndarray:
    """majority_vote through its numpy code, as where the C loop was not built."""
    fused, signs._signsc = signs._signsc, None
    try:
        return majority_vote(stack, d)
    finally:
        signs._signsc = fused


def _medians(kernels: Dict[str, Callable[[], object]], repeat: int) -> Dict[str, float]:
    """Median seconds per kernel over ``repeat`` interleaved rounds (after a warm-up round)."""
    times: Dict[str, List[float]] = {name: [] for name in kernels}
    for round_ in range(repeat + 1):
        for name, run in kernels.items():
            start = time.perf_counter()
            run()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print two markdown tables; returns 0 (missed goals are reported, not failed)."""
    d, voters = args.d, args.voters
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal(d, dtype=np.float32)
    nbytes = packed_nbytes(d)
    packed = pack_signs(x)
    # The Allgather receive buffer: one word-aligned row per voter (voted in place).
    stack = rng.integers(0, 256, (voters, packed_nbytes(d, align=8)), dtype=np.uint8)
    k = density_to_k(d, args.density)
    none_sent = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32)
    prev_aggregate = np.zeros(d, dtype=np.float32)
    copy_out, unpack_out, abs_out, score_out = (np.empty_like(x) for _ in range(4))

    # name: (bytes counted, what they are, kernel)
    streaming = {
        "numpy copy (baseline)": (8 * d, "4d read + 4d written", lambda: np.copyto(copy_out, x)),
        "x.copy() (for reference)": (8 * d, "4d read + 4d written, fresh pages", x.copy),
        'pack_signs(nan_policy="unchecked")': (
            4 * d + nbytes,
            "4d read + d/8 written",
            lambda: pack_signs(x, nan_policy="unchecked"),
        ),
        "pack_signs (default NaN check)": (
            4 * d + nbytes,
            "4d read + d/8 written (+ a max() per cached block)",
            lambda: pack_signs(x),
        ),
        "unpack_signs (float32)": (nbytes + 4 * d, "d/8 read + 4d written", lambda: unpack_signs(packed, d, out=unpack_out)),
        f"majority_vote, P = {voters}": (
            (voters + 1) * nbytes,
            "P d/8 read + d/8 written",
            lambda: majority_vote(stack, d),
        ),
        f"majority_vote, P = {voters}, numpy code (no C loop)": (
            (voters + 1) * nbytes,
            "P d/8 read + d/8 written",
            lambda: _numpy_vote(stack, d),
        ),
    }
    selection = {
        "np.abs (baseline)": lambda: np.abs(x, out=abs_out),
        f"topk_indices, k = {k}": lambda: topk_indices(x, k),
        "regtopk_scores (first round)": lambda: regtopk_scores(x, *none_sent, prev_aggregate, 8, 5.0, out=score_out),
        "topk_indices(scores, absolute=False)": lambda: topk_indices(score_out, k, absolute=False),
    }
    medians = _medians({**{n: run for n, (_, _, run) in streaming.items()}, **selection}, args.repeat)

    print(f"d = {d:,}, P = {voters}, top-k density {args.density} (k = {k:,}), median of {args.repeat} rounds")
    print(f"numpy {np.__version__}, Python {platform.python_version()}, {platform.machine()}\n")
    copy_rate = 8 * d / medians["numpy copy (baseline)"]
    print("| kernel | bytes counted | median ms | GB/s | x copy GB/s | goal >= 0.3 |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for name, (moved, what, _) in streaming.items():
        ratio = moved / medians[name] / copy_rate
        if name.startswith(("numpy copy", "x.copy")):
            goal = "baseline" if name.startswith("numpy copy") else "-"
        else:
            goal = "met" if ratio >= THROUGHPUT_GOAL else "MISSED"
        print(f"| {name} | {what} | {1e3 * medians[name]:.2f} | {moved / medians[name] / 1e9:.1f} | {ratio:.2f} | {goal} |")
    abs_time = medians["np.abs (baseline)"]
    print("\n| kernel | median ms | x np.abs time | goal <= 5 |")
    print("| --- | ---: | ---: | --- |")
    for name in selection:
        ratio = medians[name] / abs_time
        if name.startswith("np.abs"):
            goal = "baseline"
        elif name.startswith("topk_indices, k"):
            goal = "met" if ratio <= TOPK_GOAL else "MISSED"
        else:
            goal = "(for RegTop-k)"
        print(f"| {name} | {1e3 * medians[name]:.2f} | {ratio:.2f} | {goal} |")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return module_main("kernels", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
