"""Reusable gradient operations, routed ghost vs dense by the cost model."""

from dattri_ds.ops.cost import CostModel, Decision, PathCost, Roofline, estimate
from dattri_ds.ops.inner import (
    GradAccumulator, cosine, cross_gram, default_cost_model, grad_sum, layer_cross_gram,
    layer_sq_norms, materialize, norms, project, project_batch, sq_norms,
)
from dattri_ds.ops.projection import ProjectionConfig, Projector, kron_dims, stable_seed

__all__ = [
    "CostModel", "Decision", "PathCost", "Roofline", "estimate", "GradAccumulator", "cosine",
    "cross_gram", "default_cost_model", "grad_sum", "layer_cross_gram", "layer_sq_norms",
    "materialize", "norms", "project", "project_batch", "sq_norms", "ProjectionConfig",
    "Projector", "kron_dims", "stable_seed",
]
