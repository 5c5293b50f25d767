"""K-FAC / EK-FAC influence: the query is preconditioned by the inverse layer curvature.

``score[n, q] = <g_n, (F + lambda)^-p g_q>`` per layer (``p = KFACConfig.power``, 1 = the
classical influence function, default 0.8), summed over layers (block-diagonal
over layers), with ``F`` the Kronecker-factored empirical Fisher of ``ops/kronecker.py``
(``kfac``: eigenvalues ``l_S l_A^T``; ``ekfac``: corrected eigenvalues). Positive = training
on n lowers q's loss (``-d loss_q / d eps`` of upweighting n; ``methods.base``).

What is supported:

* train and query factorized (from capture) or dense unprojected: factors fitted from
  factorized captures without projection;
* dense Kronecker-projected rows (a store written with ``ProjectionConfig(kind="kronecker")``):
  fit with ``KFACFactors(projector=Projector(<that config>))`` on factorized captures (the
  factors become ``P_in A P_in^T``, ``P_out S P_out^T``); EK-FAC eigenvalues may then be
  accumulated from the store rows themselves; queries may be factorized (projected on the
  fly) or projected rows;
* dense-projected factorized layers (``kind="dense"``) are refused (no Kronecker structure);
* layernorm/rmsnorm (dense-only rows of ``W`` values) get their exact empirical Fisher block
  ``[W, W]`` when ``W <= KFACConfig.full_max`` (form ``full``, the default for norms up to
  1024 values), the diagonal Fisher only when wider (form ``diagonal``;
  ``ops/factor_forms.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable


from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import FactorStateError
from dattri_ds.gradient import GradBatch
from dattri_ds.methods.base import Attributor
from dattri_ds.ops.cost import CostModel
from dattri_ds.ops.inner import project_batch
from dattri_ds.ops.kronecker import KFACConfig, KFACFactors
from dattri_ds.ops.projection import Projector
from dattri_ds.capture.spill import Spill

logger = logging.getLogger(__name__)

__all__ = ["KFAC", "EKFAC", "fit_factors"]

Batches = Callable[[], Iterable[GradBatch]] | Iterable[GradBatch]


class KFAC(Attributor, name="kfac"):
    """Influence with the K-FAC inverse ``Q_S [X / (l_S l_A^T + lambda)] Q_A^T``.

    Args:
        factors: eigendecomposed KFACFactors (``fit_factors`` or ``KFACFactors.load``).
        layers, cost, projector: as for Attributor (``projector``: exact factors, training
            rows of a projected store; the preconditioned query is projected).
        whitened: the training rows are ``train_rows(batch)`` (whitened by the factors,
            then projected): the query is whitened likewise and scores are plain dot
            products (the projection-friendly form: docs/attribution_fidelity.md).
    """

    text_weight = 0.5

    method = "kfac"

    def __init__(self, *, factors: KFACFactors, layers: Iterable[str] | None = None,
                 cost: CostModel | None = None, projector: Projector | None = None,
                 whitened: bool = False) -> None:
        super().__init__(layers=layers, cost=cost, projector=projector)
        if not factors.eigendecomposed:
            raise FactorStateError(f"{type(self).__name__} needs eigendecomposed factors; call "
                                f"factors.eigendecompose() (fit_factors does)")
        self.factors = factors
        self.whitened = whitened

    def precondition(self, query: GradBatch) -> GradBatch:
        if self.whitened:
            return self.factors.whiten(query, method=self.method)
        return self.factors.precondition(query, method=self.method)

    def train_rows(self, batch: GradBatch) -> GradBatch:
        """Training rows for ``whitened=True``: whitened, then projected with ``projector``.

        ``score = <P r_n, P r_q>`` with ``r = (F + lambda)^-p/2 g`` in the eigenbasis
        (``KFACFactors.whiten_layer``): the projection error stays at the JL level of the
        whitened rows. These rows are what a store for this method should hold.
        """
        rows = self.factors.whiten(self.select(batch), method=self.method)
        return project_batch(rows, self.projector, self.cost) if self.projector else rows


class EKFAC(KFAC, name="ekfac"):
    """Influence with EK-FAC eigenvalues ``L = E_b[(Q_S^T G_b Q_A)^2]``."""

    method = "ekfac"

    def __init__(self, *, factors: KFACFactors, layers: Iterable[str] | None = None,
                 cost: CostModel | None = None, projector: Projector | None = None,
                 whitened: bool = False) -> None:
        super().__init__(factors=factors, layers=layers, cost=cost, projector=projector,
                         whitened=whitened)
        if not factors.has_correction:
            raise FactorStateError("EKFAC needs corrected eigenvalues: run "
                                "factors.update_correction() over the training data and "
                                "reduce() (fit_factors(..., ekfac=True) does), or use 'kfac'")


def _passes(batches: Batches) -> Callable[[], Iterable[GradBatch]] | None:
    """A callable per pass for re-iterables; None for a one-shot iterator (spilled)."""
    if callable(batches):
        return batches
    if iter(batches) is batches:
        return None
    return lambda: batches


def fit_factors(batches: Batches, *, config: KFACConfig | None = None,
                projector: Projector | None = None, ekfac: bool = True,
                ctx: ParallelContext | None = None, spill_dir: str | None = None) -> KFACFactors:
    """Fit curvature factors: sums, reduce, eigendecompose, then (EK-FAC) a second pass.

    EK-FAC needs the eigenbasis of the whole data before its eigenvalue pass. A list or a
    callable is read twice; a one-shot iterator is kept by a ``dattri_ds.Spill`` (under
    ``spill_dir``; with a Kronecker ``projector``, only the projected sides LoGra reads)
    for the second pass, then deleted. To score the same data afterwards without capturing
    it again, pass a ``dattri_ds.Spill`` of the stream yourself (``Spill(stream,
    projector=projector)`` for LoGra factors and rows).

    Args:
        batches: factorized training GradBatches of this rank: a re-iterable, a callable
            returning a fresh iterable per pass, or a one-shot iterator (spilled to disk).
        config: damping and accumulation dtype.
        projector: Kronecker projector of the store the factors will precondition.
        ekfac: also accumulate the EK-FAC eigenvalues (second pass).
        ctx: data-parallel context (default: the default process group, or one process).
        spill_dir: where a one-shot iterator's batches are spilled for the second pass.
    """
    make = _passes(batches)
    factors = KFACFactors(config, projector)
    if make is None and ekfac:  # a one-shot stream: spill it on the first pass
        sides = projector if projector is not None and projector.kind.factorized else None
        with Spill(batches, dir=spill_dir, projector=sides) as spilled:
            return _fit(factors, spilled, ekfac, ctx)
    return _fit(factors, make() if make is not None else batches, ekfac, ctx,
                again=make)


def _fit(factors: KFACFactors, first: Iterable[GradBatch], ekfac: bool,
         ctx: ParallelContext | None,
         again: Callable[[], Iterable[GradBatch]] | None = None) -> KFACFactors:
    """Factor sums over ``first``, reduce, eigendecompose; EK-FAC pass over ``again()``
    (default: ``first`` itself, a re-iterable). A log line at least every 10 s of the
    eigendecomposition and the EK-FAC pass (the caller's progress covers the first pass)."""
    for b in first:
        factors.update(b)
    t0 = time.perf_counter()
    logger.info("fit: eigendecomposing %d layers' factors", len(factors.layers))
    factors.reduce(ctx).eigendecompose()
    logger.info("fit: eigendecomposed in %.1f s", time.perf_counter() - t0)
    if ekfac:
        t0 = last = time.perf_counter()
        rows = 0
        logger.info("fit: EK-FAC eigenvalue pass (the data once more)")
        for b in (again() if again is not None else first):
            factors.update_correction(b)
            rows += b.batch_size
            now = time.perf_counter()
            if now - last >= 10:
                last = now
                logger.info("fit: EK-FAC eigenvalue pass: %d rows, %.0f s", rows, now - t0)
        factors.reduce(ctx)
        logger.info("fit: EK-FAC eigenvalue pass done: %d rows in %.1f s", rows,
                    time.perf_counter() - t0)
    return factors
