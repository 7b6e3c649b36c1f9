"""mpiopt.torch.state: an algorithm's state as tensors that ``torch.load(weights_only=True)`` reads, and back."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpiopt.torch.state import as_arrays, as_tensors  # noqa: E402


def _state():
    """Arrays of several dtypes and numpy scalars, nested in mappings, lists and tuples, as a server's state may be."""
    return {
        "steps": 3,
        "arrays": {"error": np.linspace(-1, 1, 7, dtype=np.float32), "indices": np.array([4, 0], np.int32), "unused": None},
        "scalars": {"flag": np.bool_(True), "count": np.int64(7), "rate": np.float32(0.1)},
        "server": {"tables": [np.eye(2, dtype=bool), np.arange(6, dtype=np.int64).reshape(2, 3)], "pair": (np.float64(0.5), "sgd")},
    }


def test_the_state_loads_with_weights_only_and_comes_back_as_the_same_arrays():
    buffer = io.BytesIO()
    torch.save(as_tensors(_state()), buffer)
    buffer.seek(0)
    back = as_arrays(torch.load(buffer, weights_only=True))  # numpy objects would be refused here
    want = _state()
    for key in ("error", "indices"):
        got = back["arrays"][key]
        assert isinstance(got, np.ndarray) and got.dtype == want["arrays"][key].dtype
        assert got.tobytes() == want["arrays"][key].tobytes()
    assert back["arrays"]["unused"] is None and back["steps"] == 3
    # numpy scalars become the Python numbers of the same value
    assert back["scalars"] == {"flag": True, "count": 7, "rate": float(np.float32(0.1))}
    assert [type(v) for v in back["scalars"].values()] == [bool, int, float]
    tables = back["server"]["tables"]
    assert isinstance(tables, list) and all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(tables, want["server"]["tables"]))
    assert back["server"]["pair"] == (0.5, "sgd") and isinstance(back["server"]["pair"], tuple)


def test_a_state_saved_with_numpy_arrays_passes_unchanged():
    state = _state()  # as the optimizer's state_dict held it before the arrays were tensors
    earlier = as_arrays(state)
    assert earlier["arrays"]["error"] is state["arrays"]["error"] and earlier["server"]["tables"][1] is state["server"]["tables"][1]
    assert earlier["scalars"] == state["scalars"] and earlier["server"]["pair"] == state["server"]["pair"]
