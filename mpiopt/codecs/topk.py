"""``topk``: SparseLoCo's chunked top-k (arXiv 2508.15706) with in-chunk indices and values of ``bits`` bits.

Per chunk of ``chunk`` entries the ``k`` of largest ``|x|`` (ties: lowest index; NaN below every number, the
kernels' convention), their in-chunk indices in ``ceil(log2 chunk)`` bits, their values as ``sign * scale *
level`` with ``scale`` the mean ``|value|`` of the chunk's selection (float32) and ``bits - 1`` bits choosing the
level.  Sections: scales, indices, values.  Levels, bytes and bounds: docs/codecs.md.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, Tuple

import numpy as np

from ..kernels._backend import check_count
from ..kernels.sparse import scatter_add, topk_indices
from ..kernels.sparse.device import chunk_topk
from .base import SCALE_BYTES, Chunked
from .bitfields import fields_nbytes, pack_fields, unpack_fields

__all__ = ["TopkCodec", "topk_levels"]

# The span of the magnitude levels, in units of the selection's mean |value|, by bits: fitted to the top 64 of
# 4,096 of Gaussian, Laplace and Student-t samples (docs/codecs.md, "topk").
_SPANS = {2: (0.95, 1.3)}
_SPAN = (0.9, 1.5)


def topk_levels(bits: int) -> np.ndarray:
    """The ``2**(bits - 1)`` magnitude levels (units of the mean ``|value|``), evenly spaced: ``{1}`` for 1 bit,
    ``{0.95, 1.3}`` for 2, ``[0.9, 1.5]`` for more."""
    count = 2 ** (bits - 1)
    return np.ones(1) if count == 1 else np.linspace(*_SPANS.get(bits, _SPAN), count)


class TopkCodec(Chunked):
    """The top ``k`` of every chunk, indices in ``ceil(log2 chunk)`` bits, values in ``bits`` bits, a float32 scale per chunk.

    At the defaults (chunk 4096, k 64, bits 2) a whole chunk takes ``4 + 96 + 16 = 116`` bytes: 0.2266 bits per entry.
    """

    name = "topk"
    defaults = {"chunk": 4096, "k": 64, "bits": 2}

    def __init__(self, chunk: int = 4096, k: int = 64, bits: int = 2) -> None:
        super().__init__(chunk)
        self.k = check_count("k", k, 1, self.chunk)
        self.bits = check_count("bits", bits, 1, 8)
        self.index_bits = max(1, (self.chunk - 1).bit_length())
        self.levels = topk_levels(self.bits)

    def selected(self, d: int) -> int:
        """Entries sent for ``d``: ``k`` per whole chunk, ``min(k, rest)`` of a ragged last one."""
        return d // self.chunk * self.k + min(self.k, d % self.chunk)

    def bytes_breakdown(self, d: int) -> Dict[str, int]:
        """``scales`` ``4 ceil(d / chunk)``, ``indices`` ``ceil(K ceil(log2 chunk) / 8)``, ``values`` ``ceil(K bits / 8)``, K selected."""
        count = self.selected(d)
        return {
            "header": 0,
            "scales": SCALE_BYTES * self.chunks(d),
            "indices": fields_nbytes(count, self.index_bits),
            "values": fields_nbytes(count, self.bits),
        }

    # ---- selection -----------------------------------------------------------------------------------------
    def select(self, xp: ModuleType, x: Any) -> Any:
        """The flat indices (int64, ascending) of the top ``k`` ``|x|`` of every chunk."""
        rows, tail = self.rows(x)
        parts = []
        if rows.shape[0]:
            parts.append(self._select_rows(xp, rows))
        if tail.shape[0]:
            # The ragged chunk alone: the kernels' top-k, whose convention the rows follow.
            start = rows.shape[0] * self.chunk
            parts.append(topk_indices(tail, min(self.k, tail.shape[0])).astype(xp.int64) + start)
        return parts[0] if len(parts) == 1 else xp.concatenate(parts)

    def _select_rows(self, xp: ModuleType, rows: Any) -> Any:
        """Top ``k`` of every row by ``|x|``, all rows at once: the k-th largest by a partition, ties to the lowest index."""
        n, chunk = rows.shape
        k = self.k
        flat = self._buffer(xp, "flat", n * k, np.int64)
        if chunk_topk(rows, k, flat):  # cupy: one kernel, the same indices
            return flat
        scores = self._buffer(xp, "scores", n * chunk, rows.dtype).reshape(n, chunk)
        xp.abs(rows, out=scores)
        xp.fmax(scores, -np.inf, out=scores)  # NaN -> -inf: below every number, as the kernels rank it
        ordered = self._buffer(xp, "ordered", n * chunk, rows.dtype).reshape(n, chunk)
        ordered[...] = scores
        ordered.partition(chunk - k, axis=1)
        kth = ordered[:, chunk - k : chunk - k + 1]
        keep = self._buffer(xp, "keep", n * chunk, xp.bool_).reshape(n, chunk)
        xp.greater_equal(scores, kth, out=keep)
        extra = keep.sum(axis=1) - k
        tied = xp.flatnonzero(extra > 0)
        if tied.shape[0]:  # rows with ties at the k-th place (rare for real data): drop the highest-index ties
            rows_tied = scores[tied]
            at_kth = rows_tied == kth[tied]
            rank_from_end = xp.cumsum(at_kth[:, ::-1], axis=1)[:, ::-1]
            drop = at_kth & (rank_from_end <= extra[tied][:, None])
            keep[tied] = (rows_tied >= kth[tied]) & ~drop
        return xp.flatnonzero(keep)

    # ---- quantization -------------------------------------------------------------------------------------
    def _chunk_of(self, xp: ModuleType, d: int) -> Any:
        """The chunk of every selected entry: ``k`` per chunk in order, the ragged last one's ``min(k, rest)`` at the end."""
        return xp.arange(self.selected(d), dtype=xp.int64) // self.k

    def _mean_per_chunk(self, xp: ModuleType, magnitudes: Any) -> Any:
        """The mean of every chunk's selected magnitudes (``k`` per whole chunk, the rest in the last), float64."""
        whole = magnitudes.shape[0] // self.k
        means = [magnitudes[: whole * self.k].reshape(whole, self.k).mean(axis=1)]
        if magnitudes.shape[0] > whole * self.k:
            means.append(magnitudes[whole * self.k :].mean(keepdims=True))
        return xp.concatenate(means)

    def _encode(self, xp: ModuleType, x: Any, sections: Dict[str, Any]) -> None:
        d = x.shape[0]
        flat = self.select(xp, x)
        values = x[flat]
        owner = self._chunk_of(xp, d)
        magnitudes = xp.abs(values).astype(xp.float64)
        scales = self.write_scales(xp, self._mean_per_chunk(xp, magnitudes), sections["scales"])
        unit = xp.where(scales == 0, 1, scales).astype(xp.float64)[owner]
        last = self.levels.shape[0] - 1
        if last:  # the nearest level: levels are evenly spaced
            low, spacing = float(self.levels[0]), float(self.levels[1] - self.levels[0])
            index = xp.clip(xp.rint((magnitudes / unit - low) / spacing), 0, last)
            index = xp.nan_to_num(index).astype(xp.int64)
        else:
            index = xp.zeros(values.shape[0], dtype=xp.int64)
        codes = index | (xp.signbit(values).astype(xp.int64) << (self.bits - 1))
        pack_fields(xp, codes, self.bits, sections["values"])
        pack_fields(xp, flat - owner * self.chunk, self.index_bits, sections["indices"])

    def decode_sparse(self, xp: ModuleType, sections: Dict[str, Any], d: int, dtype: Any) -> Tuple[Any, Any]:
        """(flat indices int32 ascending, values of ``dtype``) that a payload's sections carry."""
        count = self.selected(d)
        owner = self._chunk_of(xp, d)
        indices = (unpack_fields(xp, sections["indices"], self.index_bits, count) + owner * self.chunk).astype(xp.int32)
        codes = unpack_fields(xp, sections["values"], self.bits, count)
        table = np.concatenate([self.levels, -self.levels])  # code = sign << (bits - 1) | level index
        scales = self.read_scales(xp, sections["scales"])
        values = xp.asarray(table, dtype=dtype)[codes] * scales[owner].astype(dtype)
        return indices, values

    def _count_senders(self, xp: ModuleType, payloads: Any, d: int, out: Any) -> None:
        """Every row's indices at once (one unpack of the rows' index sections), counted by one unbuffered add."""
        count = self.selected(d)
        fields = unpack_fields(xp, self._sections(payloads, d)["indices"], self.index_bits, count)  # (P, count)
        fields += self._chunk_of(xp, d) * self.chunk
        out[...] = 0
        xp.add.at(out, fields.ravel(), 1)  # a row's indices are distinct, the rows' overlap: counted by add.at

    def _decode(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any) -> None:
        out[...] = 0
        scatter_add(out, *self.decode_sparse(xp, sections, d, out.dtype))

    def _add_decoded(self, xp: ModuleType, sections: Dict[str, Any], d: int, out: Any, weight: float) -> None:
        indices, values = self.decode_sparse(xp, sections, d, out.dtype)
        if weight != 1.0:
            values *= out.dtype.type(weight)
        scatter_add(out, indices, values)
