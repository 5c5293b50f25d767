"""dattri-ds: per-example gradients, attribution and online data selection at training scale.

``import dattri_ds`` needs only torch; DeepSpeed and Megatron integrations import lazily.
"""

from dattri_ds.capture.callbacks import TrainingCallback
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.capture.hooks import GradientCapture
from dattri_ds.errors import (
    CaptureError, ConfigError, DattriDSError, ShapeError, StoreMismatchError, UnsupportedLayerError,
)
from dattri_ds.gradient import Dense, Factorized, GradBatch, LayerGrad, ShardInfo, Space
from dattri_ds.layers import LayerKind, kind_for, registered_kinds
from dattri_ds.ops import (
    CostModel, GradAccumulator, ProjectionConfig, Projector, Roofline, cosine, cross_gram,
    grad_sum, layer_cross_gram, materialize, norms, project, project_batch, sq_norms,
)
from dattri_ds.ops.kronecker import KFACConfig, KFACFactors
from dattri_ds.capture.collect import collect
from dattri_ds.capture.spill import Spill
from dattri_ds.methods import (
    Attributor, Checkpoint, Scores, fit_factors, get_attributor, make_attributor,
    registered_attributors,
)
from dattri_ds import integrations  # noqa: F401  (registers the engine adapters)

__version__ = "0.1.0"

__all__ = [
    "GradientCapture", "collect", "Spill", "CaptureConfig", "ProjectionConfig", "TrainingCallback",
    "Factorized", "Dense", "LayerGrad", "GradBatch", "ShardInfo", "Space",
    "LayerKind", "kind_for", "registered_kinds",
    "CostModel", "Roofline", "Projector", "GradAccumulator",
    "materialize", "layer_cross_gram", "cross_gram", "sq_norms", "norms", "cosine",
    "grad_sum", "project", "project_batch",
    "KFACConfig", "KFACFactors", "Attributor", "Checkpoint", "Scores", "fit_factors",
    "get_attributor", "make_attributor", "registered_attributors",
    "DattriDSError", "ConfigError", "UnsupportedLayerError", "ShapeError",
    "StoreMismatchError", "CaptureError",
]
