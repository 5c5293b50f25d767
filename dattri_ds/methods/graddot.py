"""Gradient dot product and gradient cosine: attribution without curvature.

``graddot``: ``score[n, q] = <g_n, g_q>``. ``gradcos``: ``<g_n, g_q> / (||g_n|| ||g_q||)``
with whole-model norms over the scored layers (zero gradients score 0).
"""

from __future__ import annotations

import torch

from dattri_ds.gradient import GradBatch
from dattri_ds.methods.base import Attributor
from dattri_ds.ops.inner import norms

__all__ = ["GradDot", "GradCos"]

#: Norms below this count as zero (their scores become 0 instead of inf).
EPS = 1e-12


class GradDot(Attributor, name="graddot"):
    """``score[n, q] = <g_n, g_q>``: the query is used as is."""

    def precondition(self, query: GradBatch) -> GradBatch:
        return query


class GradCos(GradDot, name="gradcos"):
    """Cosine of whole-model gradients: both sides divided by their norms ``[B]``, ``[Q]``."""

    def query_scale(self, query: GradBatch, layers: tuple[str, ...]) -> torch.Tensor:
        return _inverse_norms(query, layers, self)

    def train_scale(self, train: GradBatch, layers: tuple[str, ...]) -> torch.Tensor:
        return _inverse_norms(train, layers, self)


def _inverse_norms(batch: GradBatch, layers: tuple[str, ...], m: Attributor) -> torch.Tensor:
    n = norms(batch, layers, m.cost)
    return torch.where(n > EPS, 1.0 / n.clamp_min(EPS), torch.zeros_like(n))
