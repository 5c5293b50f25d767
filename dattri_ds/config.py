"""Component configuration dataclasses and the ``from_dict`` that rejects unknown keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from dattri_ds.errors import ConfigError
from dattri_ds.ops.projection import ProjectionConfig
from dattri_ds.semantics import LOSS_REDUCTIONS, PER_EXAMPLE_LOSSES

__all__ = ["CaptureConfig", "ProjectionConfig", "from_dict"]

C = TypeVar("C")


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    """How gradients are captured (semantics: see dattri_ds/semantics.py)."""

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

    backward_scale: float = 1.0
    """Constant the loop multiplies the reduced loss by before ``backward`` (e.g. ``1/4`` for
    a loop dividing by 4 accumulation steps). Engine adapters supply it themselves."""

    label_shift: int = 1
    """Causal-LM label shift: position t predicts token t + shift (0 for non-causal heads)."""

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
    """Project each micro-batch right after backward (compact storage); None keeps factors."""

    max_pending: int = 64
    """Warn when more than this many captured batches wait to be popped (no callback)."""

    def __post_init__(self) -> None:
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ConfigError(f"capture.loss_reduction must be one of {LOSS_REDUCTIONS}, "
                              f"got '{self.loss_reduction}'")
        if self.per_example_loss not in PER_EXAMPLE_LOSSES:
            raise ConfigError(f"capture.per_example_loss must be one of {PER_EXAMPLE_LOSSES}, "
                              f"got '{self.per_example_loss}'")
        if self.on_nonfinite not in ("raise", "skip"):
            raise ConfigError(f"capture.on_nonfinite must be 'raise' or 'skip', "
                              f"got '{self.on_nonfinite}'")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"capture.dtype must be float32, bfloat16, float16 or null, "
                              f"got '{self.dtype}'")
        if self.backward_scale == 0:
            raise ConfigError("capture.backward_scale must be non-zero")
        if self.label_shift < 0:
            raise ConfigError(f"capture.label_shift must be >= 0, got {self.label_shift}")
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CaptureConfig:
        return from_dict(cls, d, "capture", nested={"projection": ProjectionConfig})


def from_dict(cls: type[C], d: dict[str, Any], where: str,
              nested: dict[str, type] | None = None) -> C:
    """Build a frozen config dataclass, refusing unknown keys with the allowed ones listed.

    ``nested`` maps field names to config classes built from sub-dicts the same way.
    """
    d = dict(d)
    for key, sub in (nested or {}).items():
        if isinstance(d.get(key), dict):
            d[key] = from_dict(sub, d[key], f"{where}.{key}")
    allowed = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ConfigError(f"Unknown key(s) {unknown} in '{where}'; allowed keys: {allowed}")
    return cls(**d)
