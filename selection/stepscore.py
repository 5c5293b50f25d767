"""Step-alignment score: how well the training step points at the target with a candidate in it.

An Adam (or clipped) step has a length set by the learning rate, not by the gradient's size,
so what one training step does to the target loss is, to first order, ``-lr * |g_t| *
cos(G, g_t)``: the *direction* of the step's summed gradient ``G`` decides. A candidate is
worth what it does to that direction when it takes one of the step's ``m`` slots and the
other ``m - 1`` slots hold typical training examples (mean ``p``, the pool's mean gradient;
mean squared norm ``s``):

    E<G, g_t> = <g_b, g_t> + (m - 1) <p, g_t>
    E|G|^2   = |g_b|^2 + 2 (m - 1) <g_b, p> + (m - 1)^2 |p|^2 + (m - 1) (s - |p|^2)
    score_b  = E<G, g_t> / (|g_t| sqrt(E|G|^2))                     (a cosine, in [-1, 1])

The score has no free weight. For ``m = 1`` it is the plain cosine ``cos(g_b, g_t)``; for
large steps it ranks candidates by ``<g_b, g_t> - lambda (<g_b, p> + |g_b|^2 / 2)`` with
``lambda = E<G0, g_t> / E|G0|^2`` of the other slots ``G0``: what the candidate adds to the
target direction beyond the direction every example pushes anyway (a contrast whose weight
is measured, not chosen), minus a second-order penalty on its size (GREATS' quadratic term
with the step's own scale). So neither large, noisy gradients (raw inner products) nor small,
already-learned ones (cosine) are preferred for their norm alone.

Two dense rows are scored (``g_t`` and ``p``): the same ghost ``cross_dense`` route as one
target, twice; ``|g_b|^2`` comes from the ghost norms. Under ZeRO-3 and tensor parallelism
every inner product is the shard-reduced whole-model one (``ops.cross_gram``/``sq_norms``).
"""

from __future__ import annotations

import torch

from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.gradient import Dense, GradBatch
from dattri_ds.ops import CostModel, cross_gram, sq_norms
from dattri_ds.selection.contrast import PooledTarget

__all__ = ["expected_step_cosine", "StepTarget", "step_scores"]


def expected_step_cosine(u: torch.Tensor, r: torch.Tensor, sq: torch.Tensor, *, tt: float,
                         tp: float, pp: float, mean_sq: float, others: int) -> torch.Tensor:
    """``[C]`` expected cosine of the step gradient with the target, candidate b in one slot.

    Args:
        u: ``[C]`` ``<g_b, g_t>``.
        r: ``[C]`` ``<g_b, p>`` (``p`` the typical example's mean gradient).
        sq: ``[C]`` ``|g_b|^2``.
        tt: ``|g_t|^2``.
        tp: ``<p, g_t>``.
        pp: ``|p|^2``.
        mean_sq: ``s``, the mean squared per-example gradient norm (``>= |p|^2``; the
            difference is the per-example variance, clamped at 0).
        others: ``m - 1``, the step's other examples.
    """
    u, r, sq = u.double(), r.double(), sq.double()
    var = max(mean_sq - pp, 0.0)
    dot = u + others * tp
    norm2 = sq + 2 * others * r + others * others * pp + others * var
    return dot / (norm2.clamp_min(1e-300).sqrt() * max(tt, 1e-300) ** 0.5)


class StepTarget(PooledTarget):
    """Two dense rows per layer: the target gradient ``g_t`` and the pool's mean ``p``;
    until the pool sample is full ``p = 0`` (the score is then ``<g_b, g_t>`` over
    ``sqrt(|g_b|^2 + (m - 1) s)``). Arguments: ``PooledTarget``."""

    def combine(self, target: GradBatch, reference: GradBatch | None) -> GradBatch:
        layers = {}
        for name, lg in target.layers.items():
            tv = lg.data.values
            pv = reference.layers[name].data.values if reference is not None \
                else torch.zeros_like(tv)
            layers[name] = lg.replace(data=Dense(torch.cat([tv, pv.to(tv.dtype)], 0)))
        return GradBatch(step=target.step, sample_ids=("target", "pool"), layers=layers)


def step_scores(grads: GradBatch, rows: GradBatch, others: int,
                cost: CostModel | None = None, ctx: ParallelContext | None = None
                ) -> torch.Tensor:
    """``[C]`` step-alignment scores of ``grads`` against ``rows = [g_t; p]`` (StepTarget).

    ``s`` is the mean squared norm of the candidates of every data-parallel rank (one
    two-number all-reduce), so a candidate's score does not depend on the layout.
    """
    ctx = ctx or ParallelContext()
    names = list(rows.layers)
    up = cross_gram(grads, rows, layers=names, cost=cost)  # [C, 2]
    sq = sq_norms(grads, names, cost)
    g = cross_gram(rows, rows, layers=names, cost=cost).double().cpu()  # [2, 2]
    tot = torch.stack([sq.double().sum(), sq.new_tensor(float(sq.numel()), dtype=torch.float64)])
    all_reduce_sum(tot, ctx.dp_group, ctx.dp_world)
    mean_sq = float(tot[0] / tot[1].clamp_min(1))
    return expected_step_cosine(up[:, 0], up[:, 1], sq, tt=float(g[0, 0]), tp=float(g[0, 1]),
                                pp=float(g[1, 1]), mean_sq=mean_sq, others=others)
