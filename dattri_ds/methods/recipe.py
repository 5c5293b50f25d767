"""Recipe: how one attribution method scores projected (or exact) rows, checkpoint by checkpoint.

The same recipe serves a store (``tools/attribute.py``: rows already projected or whitened
by ``collect``, factors loaded) and in-memory captures (``benchmarks/lds.py``: rows projected or
whitened here, factors fitted here):

* the training rows live in the store's space: exact (factorized), projected per layer
  (``P g``), or whitened by the checkpoint's curvature factors, then projected
  (``P (F + lambda)^-p/2 g``, ``whitened``);
* curvature methods (``kfac``/``ekfac`` and their trajectories) precondition the exact query
  and then project it (``Attributor(projector=...)``), unless the factors were fitted in
  the projected space (``logra``: LoGra) or the rows are whitened (the query is whitened by
  the same factors, scores are dot products); other methods score the projected query;
* trajectory methods (``tracin``, ``*-trajectory``) read every checkpoint and sum their
  scores (``Trajectory.trajectory_scores``), the others read the last one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TypeVar

from dattri_ds.capture.config import CaptureConfig
from dattri_ds.errors import ConfigError
from dattri_ds.gradient import GradBatch
from dattri_ds.methods import (
    KFAC, Checkpoint, Scores, Trajectory, fit_factors, get_attributor, make_attributor,
)
from dattri_ds.ops.kronecker import KFACConfig, KFACFactors
from dattri_ds.ops.projection import ProjectionConfig, Projector

__all__ = ["Recipe"]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """One attribution method on rows in one space.

    Raises:
        ConfigError: an unknown method, whitened or LoGra rows without a curvature method,
            or LoGra without a Kronecker projection.
    """

    method: str
    """A registered attribution method (``make_attributor``)."""

    projection: ProjectionConfig | None = None
    """The projection of the training rows (None: exact, factorized rows)."""

    whitened: bool = False
    """The rows were whitened by each checkpoint's factors before projection."""

    logra: bool = False
    """The factors are fitted in the (Kronecker) projected space: LoGra."""

    weighting: str | None = None
    """Trajectory methods: checkpoint weights (None: the method's default)."""

    def __post_init__(self) -> None:
        get_attributor(self.method)  # an unknown name is a ConfigError listing them
        if (self.whitened or self.logra) and not self.curvature:
            raise ConfigError(f"Recipe: --method {self.method} cannot score "
                              f"{'whitened' if self.whitened else 'LoGra'} rows; use a "
                              f"curvature method (kfac, ekfac or their trajectories)")
        if self.logra and (self.projection is None or not self.projection.strategy.factorized):
            raise ConfigError(f"Recipe: LoGra factors need a Kronecker projection, got "
                              f"{None if self.projection is None else self.projection.kind}")

    @property
    def trajectory(self) -> bool:
        """Whether the method reads every checkpoint (TracIn and the trajectories)."""
        return issubclass(get_attributor(self.method), Trajectory)

    @property
    def text_weight(self) -> float:
        """The text-overlap prior's default weight for this method
        (``Attributor.text_weight``)."""
        return get_attributor(self.method).text_weight

    @property
    def inner(self) -> str:
        """The per-checkpoint method (the method itself unless it is a trajectory)."""
        cls = get_attributor(self.method)
        return cls.default_inner if issubclass(cls, Trajectory) else self.method

    @property
    def curvature(self) -> bool:
        """Whether the per-checkpoint method preconditions by K-FAC/EK-FAC factors."""
        return issubclass(get_attributor(self.inner), KFAC)

    @cached_property
    def projector(self) -> Projector | None:
        """The rows' projector (its matrices are built once and shared)."""
        return None if self.projection is None else Projector(self.projection)

    @property
    def factor_projection(self) -> ProjectionConfig | None:
        """The space stored factors are loaded into (``KFACFactors.load(projector=)``):
        the rows' projection, except for whitened rows (exact factors)."""
        return None if self.whitened else self.projection

    def select(self, checkpoints: Sequence[T]) -> Sequence[T]:
        """The checkpoints the method reads: all (trajectories) or the last one."""
        return checkpoints if self.trajectory else checkpoints[-1:]

    def query_capture(self, capture: CaptureConfig) -> CaptureConfig:
        """``capture`` for the query: exact for curvature methods (preconditioned, then
        projected), in the rows' projected space otherwise."""
        return replace(capture, projection=None if self.curvature else self.projection)

    def query(self, batch: GradBatch) -> GradBatch:
        """An exact query batch brought where ``query_capture`` would have captured it."""
        from dattri_ds.ops.space import project_batch

        if self.curvature or self.projector is None:
            return batch
        return project_batch(batch, self.projector)

    def fit(self, train: Iterable[GradBatch], config: KFACConfig | None = None
            ) -> KFACFactors:
        """The checkpoint's factors from exact factorized rows (``fit_factors``): EK-FAC for
        ``ekfac`` methods, in the projected space for LoGra."""
        return fit_factors(train, config=config or KFACConfig(), ekfac=self.inner == "ekfac",
                           projector=self.projector if self.logra else None)

    def rows(self, train: Iterable[GradBatch], factors: KFACFactors | None = None
             ) -> list[GradBatch]:
        """Exact factorized training rows brought into the rows' space, as ``collect``
        stores them (whitened rows need the checkpoint's ``factors``)."""
        from dattri_ds.ops.space import project_batch

        if self.whitened:
            whiten = make_attributor(self.inner, factors=factors, projector=self.projector,
                                     whitened=True)
            return [whiten.train_rows(b) for b in train]
        if self.projector is None:
            return list(train)
        return [project_batch(b, self.projector) for b in train]

    def score(self, checkpoints: Iterable[Checkpoint],
              per_checkpoint: list | None = None) -> Scores:
        """``[N, Q]`` scores over ``checkpoints`` (already ``select``-ed): a trajectory sums
        them (``per_checkpoint`` receives each one's ``[N, Q]`` share), the other methods
        score the first."""
        projector = None if self.logra else self.projector
        extra = {"whitened": True} if self.whitened else {}
        if self.trajectory:
            kwargs = {} if self.weighting is None else {"weighting": self.weighting}
            attributor = make_attributor(self.method, projector=projector, **kwargs, **extra)
            return attributor.trajectory_scores(checkpoints, per_checkpoint=per_checkpoint)
        ck = next(iter(checkpoints))
        kwargs = {"factors": ck.factors, **extra} if ck.factors is not None else {}
        return make_attributor(self.method, projector=projector, **kwargs).scores(ck.train,
                                                                                 ck.query)
