"""Gradient operations on LayerGrad / GradBatch, each routed ghost vs dense by the cost model.

All operations work on both forms. Inner products are in float32 (``COMPUTE_DTYPE``)
whatever the capture dtype. Results:

* ``materialize(lg)``: ``[B, D]`` canonical per-example gradients.
* ``layer_cross_gram(x, y)``: ``[B1, B2]`` with ``[b, q] = <G_b, G_q>``.
* ``cross_gram(xb, yb)``: summed over common layers (or per layer).
* ``sq_norms`` / ``norms``: ``[B]`` per-example (squared) norms.
* ``cosine(xb, yb)``: ``[B1, B2]`` cosine of the whole-model gradients.
* ``grad_sum(lg)``: ``[1, D]`` sum over examples; ``GradAccumulator`` streams it.
* ``project(lg, projector)``: ``Dense [B, P]`` (re-exported from ``ops/space.py``, the one
  place a LayerGrad changes space; the maths of every op is on the layer's kind).

Tensor-parallel shards (``LayerGrad.shard``): every op works on the local shard and
all-reduces only its small result over ``shard.group`` (docs/design.md, "Tensor-parallel
shards").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dattri_ds.errors import ShapeError
from dattri_ds.gradient import Dense, GradBatch, LayerGrad, ShardInfo
from dattri_ds.layers.base import COMPUTE_DTYPE
from dattri_ds.ops.cost import CostModel, default_cost_model
from dattri_ds.ops.space import (
    _reduce_shard, _to_local, gather_shards, project, project_batch, unshard, unshard_batch,
)

__all__ = [
    "COMPUTE_DTYPE", "default_cost_model", "materialize", "layer_cross_gram", "cross_gram",
    "sq_norms", "layer_sq_norms", "norms", "cosine", "grad_sum", "GradAccumulator", "project", "project_batch",
    "gather_shards", "unshard", "unshard_batch",
]


def _cm(cost: CostModel | None, lg: LayerGrad) -> CostModel:
    return cost or default_cost_model(lg.device)


def materialize(lg: LayerGrad) -> torch.Tensor:
    """Canonical per-example gradients ``[B, D]`` (projected rows when already projected)."""
    return lg.kind.rows(lg.data, lg.shape)


def _check_pair(x: LayerGrad, y: LayerGrad) -> None:
    if x.space != y.space or x.shape != y.shape:
        raise ShapeError(
            f"Layer '{x.name}': cannot take inner products between projection "
            f"{x.projection!r} shape {x.shape} and projection {y.projection!r} shape {y.shape} "
            f"(layer '{y.name}'); project both sides with the same ProjectionConfig"
        )


def layer_cross_gram(x: LayerGrad, y: LayerGrad, cost: CostModel | None = None,
                     path: str | None = None) -> torch.Tensor:
    """``[B1, B2]`` inner products of one layer's per-example gradients.

    Both factorized: op ``cross_gram``. One factorized: op ``cross_dense`` (ghost computes
    ``sum_t g_t . (Y a_t)`` and never builds ``G``). Both dense: a matmul. A sharded
    layer: the local shards' products, all-reduced over the shard group (an unsharded
    full-shape side is sliced to the local shard first).
    """
    if x.shard is not None or y.shard is not None:
        return _reduce_shard(*_local_cross_gram(x, y, cost, path))
    _check_pair(x, y)
    return x.kind.gram(x.name, x.data, y.data, x.shape, _cm(cost, x), path)


def _common(xb: GradBatch, yb: GradBatch, layers: Iterable[str] | None) -> list[str]:
    names = list(layers) if layers is not None else [n for n in xb.layers if n in yb.layers]
    missing = [n for n in names if n not in xb.layers or n not in yb.layers]
    if missing or not names:
        raise ShapeError(
            f"Layers {missing or '(none in common)'} are not present in both gradient "
            f"batches; first has {list(xb.layers)[:5]}..., second has {list(yb.layers)[:5]}..."
        )
    return names


def cross_gram(xb: GradBatch, yb: GradBatch, layers: Iterable[str] | None = None,
               cost: CostModel | None = None, per_layer: bool = False,
               path: str | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """Train x query inner products ``[B1, B2]``, summed over layers (or a dict per layer)."""
    names = _common(xb, yb, layers)
    if per_layer:
        return {n: layer_cross_gram(xb.layers[n], yb.layers[n], cost, path) for n in names}
    parts = []
    for n in names:
        x, y = xb.layers[n], yb.layers[n]
        if x.shard is None and y.shard is None:
            parts.append((layer_cross_gram(x, y, cost, path), None))
        else:
            parts.append(_local_cross_gram(x, y, cost, path))
    return _sum_reduced(parts)


def layer_sq_norms(lg: LayerGrad, cost: CostModel | None = None,
                   path: str | None = None) -> torch.Tensor:
    """``[B]`` squared norms ``||G_b||^2`` (ghost: ``sum_{t,s} (a_t.a_s)(g_t.g_s)``)."""
    if lg.shard is not None:
        return _reduce_shard(layer_sq_norms(lg.replace(shard=None), cost, path), lg.shard)
    return lg.kind.sq_norms_of(lg.name, lg.data, lg.shape, _cm(cost, lg), path)


def sq_norms(batch: GradBatch, layers: Iterable[str] | None = None,
             cost: CostModel | None = None, path: str | None = None) -> torch.Tensor:
    """``[B]`` squared norms of the whole-model per-example gradients."""
    names = list(layers) if layers is not None else list(batch.layers)
    parts = [(layer_sq_norms(batch.layers[n].replace(shard=None), cost, path),
              batch.layers[n].shard) for n in names]
    return _sum_reduced(parts)


def norms(batch: GradBatch, layers: Iterable[str] | None = None,
          cost: CostModel | None = None, path: str | None = None) -> torch.Tensor:
    """``[B]`` per-example gradient norms."""
    return sq_norms(batch, layers, cost, path).sqrt()


def cosine(xb: GradBatch, yb: GradBatch, layers: Iterable[str] | None = None,
           cost: CostModel | None = None, eps: float = 1e-12) -> torch.Tensor:
    """``[B1, B2]`` cosine similarity of whole-model gradients (zero gradients give 0)."""
    names = _common(xb, yb, layers)
    dots = cross_gram(xb, yb, names, cost)
    nx = norms(xb, names, cost).clamp_min(eps)
    ny = norms(yb, names, cost).clamp_min(eps)
    return dots / nx[:, None] / ny[None, :]


def grad_sum(lg: LayerGrad, cost: CostModel | None = None, path: str | None = None) -> LayerGrad:
    """Sum over examples as a one-row dense LayerGrad ``[1, D]``.

    Ghost path: flatten batch and tokens, ``G = g^T a`` in one matmul (``[O, I']``).
    """
    return lg.replace(data=Dense(lg.kind.sum_rows(lg.name, lg.data, lg.shape, _cm(cost, lg),
                                                  path)))


class GradAccumulator:
    """Streaming sum (and mean) of per-example gradients over many GradBatches.

    ``add(batch)`` folds a batch in; ``mean()`` returns a one-example GradBatch whose layers
    are dense ``[1, D]`` (or ``[1, P]`` when the inputs were projected).
    """

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost
        self.count = 0
        self._sums: dict[str, LayerGrad] = {}

    def add(self, batch: GradBatch) -> None:
        for name, lg in batch.layers.items():
            s = grad_sum(lg, self.cost)
            prev = self._sums.get(name)
            if prev is not None:
                _check_pair(prev, s)
                s = s.replace(data=Dense(prev.data.values + s.data.values))
            self._sums[name] = s
        self.count += batch.batch_size

    def total(self, sample_id: str = "sum") -> GradBatch:
        return GradBatch(step=-1, sample_ids=(sample_id,), layers=dict(self._sums))

    def mean(self, sample_id: str = "mean") -> GradBatch:
        if self.count == 0:
            raise ShapeError("GradAccumulator.mean() called before any example was added")
        layers = {n: lg.replace(data=Dense(lg.data.values / self.count))
                  for n, lg in self._sums.items()}
        return GradBatch(step=-1, sample_ids=(sample_id,), layers=layers)


# ---- tensor-parallel shards ------------------------------------------------------------
def _sum_reduced(parts: list[tuple[torch.Tensor, ShardInfo | None]]) -> torch.Tensor:
    """Sum per-layer results; sharded partials are summed first, one reduction per group."""
    total = None
    partial: dict[tuple[int, int], tuple[torch.Tensor, ShardInfo]] = {}
    for t, shard in parts:
        if shard is None:
            total = t if total is None else total + t
        else:
            key = (id(shard.group), shard.world)
            prev = partial.get(key)
            partial[key] = (t if prev is None else prev[0] + t, shard)
    for t, shard in partial.values():  # insertion (layer) order: the same on every rank
        t = _reduce_shard(t, shard)
        total = t if total is None else total + t
    return total


def _local_cross_gram(x: LayerGrad, y: LayerGrad, cost: CostModel | None,
                      path: str | None) -> tuple[torch.Tensor, ShardInfo]:
    """This shard's ``[B1, B2]`` partial inner products (not yet reduced) and the shard."""
    shard = x.shard if x.shard is not None else y.shard
    local_shape = x.shape if x.shard is not None else y.shape
    xl, yl = _to_local(x, shard, local_shape), _to_local(y, shard, local_shape)
    return layer_cross_gram(xl, yl, cost, path), shard


