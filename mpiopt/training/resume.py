"""Whether a checkpoint may be resumed by this run, and which saved state each rank takes.

The whole decision of ``--resume`` in one place (collective): the algorithm,
model and groups must match, so must the hyperparameters (unless overridden;
on another world size those the class lets scale may differ), the ranks must
be at one step, and on another world size the algorithm's state moves by its
rules (:mod:`mpiopt.algorithms.resize`, used here as a library).  Every
refusal is a :class:`UsageError` raised on every rank alike.  Why each rule:
docs/training-internals.md.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Mapping, Tuple

from ..algorithms.resize import hyperparameter_differences, resize_states, source_rank
from ..algorithms.state import describe_layout
from ..checkpoint import Checkpoint
from ..comm import Comm
from .config import UsageError
from .optimizers import parse_keywords

__all__ = ["rank_state", "workers_of"]


def workers_of(attrs: Mapping[str, Any]) -> Tuple[int, int]:
    """(workers, ranks per worker) of a checkpoint's root attributes or a worker layout; per rank in files from before islands."""
    return int(attrs.get("workers", attrs.get("world_size", 0))), int(attrs.get("ranks_per_worker", 1))


def rank_state(ckpt: Checkpoint, here: Mapping[str, Any], algorithm: str, world: Comm, *,
               override_hyperparameters: bool, hyperparameters: Mapping[str, Any], layout: Mapping[str, int]) -> Dict[str, Any]:
    """This rank's state from ``ckpt`` (params, buffers, rng, algorithm, inner), or :class:`UsageError` (collective).

    ``here``: the root attributes this run would save (``Checkpointer.attrs``);
    ``hyperparameters``: the algorithm's, written into a resized state; ``layout``: this rank's worker
    (``Algorithm.worker_layout``), whose state a checkpoint of other workers is moved to.
    """
    _check_fit(ckpt, here, algorithm, world.size, override_hyperparameters)
    saved, states = ckpt.attrs, ckpt.rank_states
    # At the same world size each rank read its own state only: the ranks tell each other their steps.
    steps = [int(s["step"]) for s in states] if states is not None else world.allgather_obj(int(ckpt.rank_state["step"]))
    if len(set(steps)) > 1 or steps[0] != int(saved["step"]):
        raise UsageError(f"--resume {ckpt.path}: the ranks' states are at different steps {steps}; the file says step {saved['step']}")
    return ckpt.rank_state if states is None else _resized(ckpt, algorithm, world, hyperparameters, layout)


def _check_fit(ckpt: Checkpoint, here: Mapping[str, Any], algorithm: str, size: int, override_hyperparameters: bool) -> None:
    """Refuse a checkpoint of another algorithm, model, groups or hyperparameters, naming both values."""
    saved = ckpt.attrs
    checks = [("algorithm", "algorithm"), ("model signature", "model_signature")]
    if ckpt.world_size == size and workers_of(saved) == workers_of(here):  # on other workers the groups change with them
        checks += [("number of groups (--group-size)", "num_groups"), ("size of rank 0's group (--group-size)", "group_size")]
    for what, key in checks:
        if saved.get(key) != here[key]:
            raise UsageError(f"--resume {ckpt.path}: the checkpoint's {what} is {saved.get(key)!r}, this run's {here[key]!r}")
    if saved.get("precision", "fp32") != here["precision"]:  # files from before --precision trained in float32
        raise UsageError(f"--resume {ckpt.path}: the checkpoint's precision (--precision) is {saved.get('precision', 'fp32')!r}, "
                         f"this run's {here['precision']!r}")
    if override_hyperparameters:
        return
    differences = hyperparameter_differences(
        algorithm, _parsed_keywords(saved["hyperparameters"]), here["hyperparameters"], ckpt.world_size, size)
    if differences:
        raise UsageError(
            f"--resume {ckpt.path}: the checkpoint's hyperparameters differ from this run's "
            f"(--override-hyperparameters keeps this run's): {'; '.join(differences)}"
        )


def _workers(states: List[Mapping[str, Any]]) -> List[int]:
    """The first saved rank of each old worker, in worker order (one state per worker: an island's ranks hold the same)."""
    first: Dict[int, int] = {}
    for rank, state in enumerate(states):  # states from before islands name no worker: each rank was one
        first.setdefault(int((state["algorithm"].get("worker_layout") or {"worker": rank})["worker"]), rank)
    return [first[w] for w in sorted(first)]


def _resized(ckpt: Checkpoint, algorithm: str, world: Comm, hyperparameters: Mapping[str, Any], layout: Mapping[str, int]) -> Dict[str, Any]:
    """This rank's state from a checkpoint of other workers (another world size, islands on or off or resized):
    each old worker's state moves by the algorithm's rules to this rank's worker; rank 0 says what moved and how."""
    old, states = ckpt.world_size, ckpt.rank_states
    workers = _workers(states)
    worker, count = int(layout["worker"]), int(layout["workers"])
    mine = states[workers[source_rank(worker, len(workers))]]
    try:
        unit = "rank" if int(layout["ranks_per_worker"]) == 1 and len(workers) == old else "worker"
        (moved,), notes = resize_states(algorithm, [states[r]["algorithm"] for r in workers], count, hyperparameters,
                                        ranks=[worker], unit=unit)
    except ValueError as err:  # the same states on every rank: every rank refuses alike
        raise UsageError(f"--resume {ckpt.path}: written by {old} ranks, this job has {world.size}: {err}") from None
    moved = {**moved, "world_size": world.size, "worker_layout": dict(layout)}
    if world.rank == 0:
        old_layout = {**(states[0]["algorithm"].get("worker_layout") or {"ranks_per_worker": 1}), "workers": len(workers), "worker": 0}
        lines = "".join(f"\n  {note}" for note in notes) or " nothing but copies"
        if int(old_layout["ranks_per_worker"]) == int(layout["ranks_per_worker"]) == 1:
            moves = f"written by {old} ranks, resuming on {world.size}. Parameters and model buffers: new rank r takes old rank r % {old}'s"
        else:
            moves = (f"written by {old} ranks as {_workers_in_words(old_layout)}, resuming on {world.size} as "
                     f"{_workers_in_words(layout)}. Parameters and model buffers: new worker w takes old worker w % {len(workers)}'s")
        # Said as a line of the run's output, not a Python warning: the user reads it, with no source line under it.
        print(f"--resume {ckpt.path}: {moves}. {algorithm} state, per worker:{lines}\n"
              "The data order continues at the next step of this world's sampler (its epochs differ).", file=sys.stderr, flush=True)
    rng = states[world.rank]["rng"] if world.rank < old else None  # a new rank keeps its fresh seed
    # The inner optimizer's state follows the parameters it moved.
    return {"algorithm": moved, "params": mine["params"], "buffers": mine["buffers"], "rng": rng, "inner": mine.get("inner"),
            "scaler": mine.get("scaler")}


def _workers_in_words(layout: Mapping[str, Any]) -> str:
    """"2 islands of 2 ranks" or "4 ranks": the workers of a layout."""
    return describe_layout({**layout, "worker": 0}).partition(" of ")[2]


def _parsed_keywords(hyperparameters: Mapping[str, Any]) -> Mapping[str, Any]:
    """A checkpoint's hyperparameters with its optimizer's keywords parsed as now (older files kept ``"0.9,0.95"``)."""
    optimizer = hyperparameters.get("optimizer")
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("keywords"), dict):
        return hyperparameters
    return {**hyperparameters, "optimizer": {**optimizer, "keywords": parse_keywords(optimizer.get("name"), optimizer["keywords"])}}
