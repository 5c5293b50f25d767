"""Curation methods: one registered class per way of scoring a pool row against a target
(cosine, adam-cosine, trajectory, content, combined; formulas: docs/curation.md,
"Methods"). A method has two parts: ``block`` (streamed: one block of rows per checkpoint
in, one score per row out) and ``finalize`` (whole pool: the gathered per-row columns in,
the ranked score out)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from dattri_ds.registry import Registry

if TYPE_CHECKING:
    from dattri_ds.selection.curate.config import CurateConfig

__all__ = ["CurationMethod", "METHODS", "get_method", "cosine_scores", "zscore"]


def cosine_scores(rows: torch.Tensor, target: torch.Tensor, aggregate: str = "mean"
                  ) -> torch.Tensor:
    """``[n]`` aggregated cosines of rows ``[n, P]`` against targets ``[Q, P]`` (float64)."""
    x = rows.double()
    t = target.double()
    xn = x.norm(dim=1, keepdim=True)
    tn = t.norm(dim=1, keepdim=True)
    cos = (x @ t.T) / (xn * tn.T)
    cos = torch.nan_to_num(cos, nan=0.0, posinf=0.0, neginf=0.0)
    return cos.mean(1) if aggregate == "mean" else cos.max(1).values


def zscore(x: np.ndarray) -> np.ndarray:
    """``(x - mean) / std`` over the pool (zeros when all equal)."""
    x = np.asarray(x, dtype=np.float64)
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else np.zeros_like(x)


class CurationMethod:
    """A way of scoring pool rows; subclasses register with ``name=``."""

    name: ClassVar[str]
    gradient: ClassVar[bool] = True
    """Reads the store's rows (False: the content prior alone)."""
    content: ClassVar[bool] = False
    """Needs the content prior column."""

    def __init_subclass__(cls, name: str | None = None, **kw) -> None:
        super().__init_subclass__(**kw)
        METHODS.register_class(cls, name)

    def __init__(self, config: CurateConfig) -> None:
        self.config = config

    def checkpoints(self, tags: Sequence[str]) -> list[str]:
        """The checkpoints read (oldest first): the last one unless a trajectory."""
        return list(tags[-1:])

    @property
    def precondition(self) -> str:
        """``adam`` when the targets are Adam-preconditioned, else ``none``."""
        return "none"

    def block(self, blocks: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor],
              weights: Mapping[str, float]) -> torch.Tensor:
        """``[n]`` scores of one block: ``blocks[tag]`` ``[n, P]``, ``targets[tag]``
        ``[Q, P]``, ``weights[tag]`` the checkpoint's learning rate."""
        tag = self.checkpoints(list(blocks))[-1]
        return cosine_scores(blocks[tag], targets[tag], self.config.aggregate)

    def finalize(self, grad: np.ndarray | None, content: np.ndarray | None) -> np.ndarray:
        """``[N]`` ranked scores from the gathered columns."""
        return np.asarray(grad, dtype=np.float64)


METHODS: Registry[type[CurationMethod]] = Registry(
    "curation method", hint="register one with class X(CurationMethod, name='x')")


def get_method(name: str) -> type[CurationMethod]:
    """The method class called ``name`` (ConfigError listing the known ones)."""
    return METHODS.lookup(name)


class Cosine(CurationMethod, name="cosine"):
    """Gradient cosine at the last checkpoint."""


class AdamCosine(CurationMethod, name="adam-cosine"):
    """Gradient cosine against the Adam-preconditioned target (LESS), last checkpoint."""

    @property
    def precondition(self) -> str:
        return "adam"


class TrajectoryCosine(CurationMethod, name="trajectory"):
    """``sum_c lr_c cos_c``: cosines over every checkpoint weighted by learning rate."""

    def checkpoints(self, tags: Sequence[str]) -> list[str]:
        return list(tags)

    @property
    def precondition(self) -> str:
        return self.config.precondition

    def block(self, blocks, targets, weights):
        return sum(float(weights[t]) * cosine_scores(blocks[t], targets[t],
                                                     self.config.aggregate)
                   for t in blocks)


class Content(CurationMethod, name="content"):
    """The content prior alone (DSIR-style hashed n-gram log-ratio, no gradient)."""

    gradient = False
    content = True

    def checkpoints(self, tags):
        return []

    def finalize(self, grad, content):
        return np.asarray(content, dtype=np.float64)


class Combined(CurationMethod, name="combined"):
    """``z(gradient method) + content_weight * z(content prior)``."""

    content = True

    def __init__(self, config):
        super().__init__(config)
        self.inner = get_method(config.combine_with)(config)

    def checkpoints(self, tags):
        return self.inner.checkpoints(tags)

    @property
    def precondition(self) -> str:
        return self.inner.precondition

    def block(self, blocks, targets, weights):
        return self.inner.block(blocks, targets, weights)

    def finalize(self, grad, content):
        return zscore(grad) + self.config.content_weight * zscore(content)
