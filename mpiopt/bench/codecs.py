"""Benchmark: a compressed outer step's own work per codec, in units of one fused AdamW step.

``python -m mpiopt.bench.codecs [--d 11M] [--payloads 4] [--codecs none,int8,topk] [--rounds 5] [--json FILE]``
(one process, no MPI: the wire is not timed).

One outer step of a rank: the error-feedback encode of its pseudo-gradient (``e <- beta e + Delta``, encode,
``e <- e - decoded``; ``none`` and ``bf16`` without feedback) and the aggregation of ``--payloads`` payloads (P ranks) into
their mean, against ``torch.optim.AdamW(fused=True)``'s step over ``--d`` float32 parameters, interleaved
round by round.  Goal (issue 31): at most 2 AdamW steps at d = 11M and 4 ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .. import codecs
from ..codecs.feedback import ErrorFeedback
from ..training.config import UsageError
from ._common import comma_list, count, environment, markdown_table, median, module_main, positive_int, rotated, write_json

__all__ = ["GOAL", "add_arguments", "measure", "run", "main"]

#: The outer step's codec work at most this many fused AdamW steps (issue 31).
GOAL = 2.0
UNIT = "torch.optim.AdamW(fused=True)"
#: Codecs that keep no error feedback (exact, or close enough that the papers send them as they are).
WITHOUT_FEEDBACK = ("none", "bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d", type=count, default=11_000_000, help="parameters (suffixes k, M: powers of 10)")
    parser.add_argument("--payloads", type=positive_int, default=4, help="payloads aggregated per outer step (the world size P)")
    parser.add_argument("--codecs", type=comma_list(str), default=list(codecs.CODECS), help="codecs to time, comma-separated")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved timed rounds (medians reported)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results to FILE")


def _adamw_step(d: int) -> Callable[[], None]:
    import torch

    param = torch.nn.Parameter(torch.randn(d, generator=torch.Generator().manual_seed(0)))
    param.grad = torch.randn(d, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW([param], lr=1e-3, fused=True)
    opt.step()  # the state exists from here on, as in training
    return opt.step


def _outer_step(name: str, d: int, ranks: int) -> Callable[[], None]:
    """One rank's codec work of an outer step: feedback encode of its Delta, then the mean of ``ranks`` payloads."""
    codec = codecs.create(name)
    rng = np.random.default_rng(0)
    delta = rng.standard_normal(d, dtype=np.float32)
    feedback = None if name in WITHOUT_FEEDBACK else ErrorFeedback(codec, d, beta=0.95)
    payloads = np.empty((ranks, codec.payload_nbytes(d)), np.uint8)
    for r in range(1, ranks):
        codec.encode(rng.standard_normal(d, dtype=np.float32), out=payloads[r])
    mean = np.empty(d, np.float32)

    def step() -> None:
        if feedback is None:
            codec.encode(delta, out=payloads[0])
        else:
            feedback.encode(delta, out=payloads[0])
        codec.aggregate(payloads, d, out=mean, mean=True)

    step()  # warm: buffers made, caches filled
    return step


def measure(d: int, ranks: int, names: Sequence[str], rounds: int) -> Dict[str, List[float]]:
    """Seconds per call of AdamW's step and of each codec's outer step, ``rounds`` interleaved rounds each."""
    cases: Dict[str, Callable[[], None]] = {UNIT: _adamw_step(d)}
    cases.update({name: _outer_step(name, d, ranks) for name in names})
    seconds: Dict[str, List[float]] = {name: [] for name in cases}
    for i in range(rounds):
        for name in rotated(list(cases), i):
            started = time.perf_counter()
            cases[name]()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def run(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.codecs) - set(codecs.CODECS))
    if unknown:
        raise UsageError(f"unknown codec {', '.join(map(repr, unknown))}; choose from {', '.join(codecs.CODECS)}")
    seconds = measure(args.d, args.payloads, args.codecs, args.rounds)
    unit = median(seconds[UNIT])
    rows, results = [], []
    for name in args.codecs:
        codec = codecs.create(name)
        ratio = median(seconds[name]) / unit
        results.append({"codec": name, "seconds": seconds[name], "ratio": ratio, "bytes": codec.payload_nbytes(args.d),
                        "met": ratio <= GOAL})
        rows.append([name, f"{1e3 * median(seconds[name]):.1f}", f"{ratio:.2f}", "yes" if ratio <= GOAL else "no",
                     f"{codec.bits_per_parameter(args.d):.3f}"])
    print(f"d = {args.d:,}, {args.payloads} payloads aggregated; {UNIT}: {1e3 * unit:.1f} ms (median of {args.rounds})")
    print(markdown_table(["codec", "ms per outer step", f"x {UNIT}", f"<= {GOAL:g}", "bits per parameter"], rows, align="lrrlr"))
    if args.json:
        write_json(args.json, {"benchmark": "codecs", "d": args.d, "ranks": args.payloads, "unit": UNIT, "unit_seconds": seconds[UNIT],
                               "results": results, "environment": environment(SimpleNamespace(size=1), None)})
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return module_main("codecs", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
