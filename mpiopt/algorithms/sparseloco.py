"""SparseLoCo: DiLoCo's inner loop, with an error-feedback accumulator of the pseudo-gradient in place of the outer
momentum, of which each rank sends the top 64 of every 4,096 entries in 2 bits; the sparse payloads are all-gathered.

Sarfi, Thérien, Lidin and Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo", 2025
(arXiv:2508.15706), Algorithm 1.  Notes and the choice of ``outer_lr``: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Any, Optional

from .compressed import RESIDUAL, CodecExchange
from .diloco import DiLoCo
from .registry import register
from .resize import COPY, FOLLOW
from .schema import Hyperparameter, Schema, choice

__all__ = ["SparseLoCo"]


@register
class SparseLoCo(DiLoCo):
    """SparseLoCo (Sarfi et al. 2025, arXiv:2508.15706): ``e_i <- beta e_i + Delta_i``; send ``s_i = Q(TopK(e_i))``;
    ``e_i <- e_i - s_i``; ``theta <- theta_start - outer_lr mean_i s_i``.

    DiLoCo's inner loop and its compressed exchange (:mod:`.compressed`) with outer momentum 0: the accumulator,
    kept per rank as ``codec_residual``, is the momentum (beta 0.95), and every rank's theta_start stays the same.
    ``aggregate="senders"`` (the default, as the paper's code): each entry's mean over the ranks that sent it;
    ``"ranks"``: Algorithm 1's sum / R, whose steps shrink where the ranks' picks differ (docs/algorithms.md "SparseLoCo").
    """

    name = "sparseloco"
    inner_role = "local"
    inner_rule = ("H steps theta_i <- inner(theta_i, g_i); e_i <- beta e_i + (theta_start - theta_i); s_i = Q(TopK(e_i)); "
                  "e_i <- e_i - s_i; theta <- theta_start - outer_lr mean_i s_i (over senders, or ranks)  (the paper, arXiv:2508.15706, Algorithm 1: inner = AdamW)")
    listing_order = 33
    # DiLoCo's entries but its outer momentum (the accumulator replaces it) and the switch of error feedback (always on).
    schema = Schema(*(e for e in DiLoCo.schema if e.name not in ("outer_momentum", "outer_nesterov", "codec_feedback"))).with_defaults(
        period=15, outer_lr=1.0, codec="topk", codec_beta=0.95,
    ) + Schema(Hyperparameter("aggregate", "senders", choice("senders", "ranks"),
                              "each entry's mean over the ranks that sent it (the paper's code) or over all ranks (Algorithm 1)"))
    outer_momentum, outer_nesterov = 0.0, False
    evaluates = "average"
    state_arrays = ("theta_start", "momentum_buffer", "codec_residual")
    state_scalars = ("outer_steps",)
    # theta_start is the same on every rank, an inner momentum belongs to its rank's parameters, and the accumulators
    # are owed to the mean: each new rank takes their mean, which keeps it (docs/codecs.md).
    resize_rules = {"theta_start": COPY, "momentum_buffer": FOLLOW, "codec_residual": RESIDUAL, "outer_steps": COPY}
    training_defaults = {"lr": 0.05, "momentum": 0.9, "period": 8}
    update_goal = 1.5  # a step in fused-SGD units (bench update): DiLoCo's outer step plus the codec's selection and scatter
    wire_summary = "the codec's payload (topk: 0.23 bits per parameter) every `period` steps, all-gathered"

    def _codec_exchange(self, like: Any, residual: Optional[Any] = None) -> CodecExchange:
        return CodecExchange(self._codec, like, self.workers.size, residual, self.codec_beta,
                             senders=self.aggregate == "senders")
