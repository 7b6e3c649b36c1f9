"""Error feedback around any codec: what a payload did not carry is kept and sent later.

``e <- beta e + x``; send ``encode(e)``; ``e <- e - decode(sent)``.  ``beta = 1`` is classic error feedback
(Seide et al. 2014, Karimireddy et al. 2019); ``beta < 1`` is SparseLoCo's decaying accumulator, which stands in
for the outer momentum (arXiv 2508.15706, Algorithm 1).  The state is one array and numbers: docs/codecs.md.
"""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

from ..arrays import array_module
from ..kernels._backend import check_count
from . import fused
from .base import Codec, check_payload, check_real, check_vector

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """A codec's residual ``e`` (``d`` entries of ``dtype`` on ``like``'s device) and the decay ``beta`` in ``[0, 1]``.

    ``residual``, when given, is the caller's array to keep ``e`` in (zeroed here; its dtype and device win).
    """

    def __init__(
        self, codec: Codec, d: int, beta: float = 1.0, dtype: Any = np.float32, like: Any = None, residual: Any = None,
    ) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a Codec (mpiopt.codecs.create), got {type(codec).__name__}")
        self.codec = codec
        self.d = check_count("d", d, 1)
        self.beta = check_real("beta", beta, 0.0, 1.0)
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        if residual is not None:
            check_vector("residual", residual, self.d)
            residual[...] = 0
            self.residual = residual
            return
        xp = np if like is None else array_module(like)
        self.residual = xp.zeros(self.d, dtype=dtype)

    def encode(self, x: Any, out: Any = None) -> Any:
        """Fold ``x`` into the residual, encode the residual into ``out`` (a payload) and keep what it did not carry."""
        check_vector("x", x, self.d)
        residual = self.residual
        if fused.available(self.codec, feedback=True):  # one fused visit per chunk, same bits
            nbytes = self.codec.payload_nbytes(self.d)
            out = array_module(residual).empty(nbytes, dtype=np.uint8) if out is None else out
            check_payload("out", out, nbytes)
            if fused.encode(self.codec, residual, out, x, self.beta, feedback=True):
                return out
        if self.beta != 1.0:
            residual *= residual.dtype.type(self.beta)
        residual += x
        payload = self.codec.encode(residual, out)
        self.codec.add_decoded(payload, self.d, residual, weight=-1.0)  # e - decode(sent): negation is exact
        return payload

    def state_dict(self) -> Dict[str, Any]:
        """``residual`` (the live array), ``beta``, the codec's ``name`` and parameters: arrays and numbers, no communicator."""
        params = {f"codec_{key}": value for key, value in self.codec.params().items()}
        return {"codec": self.codec.name, **params, "beta": self.beta, "residual": self.residual}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: the residual copied in place; ``ValueError`` if codec, parameters, beta or ``d`` differ."""
        expected = self.state_dict()
        for key, value in expected.items():
            if key == "residual":
                continue
            if key not in state or state[key] != value:
                raise ValueError(f"error-feedback state has {key} = {state.get(key)!r}, this one {value!r}")
        residual = state["residual"]
        if tuple(residual.shape) != (self.d,):
            raise ValueError(f"residual must have d = {self.d} entries, got shape {tuple(residual.shape)}")
        xp = array_module(self.residual)
        self.residual[...] = xp.asarray(residual, dtype=self.residual.dtype)
