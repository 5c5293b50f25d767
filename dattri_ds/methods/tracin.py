"""Trajectory attribution: per-checkpoint scores of an inner method, summed over checkpoints.

``score[n, q] = sum_c w_c <g_n^(c), M_c g_q^(c)>``: the gradients of train example n and
query q at checkpoint c, the inner method's query preconditioning ``M_c`` at c, and a
weight ``w_c`` (``Trajectory``'s ``weighting``; ``lr``: TracIn, Pruthi et al., 2020;
``normalized`` gives every checkpoint an equal say in each query's ranking, whatever the
scale of its curvature or gradients). Positive = n lowered q's loss (``methods.base``).

Registered trajectories (one implementation, ``Trajectory``, differing in defaults):

* ``tracin``: inner ``graddot`` (``M_c = I``), lr-weighted.
* ``ekfac-trajectory`` / ``kfac-trajectory``: inner ``ekfac`` / ``kfac`` with curvature
  factors fitted at every checkpoint (``Checkpoint.factors``, ``M_c = (F_c + lambda_c)^-p``),
  normalized weights by default. Curvature fitted along the trajectory sees the directions the
  model moved in early, which the final checkpoint's (nearly converged) Fisher underweights;
  on the LDS benchmarks it is the most faithful method of the library (``benchmarks/lds.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Literal, NamedTuple

import torch

from dattri_ds.errors import ConfigError, ShapeError
from dattri_ds.gradient import GradBatch
from dattri_ds.methods.base import Attributor, Scores, get_attributor
from dattri_ds.ops.cost import CostModel
from dattri_ds.ops.projection import Projector

__all__ = ["Checkpoint", "Trajectory", "TracIn", "EKFACTrajectory", "KFACTrajectory",
           "WEIGHTINGS"]

#: How checkpoints are weighted: by their learning rate, all equally, or each checkpoint's
#: scores scaled to unit standard deviation over the training examples, per query.
WEIGHTINGS = ("lr", "uniform", "normalized")


class Checkpoint(NamedTuple):
    """Gradients (and, for curvature methods, factors) of one checkpoint of the trajectory.

    Attributes:
        train: training gradients at this checkpoint (streamed once, same ids and order at
            every checkpoint).
        query: query gradients ``[Q]`` at this checkpoint.
        lr: learning rate in effect after this checkpoint (the weight when
            ``weighting="lr"``).
        factors: eigendecomposed ``KFACFactors`` fitted at this checkpoint (curvature inner
            methods only).
        step: the optimizer step of this checkpoint (``source`` counts each segment's
            steps from it; the other methods do not read it).
    """

    train: Iterable[GradBatch]
    query: GradBatch
    lr: float = 1.0
    factors: Any = None
    step: int | None = None


class Trajectory(Attributor):
    """Weighted sum over checkpoints of an inner method's scores (module docstring).

    Args:
        inner: per-checkpoint method name or instance (default: the class's
            ``default_inner``). A curvature name (``kfac``/``ekfac``) is instantiated per
            checkpoint with that checkpoint's ``factors``.
        weighting: ``lr`` (``w_c = lr_c``), ``uniform`` (``w_c = 1``) or ``normalized``
            (``w_c[q] = 1 / std_n score_c[n, q]``); default: the class's
            ``default_weighting``.
        layers, cost, projector: as for Attributor (passed to the inner methods).
        inner_kwargs: further arguments of the inner method (e.g. ``whitened=True``).

    ``scores(train, query)`` scores one checkpoint with weight 1 (non-curvature inner
    only); ``trajectory_scores`` sums over checkpoints.
    """

    default_inner: ClassVar[str] = "graddot"
    default_weighting: ClassVar[str] = "lr"

    @classmethod
    def reads_schedule(cls, weighting: str | None = None) -> bool:
        """Whether scoring reads every checkpoint's ``lr`` and ``step`` (``Checkpoint``):
        under ``weighting="lr"`` (None: the class's ``default_weighting``). The tools read
        them from the run only then, so a run without recorded rates scores under the other
        weightings."""
        return (weighting or cls.default_weighting) == "lr"

    def __init__(self, *, inner: str | Attributor | None = None,
                 weighting: Literal["lr", "uniform", "normalized"] | None = None,
                 layers: Iterable[str] | None = None, cost: CostModel | None = None,
                 projector: Projector | None = None, **inner_kwargs) -> None:
        super().__init__(layers=layers, cost=cost, projector=projector)
        self.inner_kwargs = inner_kwargs
        inner = self.default_inner if inner is None else inner
        self.weighting = self.default_weighting if weighting is None else weighting
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"weighting must be one of {WEIGHTINGS}, got '{self.weighting}'")
        if isinstance(inner, str):
            cls = get_attributor(inner)
            if issubclass(cls, Trajectory):
                raise ConfigError(f"A trajectory's inner method cannot be the trajectory "
                                  f"'{inner}' (it would recurse); use e.g. 'graddot' or 'ekfac'")
            self._inner_cls = cls
            self.inner = (None if _needs_factors(cls)
                          else cls(layers=layers, cost=cost, projector=projector,
                                   **inner_kwargs))
        else:
            self._inner_cls, self.inner = type(inner), inner

    # ---- one checkpoint -------------------------------------------------------------------
    def _single(self) -> Attributor:
        if self.inner is None:
            raise ConfigError(f"{type(self).__name__} with a curvature inner method has no "
                              f"factors outside a checkpoint: call trajectory_scores() with "
                              f"Checkpoint(..., factors=...)")
        return self.inner

    def precondition(self, query: GradBatch) -> GradBatch:
        return self._single().precondition(query)

    def query_scale(self, query, layers):
        return self._single().query_scale(query, layers)

    def train_scale(self, train, layers):
        return self._single().train_scale(train, layers)

    def at(self, c: int, ck: Checkpoint) -> Attributor:
        """The inner attributor of checkpoint ``c`` (built with its factors when needed)."""
        if ck.factors is not None:
            if not _needs_factors(self._inner_cls):
                raise ConfigError(f"Checkpoint {c} has factors but the inner method "
                                  f"'{self._inner_cls.name}' takes none; drop factors= or use "
                                  f"a curvature method")
            return self._inner_cls(factors=ck.factors, layers=self.layers, cost=self.cost,
                                   projector=self.projector, **self.inner_kwargs)
        if self.inner is None:
            raise ConfigError(f"Checkpoint {c} has no factors but the inner method "
                              f"'{self._inner_cls.name}' needs them: fit_factors() on that "
                              f"checkpoint's training gradients and pass "
                              f"Checkpoint(..., factors=...)")
        return self.inner

    def weighted(self, ck: Checkpoint, values: torch.Tensor) -> torch.Tensor:
        """``w_c * score_c`` ``[N, Q]`` under ``weighting``."""
        if self.weighting == "lr":
            return values * float(ck.lr)
        if self.weighting == "normalized" and values.shape[0] > 1:
            std = values.std(0, keepdim=True)
            return torch.where(std > 0, values / std.clamp_min(1e-30), values)
        return values

    # ---- the trajectory -------------------------------------------------------------------
    def trajectory_scores(self, checkpoints: Iterable[Checkpoint],
                          per_checkpoint: list[torch.Tensor] | None = None) -> Scores:
        """``sum_c w_c * scores_c`` over the checkpoints (streamed: one at a time).

        Args:
            checkpoints: the checkpoints, possibly a generator that opens each lazily.
            per_checkpoint: if given, each checkpoint's weighted ``[N, Q]`` contribution is
                appended to it.

        Raises:
            ShapeError: train ids (or their order) or the query count differ between
                checkpoints, naming the checkpoint.
            ConfigError: no checkpoint was given, or factors are missing/unexpected.
        """
        ids: tuple[str, ...] | None = None
        total: torch.Tensor | None = None
        for c, ck in enumerate(checkpoints):
            s = self.at(c, ck).scores(ck.train, ck.query)
            part = self.weighted(ck, s.values)
            if per_checkpoint is not None:
                per_checkpoint.append(part)
            if ids is None:
                ids, total = s.train_ids, part
                continue
            if s.train_ids != ids or s.values.shape != total.shape:
                first = next((i for i, (x, y) in enumerate(zip(ids, s.train_ids)) if x != y),
                             min(len(ids), len(s.train_ids)))
                raise ShapeError(
                    f"Checkpoint {c}: training examples differ from checkpoint 0 (first "
                    f"difference at row {first}; {len(s.train_ids)} vs {len(ids)} rows, "
                    f"scores {tuple(s.values.shape)} vs {tuple(total.shape)}); stream the "
                    f"same examples in the same order at every checkpoint")
            total = total + part
        if ids is None:
            raise ConfigError(f"{type(self).__name__}.trajectory_scores() needs at least one "
                              f"Checkpoint")
        return Scores(ids, total)


def _needs_factors(cls: type[Attributor]) -> bool:
    from dattri_ds.methods.curvature import KFAC
    return issubclass(cls, KFAC)


class TracIn(Trajectory, name="tracin"):
    """TracIn: learning-rate-weighted sum of per-checkpoint ``graddot`` scores."""


class EKFACTrajectory(Trajectory, name="ekfac-trajectory"):
    """EK-FAC fitted at every checkpoint, per-query normalized scores summed.

    ``normalized`` beat ``uniform`` by 0.000-0.012 LDS in every damping and data setting
    measured on ``benchmarks/lds.py`` (and both beat the final checkpoint by 0.05-0.13).
    """

    default_inner = "ekfac"
    default_weighting = "normalized"
    text_weight = 0.25


class KFACTrajectory(Trajectory, name="kfac-trajectory"):
    """K-FAC fitted at every checkpoint, per-query normalized scores summed."""

    default_inner = "kfac"
    default_weighting = "normalized"
    text_weight = 0.5
