"""Scoring: candidates x target -> ``scores [C]`` (and the candidate gram for GREATS).

``score_b = <g_b, g_target>`` summed over the target's layers, routed ghost vs dense by the
cost model: a factorized candidate against a dense target costs ``2*T*I*O`` per example and
never builds the per-example weight gradient (``cross_dense``).
"""

from __future__ import annotations

import torch

from dattri_ds.errors import ShapeError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops import CostModel, cross_gram

__all__ = ["alignment_scores", "redundancy_gram"]


def alignment_scores(candidates: GradBatch, target: GradBatch,
                     cost: CostModel | None = None) -> torch.Tensor:
    """``[C]`` inner products of every candidate's gradient with the (one-row) target."""
    if target.batch_size != 1:
        raise ShapeError(f"alignment_scores: the target must hold one (mean) gradient row, got "
                         f"{target.batch_size} rows (sample ids {list(target.sample_ids)[:4]}); "
                         f"pass a one-row GradBatch such as TargetProvider.get(step)")
    return cross_gram(candidates, target, layers=list(target.layers), cost=cost)[:, 0]


def redundancy_gram(candidates: GradBatch, layers: list[str],
                    cost: CostModel | None = None) -> torch.Tensor:
    """``[C, C]`` pairwise inner products among candidates (GREATS' redundancy term)."""
    return cross_gram(candidates, candidates, layers=layers, cost=cost)
