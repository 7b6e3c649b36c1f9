"""What is in a checkpoint file: layout, attributes, each array's shape, dtype and norm (``mpiopt inspect``)."""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Iterator, List, Optional

import h5py
import numpy as np

from .agreement import CheckpointError
from .files import InvalidFile, open_readonly, validate_checkpoint
from .layout import TYPE_ATTR, attr_decoded, decode_root_attrs

__all__ = ["describe", "format_description"]

# Elements read at a time for a norm, so that a large dataset is not loaded whole.
_BLOCK = 1 << 22


def _blocks(dataset: h5py.Dataset) -> Iterator[np.ndarray]:
    if dataset.ndim == 0:
        yield np.asarray(dataset[()])
        return
    row = math.prod(dataset.shape[1:])
    rows = max(1, _BLOCK // max(1, row))
    for start in range(0, dataset.shape[0], rows):
        yield dataset[start : start + rows]


def _norm(dataset: h5py.Dataset) -> Optional[float]:
    """L2 norm accumulated in float64 (None for what is not numbers)."""
    if dataset.shape is None or dataset.dtype.kind not in "biufc":
        return None
    total = 0.0
    for block in _blocks(dataset):
        x = np.abs(block) if block.dtype.kind == "c" else block
        x = x.astype(np.float64).ravel()
        total += float(np.dot(x, x))
    return math.sqrt(total)


def _plain(value: Any) -> Any:
    """An attribute as JSON-ready data: decoded where we wrote it, its text otherwise."""
    try:
        return attr_decoded(value)
    except ValueError:
        return str(value)


def _json_number(x: Optional[float]) -> Any:
    # Strict JSON has no NaN or Infinity: say it in words.
    return x if x is None or math.isfinite(x) else str(x)


def describe(path: str) -> Dict[str, Any]:
    """Describe any HDF5 file, an mpiopt checkpoint or not, as JSON-serialisable data (``mpiopt inspect``).

    ``problem`` is None for a whole checkpoint; ``layout`` lists groups and datasets depth first, datasets with
    shape, dtype, L2 ``norm`` and type marker.  Raises ``CheckpointError`` if the file is missing or not HDF5.
    """
    problem = validate_checkpoint(path)
    try:
        f = open_readonly(path)
    except InvalidFile as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from None
    with f:
        try:
            attrs = decode_root_attrs(f.attrs)
        except (ValueError, KeyError):
            attrs = {name: _plain(value) for name, value in f.attrs.items()}
        layout: List[Dict[str, Any]] = []

        def walk(group: h5py.Group) -> None:
            for name, item in group.items():
                entry: Dict[str, Any] = {"path": item.name}
                if isinstance(item, h5py.Group):
                    entry.update(kind="group", attrs={k: _plain(v) for k, v in item.attrs.items()})
                    layout.append(entry)
                    walk(item)
                    continue
                marker = item.attrs.get(TYPE_ATTR)
                entry.update(
                    kind="dataset",
                    attrs={k: _plain(v) for k, v in item.attrs.items() if k != TYPE_ATTR},
                    shape=None if item.shape is None else list(item.shape),
                    dtype=str(item.dtype),
                    norm=_json_number(_norm(item)),
                    type=None if marker is None else str(marker),
                )
                layout.append(entry)

        walk(f)
    return {"path": str(path), "problem": problem, "attrs": attrs, "layout": layout}


def _value(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list, str)) else repr(value)


def format_description(desc: Dict[str, Any]) -> str:
    """:func:`describe`'s result as text: status, root attributes, then the layout as an indented tree."""
    lines = [f"checkpoint {desc['path']}", f"status: {'valid' if desc['problem'] is None else 'INVALID: ' + desc['problem']}"]
    lines.append("attributes:")
    lines += [f"  {name} = {_value(value)}" for name, value in desc["attrs"].items()]
    lines.append("layout:")
    rows = []
    for entry in desc["layout"]:
        depth = entry["path"].count("/")
        name = entry["path"].rsplit("/", 1)[1]
        if entry["kind"] == "group":
            rows.append((f"{'  ' * depth}{name}/", ""))
            rows += [(f"{'  ' * (depth + 1)}@{key} = {_value(value)}", "") for key, value in entry["attrs"].items()]
            continue
        shape = "null" if entry["shape"] is None else "(" + ", ".join(map(str, entry["shape"])) + ("," if len(entry["shape"]) == 1 else "") + ")"
        norm = entry["norm"]
        detail = f"{entry['dtype']:<10} {shape:<16}"
        if norm is not None:
            detail += f" norm {norm:.6e}" if isinstance(norm, float) else f" norm {norm}"
        if entry["type"]:
            detail += f"  [{entry['type']}]"
        rows.append((f"{'  ' * depth}{name}", detail))
    width = max((len(left) for left, right in rows if right), default=0)
    lines += [f"{left:<{width}}  {right}".rstrip() if right else left for left, right in rows]
    return "\n".join(lines)
