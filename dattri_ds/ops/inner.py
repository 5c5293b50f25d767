"""Gradient operations on LayerGrad / GradBatch, each routed ghost vs dense by the cost model.

All operations work on both forms. Inner products are in float32 (``COMPUTE_DTYPE``)
whatever the capture dtype. Results:

* ``materialize(lg)``: ``[B, D]`` canonical per-example gradients.
* ``layer_cross_gram(x, y)``: ``[B1, B2]`` with ``[b, q] = <G_b, G_q>``.
* ``cross_gram(xb, yb)``: summed over common layers (or per layer).
* ``sq_norms`` / ``norms``: ``[B]`` per-example (squared) norms.
* ``cosine(xb, yb)``: ``[B1, B2]`` cosine of the whole-model gradients.
* ``grad_sum(lg)``: ``[1, D]`` sum over examples; ``GradAccumulator`` streams it.
* ``project(lg, projector)``: ``Dense [B, P]`` (see ops/projection.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from dattri_ds.errors import ShapeError
from dattri_ds.gradient import Dense, Factorized, GradBatch, LayerGrad
from dattri_ds.layers.base import get_kind
from dattri_ds.ops.cost import CostModel, Roofline
from dattri_ds.ops.projection import Projector, kron_dims

__all__ = [
    "COMPUTE_DTYPE", "default_cost_model", "materialize", "layer_cross_gram", "cross_gram",
    "sq_norms", "layer_sq_norms", "norms", "cosine", "grad_sum", "GradAccumulator", "project", "project_batch",
]

COMPUTE_DTYPE = torch.float32
_DEFAULT_MODELS: dict[str, CostModel] = {}


def default_cost_model(device: torch.device | str = "cpu") -> CostModel:
    """The shared per-device-type cost model used when an op is given none."""
    key = torch.device(device).type
    if key not in _DEFAULT_MODELS:
        _DEFAULT_MODELS[key] = CostModel(Roofline.default(key))
    return _DEFAULT_MODELS[key]


def _dev(lg: LayerGrad) -> torch.device:
    return lg.data.g.device if isinstance(lg.data, Factorized) else lg.data.values.device


def _f32(f: Factorized) -> Factorized:
    return f.to(dtype=COMPUTE_DTYPE) if f.g.dtype != COMPUTE_DTYPE else f


def _cm(cost: CostModel | None, lg: LayerGrad) -> CostModel:
    return cost or default_cost_model(_dev(lg))


def materialize(lg: LayerGrad) -> torch.Tensor:
    """Canonical per-example gradients ``[B, D]`` (projected rows when already projected)."""
    if isinstance(lg.data, Dense):
        return lg.data.values.to(COMPUTE_DTYPE)
    return get_kind(lg.kind).materialize(_f32(lg.data), lg.shape)


def _check_pair(x: LayerGrad, y: LayerGrad) -> None:
    if x.projection != y.projection or x.shape != y.shape:
        raise ShapeError(
            f"Layer '{x.name}': cannot take inner products between projection "
            f"{x.projection!r} shape {x.shape} and projection {y.projection!r} shape {y.shape} "
            f"(layer '{y.name}'); project both sides with the same ProjectionConfig"
        )


def layer_cross_gram(x: LayerGrad, y: LayerGrad, cost: CostModel | None = None,
                     path: str | None = None) -> torch.Tensor:
    """``[B1, B2]`` inner products of one layer's per-example gradients.

    Both factorized: op ``cross_gram``. One factorized: op ``cross_dense`` (ghost computes
    ``sum_t g_t . (Y a_t)`` and never builds ``G``). Both dense: a matmul.
    """
    _check_pair(x, y)
    xf, yf = isinstance(x.data, Factorized), isinstance(y.data, Factorized)
    if not xf and not yf:
        return materialize(x) @ materialize(y).T
    if not xf:
        return layer_cross_gram(y, x, cost, path).T
    kind = get_kind(x.kind)
    fx = _f32(x.data)
    d = kind.dims(fx, x.shape)
    if yf:
        fy = _f32(y.data)
        dec = _cm(cost, x).choose("cross_gram", x.name, d, B2=fy.g.shape[0], S=fy.g.shape[1],
                                  path=path)
        if dec.path == "ghost":
            return kind.cross_gram(fx, fy)
        return kind.materialize(fx, x.shape) @ kind.materialize(fy, y.shape).T
    yv = materialize(y)
    dec = _cm(cost, x).choose("cross_dense", x.name, d, Q=yv.shape[0], path=path)
    if dec.path == "ghost":
        return kind.cross_dense(fx, yv, x.shape)
    return kind.materialize(fx, x.shape) @ yv.T


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
    grams = {n: layer_cross_gram(xb.layers[n], yb.layers[n], cost, path) for n in names}
    return grams if per_layer else sum(grams.values())


def layer_sq_norms(lg: LayerGrad, cost: CostModel | None = None,
                   path: str | None = None) -> torch.Tensor:
    """``[B]`` squared norms ``||G_b||^2`` (ghost: ``sum_{t,s} (a_t.a_s)(g_t.g_s)``)."""
    if isinstance(lg.data, Dense):
        return lg.data.values.to(COMPUTE_DTYPE).pow(2).sum(1)
    kind = get_kind(lg.kind)
    f = _f32(lg.data)
    dec = _cm(cost, lg).choose("norm", lg.name, kind.dims(f, lg.shape), path=path)
    if dec.path == "dense":
        return kind.materialize(f, lg.shape).pow(2).sum(1)
    return kind.sq_norms(f)


def sq_norms(batch: GradBatch, layers: Iterable[str] | None = None,
             cost: CostModel | None = None, path: str | None = None) -> torch.Tensor:
    """``[B]`` squared norms of the whole-model per-example gradients."""
    names = list(layers) if layers is not None else list(batch.layers)
    return sum(layer_sq_norms(batch.layers[n], cost, path) for n in names)


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
    if isinstance(lg.data, Dense):
        return lg.replace(data=Dense(lg.data.values.to(COMPUTE_DTYPE).sum(0, keepdim=True)))
    kind = get_kind(lg.kind)
    f = _f32(lg.data)
    dec = _cm(cost, lg).choose("sum", lg.name, kind.dims(f, lg.shape), path=path)
    if dec.path == "ghost":
        flat = Factorized(f.a.reshape(1, -1, *f.a.shape[2:]), f.g.reshape(1, -1, f.g.shape[-1]))
        total = kind.materialize(flat, lg.shape)
    else:
        total = kind.materialize(f, lg.shape).sum(0, keepdim=True)
    return lg.replace(data=Dense(total))


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


def project(lg: LayerGrad, projector: Projector, cost: CostModel | None = None,
            path: str | None = None) -> LayerGrad:
    """Project one layer's per-example gradients to ``Dense [B, P]``.

    Layers with ``O*I' <= dim`` are kept exactly (projection tag ``identity:<tag>``).
    Factorized layers use ``project_kron`` or ``project_dense`` routing; dense ones a matmul.
    """
    cfg = projector.config
    if lg.projection is not None:
        raise ShapeError(f"Layer '{lg.name}' is already projected ({lg.projection})")
    o, i = lg.shape
    if o * i <= cfg.dim:
        return lg.replace(data=Dense(materialize(lg)), projection=f"identity:{cfg.tag}")
    dev = _dev(lg)
    if cfg.kind == "kronecker" and isinstance(lg.data, Factorized):
        ko, ki = kron_dims(cfg.dim, o, i)
        p_out = projector.side(lg.name, "out", ko, o, dev)
        p_in = projector.side(lg.name, "in", ki, i, dev)
        kind = get_kind(lg.kind)
        f = _f32(lg.data)
        dec = _cm(cost, lg).choose("project_kron", lg.name, kind.dims(f, lg.shape), ko=ko, ki=ki,
                                   path=path)
        if dec.path == "ghost":
            vals = kind.project_kron(f, p_out, p_in)
        else:
            g = kind.materialize(f, lg.shape).view(-1, o, i)
            vals = (p_out @ g @ p_in.T).reshape(g.shape[0], -1)
        return lg.replace(data=Dense(vals), projection=cfg.tag)
    return lg.replace(data=Dense(_project_dense(lg, projector, cost, path)), projection=cfg.tag)


def _project_dense(lg: LayerGrad, projector: Projector, cost: CostModel | None,
                   path: str | None) -> torch.Tensor:
    """Dense projection; the ghost path ``sum_t g_t^T P_p a_t`` only wins when T == 1."""
    k = projector.config.dim
    if isinstance(lg.data, Dense):
        return projector.dense_apply(lg.name, lg.data.values.to(COMPUTE_DTYPE), k)
    kind = get_kind(lg.kind)
    f = _f32(lg.data)
    dec = _cm(cost, lg).choose("project_dense", lg.name, kind.dims(f, lg.shape), P=k, path=path)
    if dec.path == "ghost" and f.a.is_floating_point():
        o, i = lg.shape
        p = projector.dense_matrix(lg.name, o * i, k).to(f.g.device)
        return kind.cross_dense(f, p, lg.shape)
    return projector.dense_apply(lg.name, kind.materialize(f, lg.shape), k)


def project_batch(batch: GradBatch, projector: Projector, cost: CostModel | None = None,
                  path: str | None = None) -> GradBatch:
    """Project every layer of a batch (same ids, step and token counts)."""
    layers: Mapping[str, LayerGrad] = {
        n: project(lg, projector, cost, path) for n, lg in batch.layers.items()
    }
    return GradBatch(batch.step, batch.sample_ids, layers, batch.micro_batch, batch.token_counts)
