"""How a nested state maps onto HDF5 groups, datasets and attributes (rules: docs/internals-checkpoint.md).

A state is flattened into :class:`Entry` records plus its arrays, so one writer serves a rank's own state and
one received array by array; :func:`read_group` turns a group back into the nested mapping.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import h5py
import numpy as np

__all__ = [
    "Entry",
    "GROUP",
    "ATTR",
    "DATASET",
    "flatten",
    "write_entry",
    "read_group",
    "attr_decoded",
    "encode_root_attrs",
    "decode_root_attrs",
    "first_difference",
    "TYPE_ATTR",
    "JSON_ATTRS",
]

GROUP, ATTR, DATASET = "group", "attr", "dataset"
#: Attribute of a dataset that holds something other than an array: "bytes" or "numpy-scalar".
TYPE_ATTR = "mpiopt_type"
BYTES, NUMPY_SCALAR = "bytes", "numpy-scalar"
#: Root attribute listing the caller's attributes stored as JSON text.
JSON_ATTRS = "json_attrs"
# Numbers and booleans: what h5py stores natively and MPI moves as raw bytes.
_ARRAY_KINDS = "biufc"
_INT64 = np.iinfo(np.int64)


class Entry(NamedTuple):
    """One item of a flattened state: ``path`` relative to the state's root group; ``value`` the attribute's, or a dataset's ``(dtype, shape, marker)``."""

    kind: str
    path: str
    name: str = ""
    value: Any = None


def _check_key(key: Any, where: str) -> None:
    if not isinstance(key, str):
        raise TypeError(f"{where}: keys must be str, got {key!r} ({type(key).__name__})")
    if not key or key == "." or "/" in key:
        raise ValueError(f"{where}: key {key!r} cannot name an HDF5 object (empty, '.' or containing '/')")


def _as_dataset(value: Any, where: str) -> Tuple[np.ndarray, Optional[str]]:
    """The contiguous array to store for an array, bytes or numpy scalar, and its type marker."""
    if isinstance(value, bytes):
        array, marker = np.frombuffer(value, dtype=np.uint8), BYTES
    elif isinstance(value, np.generic):
        array, marker = np.asarray(value), NUMPY_SCALAR
    else:
        array, marker = value, None
    if array.dtype.kind not in _ARRAY_KINDS:
        raise TypeError(f"{where}: cannot store an array of dtype {array.dtype} (numbers and booleans only)")
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return array, marker


def _check_scalar(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        if "\0" in value:
            raise ValueError(f"{where}: a str with a NUL character cannot be an HDF5 attribute; store it as bytes")
        return value
    raise TypeError(
        f"{where}: cannot store a {type(value).__name__}; values must be mappings, numpy arrays, numpy scalars, "
        "bytes, None, bool, int, float or str"
    )


def flatten(state: Mapping[str, Any], label: str) -> Tuple[List[Entry], List[np.ndarray]]:
    """Entries of ``state`` (parents first) and its arrays; ``TypeError``/``ValueError`` name a bad value as ``label['key']``."""
    entries: List[Entry] = []
    arrays: List[np.ndarray] = []

    def walk(mapping: Any, prefix: str, where: str) -> None:
        if not isinstance(mapping, Mapping):
            raise TypeError(f"{where} must be a mapping, got {type(mapping).__name__}")
        for key, value in mapping.items():
            _check_key(key, where)
            path, inner = prefix + key, f"{where}[{key!r}]"
            if isinstance(value, Mapping):
                entries.append(Entry(GROUP, path))
                walk(value, path + "/", inner)
            elif isinstance(value, (np.ndarray, np.generic, bytes)):
                array, marker = _as_dataset(value, inner)
                entries.append(Entry(DATASET, path, value=(array.dtype.str, array.shape, marker)))
                arrays.append(array)
            else:
                entries.append(Entry(ATTR, prefix.rstrip("/"), key, _check_scalar(value, inner)))

    walk(state, "", label)
    return entries, arrays


def _attr_encoded(value: Any) -> Any:
    """The HDF5 attribute for a scalar; each Python type gets an HDF5 type of its own (see the package doc)."""
    if value is None:
        return h5py.Empty(np.uint8)
    if isinstance(value, bool):
        return np.bool_(value)
    if isinstance(value, int):
        # Beyond int64 (a PCG64 state is 128 bits): decimal digits as a fixed-length ASCII string.
        return np.int64(value) if _INT64.min <= value <= _INT64.max else np.bytes_(str(value))
    if isinstance(value, float):
        return np.float64(value)
    return value  # str: variable-length UTF-8


def attr_decoded(value: Any) -> Any:
    """The Python scalar an attribute written by :func:`write_entry` stands for."""
    if isinstance(value, h5py.Empty):
        return None
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.bytes_):
        return int(value)
    if isinstance(value, str):
        return value
    raise ValueError(f"unexpected attribute value {value!r} ({type(value).__name__})")


def write_entry(root: h5py.Group, entry: Entry, array: Optional[np.ndarray]) -> None:
    """Create ``entry`` under ``root``; ``array`` is the data of a ``DATASET`` entry (None: created without data,
    of the entry's shape and dtype, to be filled later)."""
    if entry.kind == GROUP:
        root.create_group(entry.path)
    elif entry.kind == ATTR:
        group = root[entry.path] if entry.path else root
        group.attrs[entry.name] = _attr_encoded(entry.value)
    else:
        dtype, shape, marker = entry.value
        if array is None:
            dataset = root.create_dataset(entry.path, shape=shape, dtype=np.dtype(dtype))
        else:
            dataset = root.create_dataset(entry.path, data=array)
        if marker is not None:
            dataset.attrs[TYPE_ATTR] = marker


def _read_dataset(dataset: h5py.Dataset) -> Any:
    if dataset.shape is None:
        raise ValueError(f"dataset {dataset.name} has no data (null dataspace)")
    marker = dataset.attrs.get(TYPE_ATTR)
    value = dataset[()]
    if marker == BYTES:
        return value.tobytes()
    if marker == NUMPY_SCALAR:
        return value
    return np.asarray(value)  # a 0-d dataset reads as a numpy scalar: back to a 0-d array


def read_group(group: h5py.Group) -> Dict[str, Any]:
    """The nested mapping stored in ``group``: sub-groups, datasets and attributes, exactly as saved."""
    out: Dict[str, Any] = {}
    for name, item in group.items():
        out[name] = read_group(item) if isinstance(item, h5py.Group) else _read_dataset(item)
    for name, value in group.attrs.items():
        if name in out:
            raise ValueError(f"{group.name}: {name!r} is both an attribute and a member")
        out[name] = attr_decoded(value)
    return out


def first_difference(a: Any, b: Any, where: str = "state") -> Optional[str]:
    """None when two states are bitwise equal (keys, types, dtypes, shapes), else where they first differ; NaN equals NaN."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, Mapping):
        if set(a) != set(b):
            return f"{where}: keys {sorted(set(a) ^ set(b))} in only one"
        for key in a:
            found = first_difference(a[key], b[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (np.ndarray, np.generic)):
        if a.dtype != b.dtype or np.shape(a) != np.shape(b):
            return f"{where}: {a.dtype}{np.shape(a)} vs {b.dtype}{np.shape(b)}"
        return None if np.asarray(a).tobytes() == np.asarray(b).tobytes() else f"{where}: values differ"
    if isinstance(a, float):
        return None if np.float64(a).tobytes() == np.float64(b).tobytes() else f"{where}: {a!r} vs {b!r}"
    return None if a == b else f"{where}: {a!r} vs {b!r}"


# -- root attributes -----------------------------------------------------------------------
def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def encode_root_attrs(attrs: Mapping[str, Any]) -> Dict[str, Any]:
    """HDF5 attributes for ``attrs``: bool, int64, float and str as themselves, anything else as JSON (named in :data:`JSON_ATTRS`)."""
    if not isinstance(attrs, Mapping):
        raise TypeError(f"attrs must be a mapping, got {type(attrs).__name__}")
    out: Dict[str, Any] = {}
    as_json: List[str] = []
    for name, value in attrs.items():
        _check_key(name, "attrs")
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, (bool, float)) or (isinstance(value, int) and _INT64.min <= value <= _INT64.max):
            out[name] = _attr_encoded(value)
        elif isinstance(value, str) and "\0" not in value:
            out[name] = value
        else:
            try:
                out[name] = json.dumps(value, default=_json_default)
            except (TypeError, ValueError) as err:
                raise TypeError(f"attrs[{name!r}] is not JSON-serialisable: {err}") from None
            as_json.append(name)
    if as_json:
        out[JSON_ATTRS] = np.array(as_json, dtype=h5py.string_dtype())
    return out


def decode_root_attrs(attrs: h5py.AttributeManager) -> Dict[str, Any]:
    """The root attributes as Python objects (JSON text decoded); :data:`JSON_ATTRS` itself left out."""
    as_json = set(attrs[JSON_ATTRS]) if JSON_ATTRS in attrs else set()
    return {name: json.loads(value) if name in as_json else attr_decoded(value) for name, value in attrs.items() if name != JSON_ATTRS}
