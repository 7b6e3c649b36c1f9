"""``mpiopt bench model calibrate | validate | project``: the arguments, and each action's files and tables."""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Sequence, Tuple

from ...training.config import UsageError
from .._common import check_choices, comma_list, count, parse_rate, write_json
from .calibration import calibrate
from .costs import MEDIA
from .predict import FABRIC_ALPHA, RANKS, RATES, ideal_link, project, projected, validate
from .report import calibration_table, plot_projection, plot_validation, projection_table, validation_table

__all__ = ["MODELS", "add_arguments", "run"]

#: name=parameters@compute-ms: ResNet-50 (25.6M) and a 350M-parameter model, compute per step on one accelerator.
MODELS = ("resnet50=25.6M@100", "350M=350M@500")


def _load(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """The JSON documents at ``paths``; one that cannot be read is a usage error naming it."""
    docs = []
    for path in paths:
        try:
            with open(path) as handle:
                docs.append(json.load(handle))
        except (OSError, ValueError) as err:
            raise UsageError(f"cannot read {path}: {err}") from None
    return docs


def _parse_models(specs: Sequence[str]) -> List[Tuple[str, int, float]]:
    """``name=D@MS`` -> (name, parameters, compute seconds)."""
    out = []
    for spec in specs:
        try:
            name, rest = spec.split("=", 1)
            d, ms = rest.split("@", 1)
            out.append((name, count(d), float(ms) / 1e3))
        except (ValueError, argparse.ArgumentTypeError):
            raise UsageError(f"--models: expected NAME=PARAMETERS@COMPUTE_MS such as resnet50=25.6M@100, got {spec!r}") from None
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The actions calibrate, validate and project, each with its files and options."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=argparse.ArgumentParser)
    sub.required = True
    p = sub.add_parser("calibrate", help="fit alpha and beta per collective to bench collectives JSON files")
    p.add_argument("collectives", nargs="+", metavar="COLL.json")
    p.add_argument("--medium", choices=MEDIA, default=None, help="default: shared inside the emulated link, else switched")
    p.add_argument("--out", required=True, metavar="MODEL.json")
    p = sub.add_parser("validate", help="the model's step times against bench algorithms JSON files, error per point")
    p.add_argument("model", metavar="MODEL.json")
    p.add_argument("measured", nargs="+", metavar="ALG.json")
    p.add_argument("--goal", type=float, default=0.25, help="relative error counted as a hit")
    p.add_argument("--node", default=None, metavar="NODE.json",
                   help="the node's model (calibrate bench collectives run inside one node), for island runs' calls within the islands")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="PNG")
    p = sub.add_parser("project", help="step time and speed-up over sgd at many ranks and faster links")
    p.add_argument("model", metavar="MODEL.json")
    p.add_argument("--models", type=comma_list(str), default=list(MODELS), metavar="NAME=D@MS,...",
                   help="models: parameters and compute milliseconds per step")
    # dest: ``mpiopt bench --ranks N`` (start the job) shares this namespace.
    p.add_argument("--ranks", dest="world_sizes", type=comma_list(int), default=list(RANKS), metavar="P,P,...", help="world sizes")
    p.add_argument("--rates", type=comma_list(str), default=list(RATES), metavar="RATE,...", help="link rates in tc's units")
    p.add_argument("--algorithms", type=comma_list(str), default=None, metavar="A,B,...",
                   help="algorithms to project (default: every synchronous one, and the asynchronous ones with a server model)")
    p.add_argument("--alpha", type=float, default=None, metavar="SECONDS", help="latency per hop (default: the calibrated)")
    p.add_argument("--ranks-per-island", type=int, default=1, metavar="G",
                   help="also project each algorithm that takes islands with islands of G ranks (needs --node or --node-rate)")
    node = p.add_mutually_exclusive_group()
    node.add_argument("--node", default=None, metavar="NODE.json", help="the node's model, for the calls within islands")
    node.add_argument("--node-rate", default=None, metavar="RATE",
                      help="instead of --node: the node's links as ideal ones at RATE in tc's units (NVLink 4: 450gbps, "
                           "PCIe 4.0 x16: 25gbps), their hops at --alpha (default 10 us)")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="PNG")


def run(args: argparse.Namespace) -> int:
    """Calibrate, validate or project (no MPI); print Markdown tables."""
    try:
        if args.action == "calibrate":
            model = calibrate(_load(args.collectives), args.medium)
            write_json(args.out, model)
            print(f"## alpha-beta calibration ({model['medium']} medium, link {model['link_bits_per_second']:g} bit/s)\n")
            print(calibration_table(model))
            print(f"\nwrote {args.out}")
            return 0
        (model,) = _load([args.model])
        node = _load([args.node])[0] if getattr(args, "node", None) else None
        if getattr(args, "node_rate", None):
            node = ideal_link(parse_rate(args.node_rate), FABRIC_ALPHA if args.alpha is None else args.alpha)
        if args.action == "validate":
            rows = validate(model, _load(args.measured), node)
            print(validation_table(rows, args.goal))
            hits = sum(abs(r["error"]) <= args.goal for r in rows)
            print(f"\n{hits} of {len(rows)} points within {100 * args.goal:.0f} %")
        else:
            args.algorithms = args.algorithms or projected()
            check_choices("--algorithms", args.algorithms, projected())
            if not args.world_sizes or min(args.world_sizes) < 2:
                raise UsageError(f"--ranks must be >= 2, got {args.world_sizes}")
            if args.ranks_per_island < 1 or (args.ranks_per_island > 1 and node is None):
                raise UsageError(f"--ranks-per-island must be >= 1, and above 1 it needs --node or --node-rate; got {args.ranks_per_island}")
            rows = project(model, _parse_models(args.models), args.world_sizes, args.rates, args.algorithms, args.alpha,
                           args.ranks_per_island, node)
            print(projection_table(rows))
        if args.json:
            write_json(args.json, {"benchmark": f"model-{args.action}", "rows": rows})
        if args.plot:
            (plot_validation if args.action == "validate" else plot_projection)(rows, args.plot)
            print(f"wrote {args.plot}")
    except ValueError as err:
        if isinstance(err, UsageError):
            raise
        raise UsageError(str(err)) from None
    return 0
