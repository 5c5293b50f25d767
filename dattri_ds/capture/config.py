"""Component configuration dataclasses and the ``from_dict`` that rejects unknown keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from dattri_ds.io import schema
from dattri_ds.errors import ConfigError
from dattri_ds.ops.projection import ProjectionConfig

__all__ = ["CaptureConfig", "ProjectionConfig", "from_dict"]

C = TypeVar("C")


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    """How gradients are captured (semantics: see dattri_ds/capture/semantics.py)."""

    include: tuple[str, ...] = ()
    """fnmatch patterns of module names to capture; empty = every supported layer."""

    exclude: tuple[str, ...] = ()
    """fnmatch patterns of module names to leave out (they are not reported as unsupported)."""

    strict: bool = False
    """Raise UnsupportedLayerError when a trainable module has no LayerKind (else warn)."""

    loss_reduction: Literal["token_mean", "sum", "example_mean"] = "token_mean"
    """How the training loop reduces token losses of a micro-batch (HF: ``token_mean``)."""

    per_example_loss: Literal["sum", "mean"] = "sum"
    """The per-example loss whose gradient is captured: sum or mean over its valid tokens."""

    backward_scale: float = field(default=1.0, metadata=schema.bounds(ne=0))
    """Constant the loop multiplies the reduced loss by before ``backward`` (e.g. ``1/4`` for
    a loop dividing by 4 accumulation steps). Engine adapters supply it themselves."""

    label_shift: int = field(default=1, metadata=schema.bounds(ge=0, le=1))
    """Causal-LM label shift: position t predicts token t + shift. 1 for Hugging Face causal
    LMs (the model shifts internally), 0 when the loop passes labels already shifted
    (Megatron) or for non-causal heads."""

    ignore_index: int = -100
    """Label value of positions without loss."""

    allow_shared: bool = False
    """Allow a module to run more than once per forward (weight sharing): its gradients are
    summed. When False this is an error naming the module."""

    on_nonfinite: Literal["raise", "skip"] = "skip"
    """NaN/inf in a captured gradient: ``skip`` drops only the examples that have one, with a
    warning naming the layer and their sample ids (the micro-batch when all of them do),
    ``raise`` raises CaptureError."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Keep captured factors in this dtype (None = the model's); inner products run in fp32."""

    projection: ProjectionConfig | None = None
    """Project each micro-batch right after backward (compact storage); None keeps factors.
    ``ProjectionConfig()`` is the measured projected default: ``auto`` (sparse JL, Kronecker
    only on layers where it pays) at k = 4096 per layer (docs/attribution_fidelity.md)."""

    whiten: Literal["kfac", "ekfac"] | None = None
    """Whiten every example by a checkpoint's curvature factors before projecting:
    ``r = (F + lambda)^-p/2 g`` (``p = KFACConfig.power``) in the Kronecker eigenbasis
    (``KFACFactors.whiten``), so
    ``<P r_n, P r_q>`` is the K-FAC/EK-FAC influence up to the projection's JL error. The
    rows a projected store for ``kfac``/``ekfac`` (and their trajectories) should hold:
    they keep >= 90% of the exact LDS where projecting raw gradients keeps ~10%. Needs the
    factors: ``GradientCapture(..., factors=)`` or ``dattri_ds.collect(..., factors=)``."""

    max_pending: int = field(default=64, metadata=schema.bounds(ge=1, le=2**20))
    """Warn when more than this many captured batches wait to be popped (no callback)."""

    def __post_init__(self) -> None:
        schema.check(self, "capture")
        if self.whiten is not None and self.projection is None:
            raise ConfigError(f"capture: whiten='{self.whiten}' without a projection stores "
                              f"the exact whitened rows [B, O*I'] per layer; set "
                              f"capture.projection (e.g. ProjectionConfig()) or whiten=None")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CaptureConfig:
        return from_dict(cls, d, "capture")


def from_dict(cls: type[C], d: dict[str, Any], where: str) -> C:
    """Build a frozen config dataclass from a JSON object with :func:`dattri_ds.io.schema.parse`:
    strict types and ranges from the type hints (nested dataclasses included), unknown keys
    refused at every level."""
    return schema.parse(cls, d, where)
