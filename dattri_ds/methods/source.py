"""SOURCE: segment-wise approximate unrolling of training (Bae et al., 2024) on EK-FAC factors.

The trajectory is cut into L segments at its checkpoints (steps ``s_1 < ... < s_L``, ``s_L``
the final model, ``s_0 = 0`` the start of training): segment l runs ``K_l = s_l - s_{l-1}``
optimizer steps at learning rate ``eta_l``. Within a segment SOURCE takes the Hessian and the
training gradient constant, ``H_l`` and ``g_n^(l)``, both read at the segment's own
checkpoint l (its end: the checkpoints a run saves). Upweighting example n by ``eps`` then
moves the final parameters by (SGD unrolled, ``(I - eta H)^K ~ exp(-eta K H)``)::

    d theta_s / d eps ~ -(1/N) sum_l  S_L S_{L-1} ... S_{l+1}  R_l g_n^(l)
    S_m = exp(-eta_m K_m H_m)                          (propagation through segment m)
    R_l = sum_{k<K_l} eta_l (I - eta_l H_l)^k ~ (I - exp(-eta_l K_l H_l)) H_l^-1

and the score of n for a query q is ``score[n, q] = sum_l <g_n^(l), R_l S_{l+1} ... S_L g_q>``
(``g_q`` at the final model; ``R`` and ``S`` are symmetric; the positive constant ``1/N``
dropped; positive = n lowers q's loss, ``methods.base``). Per layer (block-diagonal, as in
``methods.curvature``) ``H_l = Q_l diag(lambda_l + delta_l) Q_l^T`` is the checkpoint's
EK-FAC (``inner="kfac"``: K-FAC) in its Kronecker eigenbasis ``Q_l = Q_S (x) Q_A``, with
the factors' own damping ``delta_l`` (``KFACConfig.damping``, relative to the layer's mean
eigenvalue by default). So, with ``h = lambda_l + delta_l`` and ``x = eta_l K_l h``::

    R_l = Q_l diag( (1 - exp(-x)) / h ) Q_l^T = Q_l diag( eta_l K_l phi(x) ) Q_l^T
    S_l = Q_l diag( exp(-x) ) Q_l^T,             phi(x) = (1 - e^-x) / x, phi(0) = 1

Limits: ``x -> 0`` (short segment or flat direction) gives ``eta K g_n`` (TracIn's
``lr * grad-dot``, times the steps); ``x -> inf`` gives ``h^-1 g_n`` (the influence function,
``ekfac`` at ``power=1``) and ``S -> 0`` (a segment that converged forgets what came before).

The one approximation beyond the per-segment constant Hessian and EK-FAC itself: each
``S_m`` is applied in *its own* segment's eigenbasis, one after the other, on the query
side (``u_L = g_q``; ``p_l = R_l u_l``; ``u_{l-1} = S_l u_l``), which is the exact product
of the per-segment EK-FAC matrices (no assumption that the segments' eigenbases commute, and
no expectation of the product taken as the product of expectations beyond treating each
segment's ``H_l`` as fixed). The paper's stochastic treatment of the gradient within a
segment (a mean gradient) is replaced by the checkpoint's gradient, as trajectory methods
here do. ``KFACConfig.power`` is not used: the unrolled response replaces ``h^-p``.

Learning rate of segment l: ``Checkpoint.lr`` is the rate in effect *after* a checkpoint,
so ``eta_l`` is checkpoint l-1's ``lr`` (segment 1: checkpoint 1's own, none earlier is
known). Steps are ``Checkpoint.step`` (the tools read them from ``trajectory.json`` or a
Hugging Face folder's ``trainer_state.json``, or ``--steps`` / ``--lrs``).

Scoring streams: the query side (``[Q, D]`` per segment) is built from every checkpoint's
factors once the final query is known, so a checkpoint's one-shot training stream is kept
(``dattri_ds.Spill``: in memory, beyond 1 GiB on disk) until then. Rows whitened by the
checkpoint's factors (``whitened=True``, ``collect --whiten``) get the query
``(lambda + delta)^(p/2) Q^T (R_l u_l)`` in the same coordinates; projected rows get the
exact query side, then projected (``Attributor(projector=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch

from dattri_ds.errors import ConfigError, FactorStateError, ShapeError
from dattri_ds.gradient import Dense, Factorized, GradBatch, LayerGrad
from dattri_ds.layers.base import COMPUTE_DTYPE
from dattri_ds.methods.base import Attributor, Scores
from dattri_ds.methods.curvature import KFAC
from dattri_ds.methods.tracin import Checkpoint, Trajectory
from dattri_ds.ops.cost import CostModel
from dattri_ds.ops.kronecker import KFACFactors, _chunks, _rows
from dattri_ds.ops.projection import Projector
from dattri_ds.spill import Spill

__all__ = ["Source", "unroll_coefficients"]

_STEP_FIX = ("pass Checkpoint(..., step=<optimizer step>); from the tools, the step comes from "
             "the run's trajectory.json ('step') or each Hugging Face folder's "
             "trainer_state.json (global_step), or pass --steps with one step per checkpoint")
_LR_FIX = ("pass Checkpoint(..., lr=<learning rate after the checkpoint>); from the tools, the "
           "rate comes from the run's trajectory.json ('lr') or each Hugging Face folder's "
           "trainer_state.json (log_history), or pass --lrs with one rate per checkpoint")


def unroll_coefficients(h: torch.Tensor, horizon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r, s)`` of one segment on eigenvalues ``h`` (damped, >= 0) and ``horizon = eta K``.

    ``r = (1 - exp(-eta K h)) / h = eta K phi(eta K h)`` (``eta K`` at ``h = 0``) and
    ``s = exp(-eta K h)``, computed with ``expm1`` so that neither limit loses precision.
    """
    h = h.double().clamp_min(0)
    x = horizon * h
    phi = torch.where(x > 1e-12, -torch.expm1(-x) / x.clamp_min(1e-300), 1.0 - x / 2)
    return horizon * phi, torch.exp(-x)


class _Fixed(Attributor):
    """The shared scoring loop with an already preconditioned query (not registered)."""

    def __init__(self, pq: GradBatch, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pq = pq

    def precondition(self, query: GradBatch) -> GradBatch:
        return self.pq


class Source(Trajectory, name="source"):
    """SOURCE (module docstring): unrolled segment-wise influence over EK-FAC checkpoints.

    Args:
        inner: the curvature of each segment, ``ekfac`` (default) or ``kfac``.
        weighting: ``lr`` (default): the unrolled sum itself (the learning rates enter
            through ``eta_l K_l``; the name tells the tools to read each checkpoint's lr);
            ``normalized``: every segment's ``[N, Q]`` share scaled to unit std over the
            training examples per query before summing (as ``ekfac-trajectory``).
        layers, cost, projector: as for Attributor.
        whitened: the training rows are whitened by each checkpoint's factors (a store of
            ``collect --whiten``); the query side is built in the same coordinates.

    Raises:
        ConfigError: a non-curvature inner method, or ``weighting="uniform"``.
    """

    default_inner = "ekfac"
    default_weighting = "lr"
    @classmethod
    def reads_schedule(cls, weighting: str | None = None) -> bool:
        """Always: every segment's ``eta_l K_l`` needs its checkpoint's ``lr`` and ``step``,
        whatever the weighting."""
        return True

    def __init__(self, *, inner: str | None = None,
                 weighting: Literal["lr", "normalized"] | None = None,
                 layers: Iterable[str] | None = None, cost: CostModel | None = None,
                 projector: Projector | None = None, whitened: bool = False) -> None:
        super().__init__(inner=inner, weighting=weighting, layers=layers, cost=cost,
                         projector=projector)
        if not issubclass(self._inner_cls, KFAC):
            raise ConfigError(f"source: inner method '{self._inner_cls.name}' has no "
                              f"curvature to unroll; use inner='ekfac' or 'kfac'")
        if self.weighting == "uniform":
            raise ConfigError("source: weighting='uniform' is not defined (the segments' "
                              "weights are their unrolled responses); use 'lr' (the default) "
                              "or 'normalized'")
        self.method = self._inner_cls.method
        self.whitened = whitened

    # ---- the trajectory ---------------------------------------------------------------------
    def trajectory_scores(self, checkpoints: Iterable[Checkpoint],
                          per_checkpoint: list[torch.Tensor] | None = None) -> Scores:
        """``sum_l <g_n^(l), R_l S_{l+1} ... S_L g_q>`` over the segments (module docstring).

        Args:
            checkpoints: oldest first, each with ``factors``, ``step`` and ``lr``; the last
                is the final model (its ``query`` is ``g_q``; earlier queries are unused).
            per_checkpoint: if given, receives each segment's ``[N, Q]`` share.

        Raises:
            ConfigError: no checkpoint, a checkpoint without factors, step or lr, or steps
                that do not increase (each message names the fix).
            ShapeError: training examples differ between checkpoints.
        """
        spills: list[Spill] = []
        try:
            cks = [self._keep(c, ck, spills) for c, ck in enumerate(checkpoints)]
            if not cks:
                raise ConfigError("Source.trajectory_scores() needs at least one Checkpoint")
            horizons = self.horizons(cks)
            query = self.select(cks[-1].query)
            parts = self.unrolled_queries(cks, horizons, query)
            return self._score(cks, parts, query, per_checkpoint)
        finally:
            for s in spills:
                s.close()

    def _keep(self, c: int, ck: Checkpoint, spills: list[Spill]) -> Checkpoint:
        """Check the checkpoint's factors; keep a one-shot training stream (Spill) so that
        it can be scored after the later checkpoints were read."""
        if ck.factors is None:
            raise ConfigError(f"Checkpoint {c} has no factors but source needs every "
                              f"segment's curvature: fit_factors() on that checkpoint's "
                              f"training gradients and pass Checkpoint(..., factors=...) "
                              f"(tools/fit.py --checkpoint all)")
        if not isinstance(ck.factors, KFACFactors) or not ck.factors.eigendecomposed:
            raise FactorStateError(f"Checkpoint {c}: source needs eigendecomposed KFACFactors "
                                   f"(fit_factors does)")
        if self.method == "ekfac" and not ck.factors.has_correction:
            raise FactorStateError(f"Checkpoint {c}: EK-FAC eigenvalues were not accumulated; "
                                   f"fit_factors(..., ekfac=True), or inner='kfac'")
        train = ck.train
        if iter(train) is train:  # a one-shot stream (e.g. a store's iter_batches)
            spills.append(Spill(train))
            for _ in spills[-1]:
                pass
            train = spills[-1]
        return ck._replace(train=train)

    @staticmethod
    def horizons(cks: list[Checkpoint]) -> list[float]:
        """``eta_l K_l`` per segment: ``K_l = s_l - s_{l-1}`` (``s_0 = 0``), ``eta_l`` the
        lr after checkpoint l-1 (segment 1: checkpoint 1's lr).

        Raises:
            ConfigError: a missing or negative step, steps not increasing, or a missing,
                non-finite or non-positive lr, naming the checkpoint and the fix.
        """
        out, prev = [], 0
        for c, ck in enumerate(cks):
            step = getattr(ck, "step", None)
            if step is None or isinstance(step, bool) or not float(step).is_integer():
                raise ConfigError(f"Checkpoint {c} has no optimizer step (step={step!r}); "
                                  f"source needs each checkpoint's step to count the steps "
                                  f"of its segment: {_STEP_FIX}")
            if int(step) <= prev and not (c == 0 and int(step) == 0):
                raise ConfigError(f"Checkpoint {c} is at step {step}, not after the previous "
                                  f"one ({prev}); source needs checkpoints oldest first at "
                                  f"increasing steps: {_STEP_FIX}")
            lr = cks[max(c - 1, 0)].lr
            if lr is None or not math.isfinite(float(lr)) or float(lr) <= 0:
                raise ConfigError(f"Checkpoint {max(c - 1, 0)} has learning rate {lr!r}; "
                                  f"source needs a positive rate per segment: {_LR_FIX}")
            out.append(float(lr) * (int(step) - prev))
            prev = int(step)
        return out

    # ---- the query side ---------------------------------------------------------------------
    def unrolled_queries(self, cks: list[Checkpoint], horizons: list[float],
                         query: GradBatch) -> list[GradBatch]:
        """``[R_l u_l for l = 1..L]`` with ``u_L = g_q``, ``u_{l-1} = S_l u_l`` (dense
        ``[Q, D]`` per layer; whitened coordinates when ``whitened``)."""
        parts: list[GradBatch] = [query] * len(cks)
        u = query
        for c in range(len(cks) - 1, -1, -1):
            p_layers, u_layers = {}, {}
            for name, lg in u.layers.items():
                p_layers[name], u_layers[name] = self._segment_layer(
                    cks[c].factors, lg, horizons[c], propagate=c > 0)
            parts[c] = GradBatch(query.step, query.sample_ids, p_layers, query.micro_batch,
                                 query.token_counts)
            if c > 0:
                u = GradBatch(query.step, query.sample_ids, u_layers, query.micro_batch,
                              query.token_counts)
        return parts

    def _segment_layer(self, factors: KFACFactors, lg: LayerGrad, horizon: float,
                       propagate: bool) -> tuple[LayerGrad, LayerGrad | None]:
        """One layer of one segment: ``(R u, S u)`` from one rotation into ``Q_l``.

        ``R u = Q [f * (Q^T u)]`` with ``f = r(h)`` (``unroll_coefficients``), returned as
        ``(h_p)^(p/2) f * (Q^T u)`` for whitened rows (``h_p`` the eigenvalues the rows were
        whitened with); ``S u = Q [exp(-eta K h) * (Q^T u)]``.
        """
        lf = factors._get(lg.name)
        ev = factors._eigenvalues(lf, self.method)
        cfg = factors.config
        h = ev + cfg.damping * (ev.mean() if cfg.damping_mode == "relative" else 1.0)
        r, s = unroll_coefficients(h, horizon)
        if self.whitened:
            r = r * h.clamp_min(0).pow(cfg.power / 2)
        dtype = getattr(torch, cfg.dtype)
        r, s = r.to(dtype), s.to(dtype)
        o, i = lf.dims
        if isinstance(lg.data, Dense) and lg.data.values.dtype == dtype and \
                lg.space == lf.space and lg.data.values.shape[-1] == o * i:
            x = lg.data.values.to(r.device)  # a propagated u, kept in the factors' dtype
        else:
            x = factors._prepare(lf, lg)
        b = x.g.shape[0] if isinstance(x, Factorized) else x.shape[0]
        out_r = torch.empty(b, o * i, dtype=COMPUTE_DTYPE, device=r.device)
        out_s = (torch.empty(b, o * i, dtype=dtype, device=r.device)  # carried on: the
                 if propagate else None)                               # factors' dtype
        for sl in _chunks(b, o * i):  # bounds the float64 intermediates
            rot = factors._rotate(lf, _rows(x, sl, b))
            rr = rot * r
            out_r[sl] = (rr if self.whitened else factors._unrotate(lf, rr)).reshape(-1, o * i)
            if out_s is not None:
                out_s[sl] = factors._unrotate(lf, rot * s).reshape(-1, o * i)
        space = lf.space.replace(whitened=self.method) if self.whitened else lf.space
        p = lg.replace(data=Dense(out_r), space=space)
        return p, None if out_s is None else lg.replace(data=Dense(out_s), space=lf.space)

    # ---- scoring ----------------------------------------------------------------------------
    def _score(self, cks: list[Checkpoint], parts: list[GradBatch], query: GradBatch,
               per_checkpoint: list[torch.Tensor] | None) -> Scores:
        ids: tuple[str, ...] | None = None
        total: torch.Tensor | None = None
        for c, (ck, pq) in enumerate(zip(cks, parts)):
            s = _Fixed(pq, layers=self.layers, cost=self.cost,
                       projector=self.projector).scores(ck.train, query)
            part = self.weighted(ck, s.values) if self.weighting == "normalized" else s.values
            if per_checkpoint is not None:
                per_checkpoint.append(part)
            if ids is None:
                ids, total = s.train_ids, part
                continue
            if s.train_ids != ids:
                raise ShapeError(f"Checkpoint {c}: training examples differ from checkpoint 0 "
                                 f"({len(s.train_ids)} vs {len(ids)} rows); stream the same "
                                 f"examples in the same order at every checkpoint")
            total = total + part
        return Scores(ids, total)
