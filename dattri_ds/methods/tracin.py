"""TracIn: attribution summed along the training trajectory (Pruthi et al., 2020).

``score[n, q] = sum_c lr_c <g_n^(c), M_c g_q^(c)>``: the gradients of train example n and
query q at checkpoint c, learning rate ``lr_c`` in effect after c, and the inner method's
query preconditioning ``M_c`` (identity for ``graddot``; ``gradcos`` normalizes per
checkpoint). Sign convention of ``methods.base``: positive = n lowered q's loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from dattri_ds.errors import ConfigError, ShapeError
from dattri_ds.gradient import GradBatch
from dattri_ds.methods.base import Attributor, Scores, get_attributor
from dattri_ds.ops.cost import CostModel

__all__ = ["Checkpoint", "TracIn"]


class Checkpoint(NamedTuple):
    """Gradients of one checkpoint of the trajectory.

    Attributes:
        train: training gradients at this checkpoint (streamed once, same ids and order at
            every checkpoint).
        query: query gradients ``[Q]`` at this checkpoint.
        lr: learning rate weighting this checkpoint.
    """

    train: Iterable[GradBatch]
    query: GradBatch
    lr: float


class TracIn(Attributor, name="tracin"):
    """Learning-rate-weighted sum of per-checkpoint scores of an inner method.

    Args:
        inner: per-checkpoint method name or instance (default ``graddot``).
        layers, cost: as for Attributor (used when ``inner`` is a name).

    ``scores(train, query)`` is one checkpoint with ``lr = 1``; ``trajectory_scores`` sums.
    """

    def __init__(self, *, inner: str | Attributor = "graddot", layers: Iterable[str] | None = None,
                 cost: CostModel | None = None) -> None:
        super().__init__(layers=layers, cost=cost)
        if isinstance(inner, str):
            if inner == self.name:
                raise ConfigError("TracIn(inner='tracin') would recurse; use e.g. 'graddot'")
            inner = get_attributor(inner)(layers=layers, cost=cost)
        self.inner = inner

    def precondition(self, query: GradBatch) -> GradBatch:
        return self.inner.precondition(query)

    def query_scale(self, query, layers):
        return self.inner.query_scale(query, layers)

    def train_scale(self, train, layers):
        return self.inner.train_scale(train, layers)

    def trajectory_scores(self, checkpoints: Iterable[Checkpoint]) -> Scores:
        """``sum_c lr_c * scores_c`` over the checkpoints.

        Raises:
            ShapeError: train ids (or their order) or the query count differ between
                checkpoints, naming the checkpoint.
            ConfigError: no checkpoint was given.
        """
        ids: tuple[str, ...] | None = None
        total: torch.Tensor | None = None
        for c, ck in enumerate(checkpoints):
            s = self.scores(ck.train, ck.query)
            if ids is None:
                ids, total = s.train_ids, s.values * float(ck.lr)
                continue
            if s.train_ids != ids or s.values.shape != total.shape:
                first = next((i for i, (x, y) in enumerate(zip(ids, s.train_ids)) if x != y),
                             min(len(ids), len(s.train_ids)))
                raise ShapeError(
                    f"Checkpoint {c}: training examples differ from checkpoint 0 (first "
                    f"difference at row {first}; {len(s.train_ids)} vs {len(ids)} rows, "
                    f"scores {tuple(s.values.shape)} vs {tuple(total.shape)}); stream the "
                    f"same examples in the same order at every checkpoint")
            total = total + s.values * float(ck.lr)
        if ids is None:
            raise ConfigError("TracIn.trajectory_scores() needs at least one Checkpoint")
        return Scores(ids, total)
