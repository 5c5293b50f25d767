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

Tensor-parallel shards (``LayerGrad.shard``, contiguous blocks of the canonical layout, see
``ShardInfo``): every op works on the local shard and all-reduces only its small result over
``shard.group``. ``layer_cross_gram`` / ``cross_gram`` / ``sq_norms`` reduce ``[B1, B2]`` /
``[B]`` partial sums (``cross_gram`` one reduction per group for all sharded layers);
``project`` reduces ``[B, P]`` partial projections: Kronecker with the shard's slice of the
seeded side matrix (``P_out[:, rows]`` for column-parallel, ``P_in[:, cols]`` for
row-parallel), dense with the shard's columns of the seeded dense matrix
(``Projector.dense_apply_at``, always via the materialized local rows). A projected layer
is whole (``shard=None``, ``shape = full_shape``) and equals the unsharded layer's
projection up to float rounding; layers with ``O*I' <= dim`` are all-gathered exactly.
``materialize`` and ``grad_sum`` stay local. ``gather_shards`` (full rows) and
``unshard`` (full factors, e.g. for K-FAC) all-gather along the feature dimension: that
is gradient- or activation-sized communication, for tests and offline tools only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dattri_ds.distributed import all_gather_object, all_reduce_sum
from dattri_ds.errors import ShapeError, UnsupportedLayerError
from dattri_ds.gradient import Dense, Factorized, GradBatch, LayerGrad, ShardInfo
from dattri_ds.layers.base import get_kind
from dattri_ds.ops.cost import CostModel, Roofline
from dattri_ds.ops.projection import Projector, kron_dims

__all__ = [
    "COMPUTE_DTYPE", "default_cost_model", "materialize", "layer_cross_gram", "cross_gram",
    "sq_norms", "layer_sq_norms", "norms", "cosine", "grad_sum", "GradAccumulator", "project", "project_batch",
    "gather_shards", "unshard", "unshard_batch",
]

COMPUTE_DTYPE = torch.float32
_DEFAULT_MODELS: dict[str, CostModel] = {}


def default_cost_model(device: torch.device | str = "cpu") -> CostModel:
    """The shared per-device-type cost model used when an op is given none."""
    key = torch.device(device).type
    if key not in _DEFAULT_MODELS:
        _DEFAULT_MODELS[key] = CostModel(Roofline.default(key))
    return _DEFAULT_MODELS[key]


def _f32(f: Factorized) -> Factorized:
    return f.to(dtype=COMPUTE_DTYPE) if f.g.dtype != COMPUTE_DTYPE else f


def _cm(cost: CostModel | None, lg: LayerGrad) -> CostModel:
    return cost or default_cost_model(lg.device)


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
    ``sum_t g_t . (Y a_t)`` and never builds ``G``). Both dense: a matmul. A sharded
    layer: the local shards' products, all-reduced over the shard group (an unsharded
    full-shape side is sliced to the local shard first).
    """
    if x.shard is not None or y.shard is not None:
        return _reduce_shard(*_local_cross_gram(x, y, cost, path))
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
        return _cm(cost, x).run("cross_gram", x.name, d, {
            "ghost": lambda: kind.cross_gram(fx, fy),
            "dense": lambda: kind.materialize(fx, x.shape) @ kind.materialize(fy, y.shape).T,
        }, path=path, B2=fy.g.shape[0], S=fy.g.shape[1])
    yv = materialize(y)
    return _cm(cost, x).run("cross_dense", x.name, d, {
        "ghost": lambda: kind.cross_dense(fx, yv, x.shape),
        "dense": lambda: kind.materialize(fx, x.shape) @ yv.T,
    }, path=path, Q=yv.shape[0])


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
    if isinstance(lg.data, Dense):
        return lg.data.values.to(COMPUTE_DTYPE).pow(2).sum(1)
    kind = get_kind(lg.kind)
    f = _f32(lg.data)
    return _cm(cost, lg).run("norm", lg.name, kind.dims(f, lg.shape), {
        "ghost": lambda: kind.sq_norms(f),
        "dense": lambda: torch.linalg.vector_norm(kind.materialize(f, lg.shape), dim=1).square(),
    }, path=path)


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
    if isinstance(lg.data, Dense):
        return lg.replace(data=Dense(lg.data.values.to(COMPUTE_DTYPE).sum(0, keepdim=True)))
    kind = get_kind(lg.kind)
    f = _f32(lg.data)
    flat = Factorized(f.a.reshape(1, -1, *f.a.shape[2:]), f.g.reshape(1, -1, f.g.shape[-1]))
    total = _cm(cost, lg).run("sum", lg.name, kind.dims(f, lg.shape), {
        "ghost": lambda: kind.materialize(flat, lg.shape),
        "dense": lambda: kind.materialize(f, lg.shape).sum(0, keepdim=True),
    }, path=path)
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
    Factorized layers use ``project_kron`` or ``project_dense`` routing; dense ones a matmul
    (``P_out G P_in^T`` for a Kronecker projection of a Kronecker-structured kind, so dense
    rows and factors of one layer land in the same space).
    """
    cfg = projector.config
    if lg.projection is not None and not is_whitened(lg.projection):
        raise ShapeError(f"Layer '{lg.name}' is already projected ({lg.projection})")
    if lg.shard is not None:
        return _project_shard(lg, projector, cost, path)
    if lg.projection is not None:  # whitened rows (KFACFactors.whiten): project them too
        done = project(lg.replace(projection=None), projector, cost, path)
        return done.replace(projection=f"{done.projection}+{lg.projection}")
    o, i = lg.shape
    if o * i <= cfg.dim:
        return lg.replace(data=Dense(materialize(lg)), projection=f"identity:{cfg.tag}")
    dev = lg.device
    if projector.kind_of(o, i) == "kronecker" and not get_kind(lg.kind).dense_only:
        ko, ki = kron_dims(cfg.dim, o, i)
        p_out = projector.side(lg.name, "out", ko, o, dev)
        p_in = projector.side(lg.name, "in", ki, i, dev)
        if isinstance(lg.data, Factorized):
            vals = _kron_apply(lg, p_out, p_in, cost, path)
        else:  # dense rows of a Kronecker-structured layer (e.g. a preconditioned query)
            vals = (p_out @ materialize(lg).view(-1, o, i) @ p_in.T).reshape(lg.batch_size, -1)
        return lg.replace(data=Dense(vals), projection=cfg.tag)
    return lg.replace(data=Dense(_project_dense(lg, projector, cost, path)), projection=cfg.tag)


def is_whitened(tag: str | None) -> bool:
    """Whether a projection tag marks curvature-whitened rows not yet randomly projected."""
    return tag is not None and tag.startswith("whitened:")


def _kron_apply(lg: LayerGrad, p_out: torch.Tensor, p_in: torch.Tensor,
                cost: CostModel | None, path: str | None) -> torch.Tensor:
    """``vec(P_out G_b P_in^T)`` ``[B, ko*ki]`` of a factorized layer, ghost or dense route."""
    kind = get_kind(lg.kind)
    f = _f32(lg.data)
    ko, ki = p_out.shape[0], p_in.shape[0]
    dec = _cm(cost, lg).choose("project_kron", lg.name, kind.dims(f, lg.shape), ko=ko, ki=ki,
                               path=path)
    if dec.path == "ghost":
        return kind.project_kron(f, p_out, p_in)
    o, i = lg.shape
    g = kind.materialize(f, lg.shape).view(-1, o, i)
    return (p_out @ g @ p_in.T).reshape(g.shape[0], -1)


def _project_dense(lg: LayerGrad, projector: Projector, cost: CostModel | None,
                   path: str | None) -> torch.Tensor:
    """Dense or sparse projection; the dense ghost path ``sum_t g_t^T P_p a_t`` only wins
    when T == 1; sparse always materializes (its matmul is ``B*D*s``)."""
    k = projector.config.dim
    if isinstance(lg.data, Dense):
        return projector.apply(lg.name, lg.data.values.to(COMPUTE_DTYPE), k)
    kind = get_kind(lg.kind)
    f = _f32(lg.data)
    def dense() -> torch.Tensor:
        return projector.apply(lg.name, kind.materialize(f, lg.shape), k)

    if projector.sparse:  # B*D*s work: materializing dominates
        return dense()

    def ghost() -> torch.Tensor:
        if not f.a.is_floating_point():
            return dense()
        o, i = lg.shape
        return kind.cross_dense(f, projector.dense_matrix(lg.name, o * i, k).to(f.g.device),
                                lg.shape)
    return _cm(cost, lg).run("project_dense", lg.name, kind.dims(f, lg.shape),
                             {"ghost": ghost, "dense": dense}, path=path, P=k)


def project_batch(batch: GradBatch, projector: Projector, cost: CostModel | None = None,
                  path: str | None = None) -> GradBatch:
    """Project every layer of a batch (same ids, step and token counts).

    Sharded layers' partial projections are reduced together: one all-reduce per group.
    """
    layers: dict[str, LayerGrad] = {}
    deferred: list[tuple[str, ShardInfo]] = []
    for n, lg in batch.layers.items():
        shard = lg.shard
        if (shard is not None and lg.projection is None
                and shard.full_shape[0] * shard.full_shape[1] > projector.config.dim):
            layers[n] = _project_shard(lg, projector, cost, path, reduce=False)
            deferred.append((n, shard))
        else:
            layers[n] = project(lg, projector, cost, path)
    _reduce_layers(layers, deferred)
    return GradBatch(batch.step, batch.sample_ids, layers, batch.micro_batch, batch.token_counts)


# ---- tensor-parallel shards ------------------------------------------------------------
def _reduce_shard(t: torch.Tensor, shard: ShardInfo | None) -> torch.Tensor:
    """All-reduce a partial result over the shard group (nothing unsharded or at world 1)."""
    if shard is not None and shard.world > 1:
        t = all_reduce_sum(t.contiguous(), shard.group, shard.world)
    return t


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


def _to_local(lg: LayerGrad, shard: ShardInfo, local_shape: tuple[int, int]) -> LayerGrad:
    """``lg`` as an unsharded LayerGrad of the local block described by ``shard``.

    A shard must match ``shard`` exactly; an unsharded, unprojected side of the full shape
    is sliced (dense rows by ``ShardInfo.local_of``, float factors along the sharded side).
    """
    if lg.shard is not None:
        if lg.shard != shard or tuple(lg.shape) != tuple(local_shape):
            raise ShapeError(
                f"Layer '{lg.name}': cannot combine tensor-parallel shard {lg.shard} shape "
                f"{lg.shape} with shard {shard} shape {local_shape}; both sides must come from "
                f"the same rank of the same tensor-parallel layout")
        return lg.replace(shard=None)
    if lg.projection is not None or tuple(lg.shape) != tuple(shard.full_shape):
        raise ShapeError(
            f"Layer '{lg.name}': a tensor-parallel shard of full shape {shard.full_shape} can "
            f"only be paired with the same shard or an unprojected full layer, got projection "
            f"{lg.projection!r} shape {lg.shape}; project both sides with the same "
            f"ProjectionConfig (projected layers are whole)")
    if isinstance(lg.data, Dense):
        return lg.replace(data=Dense(shard.local_of(lg.data.values, local_shape)),
                          shape=tuple(local_shape))
    f = lg.data
    n = local_shape[shard.dim]
    if shard.dim == 1 and not f.a.is_floating_point():
        raise UnsupportedLayerError(
            f"Layer '{lg.name}' ({lg.kind}): index-input factors cannot be sliced to a "
            f"vocabulary shard; materialize the full layer first")
    sliced = (Factorized(f.a, f.g.narrow(-1, shard.start, n)) if shard.dim == 0
              else Factorized(f.a.narrow(-1, shard.start, n), f.g))
    return lg.replace(data=sliced, shape=tuple(local_shape))


def _project_shard(lg: LayerGrad, projector: Projector, cost: CostModel | None,
                   path: str | None, reduce: bool = True) -> LayerGrad:
    """Project a shard with its slice of the full layer's seeded matrix; reduce ``[B, P]``.

    Kronecker: ``P vec(G) = vec(P_out G P_in^T) = sum_r vec(P_out[:, R_r] G_r P_in^T)`` for
    row blocks ``R_r`` (column-parallel), and likewise with ``P_in[:, C_r]`` for column
    blocks (row-parallel). Dense: ``P vec(G) = sum_r P[:, idx_r] vec(G_r)`` from the
    materialized local rows; each rank generates the seeded column blocks its entries touch
    (for a row-parallel shard every block, as an unsharded layer would) and does 1/R of the
    matmul. ``reduce=False`` leaves the partial ``[B, P]`` for a batched reduction.
    """
    shard, cfg = lg.shard, projector.config
    o, i = shard.full_shape
    if o * i <= cfg.dim:
        return lg.replace(data=Dense(gather_shards(lg)), shape=tuple(shard.full_shape),
                          shard=None, projection=f"identity:{cfg.tag}")
    local = lg.replace(shard=None)
    if projector.kind_of(o, i) == "kronecker" and isinstance(lg.data, Factorized):
        dev = lg.device
        ko, ki = kron_dims(cfg.dim, o, i)
        p_out = projector.side(lg.name, "out", ko, o, dev)
        p_in = projector.side(lg.name, "in", ki, i, dev)
        n = lg.shape[shard.dim]
        if shard.dim == 0:
            p_out = p_out.narrow(1, shard.start, n)
        else:
            p_in = p_in.narrow(1, shard.start, n)
        vals = _kron_apply(local, p_out, p_in, cost, path)
    else:
        x = materialize(local)
        vals = projector.apply_at(lg.name, x, cfg.dim, shard.flat_index(lg.shape, x.device),
                                  o * i)
    if reduce:
        vals = _reduce_shard(vals, shard)
    return lg.replace(data=Dense(vals), shape=tuple(shard.full_shape), shard=None,
                      projection=cfg.tag)


def _reduce_layers(layers: dict[str, LayerGrad], deferred: list[tuple[str, ShardInfo]]) -> None:
    """All-reduce the partial dense values of ``deferred`` layers, one flat buffer per group."""
    groups: dict[tuple[int, int], list[tuple[str, ShardInfo]]] = {}
    for n, shard in deferred:
        groups.setdefault((id(shard.group), shard.world), []).append((n, shard))
    for members in groups.values():  # insertion (layer) order: the same on every rank
        vals = [layers[n].data.values for n, _ in members]
        flat = _reduce_shard(torch.cat([v.reshape(-1) for v in vals]), members[0][1])
        for (n, _), part in zip(members, flat.split([v.numel() for v in vals])):
            layers[n] = layers[n].replace(data=Dense(part.view_as(layers[n].data.values)))


def _all_gather_cat(t: torch.Tensor, dim: int, shard: ShardInfo, name: str) -> torch.Tensor:
    """Concatenate every shard's ``t`` along ``dim`` in rank order (sizes may differ)."""
    sizes = all_gather_object(int(t.shape[dim]), shard.group, shard.world)
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    if starts[shard.rank] != shard.start or sum(sizes) != shard.full_shape[shard.dim]:
        raise ShapeError(
            f"Layer '{name}': shard sizes {sizes} along dim {shard.dim} do not tile the full "
            f"shape {shard.full_shape} in rank order (rank {shard.rank} starts at "
            f"{shard.start})")
    if shard.world == 1:
        return t
    import torch.distributed as dist

    pad = max(sizes) - t.shape[dim]
    widths = [0, 0] * (t.dim() - 1 - dim) + [0, pad]
    padded = torch.nn.functional.pad(t, widths).contiguous()
    bufs = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(bufs, padded, group=shard.group)
    return torch.cat([b.narrow(dim, 0, n) for b, n in zip(bufs, sizes)], dim)


def gather_shards(lg: LayerGrad) -> torch.Tensor:
    """Full canonical per-example rows ``[B, O*I']`` of a sharded layer (all-gather).

    Communicates the whole per-example gradient: meant for tests, checks and layers no
    larger than a projection. Unsharded layers are simply materialized.
    """
    if lg.shard is None:
        return materialize(lg)
    local = materialize(lg.replace(shard=None))
    b = local.shape[0]
    full = _all_gather_cat(local.view(b, *lg.shape), lg.shard.dim + 1, lg.shard, lg.name)
    return full.reshape(b, -1)


def unshard(lg: LayerGrad) -> LayerGrad:
    """The unsharded layer's factorized gradient on every rank of the shard group.

    All-gathers the sharded factor along its feature dimension (``g [B, T, o]`` for
    column-parallel, ``a [B, T, i']`` for row-parallel): activation-sized communication,
    after which every op (K-FAC included) sees exactly the layer of a TP=1 run.
    Vocabulary shards (index inputs, a token's output-grad non-zero on its owner only)
    all-reduce ``g [B, T, H]`` and the owners' global indices.

    Raises:
        UnsupportedLayerError: dense shards.
    """
    shard = lg.shard
    if shard is None:
        return lg
    f = lg.data
    if not isinstance(f, Factorized):
        raise UnsupportedLayerError(
            f"Layer '{lg.name}' ({lg.kind}): a dense shard has no factors to unshard; use "
            f"gather_shards() for its full rows, or exclude the layer")
    if not f.a.is_floating_point():
        own = (f.g != 0).any(-1)
        idx = torch.where(own, f.a + shard.start, torch.zeros_like(f.a))
        f = Factorized(_reduce_shard(idx, shard), _reduce_shard(f.g.clone(), shard))
    elif shard.dim == 0:
        f = Factorized(f.a, _all_gather_cat(f.g.contiguous(), 2, shard, lg.name))
    else:
        f = Factorized(_all_gather_cat(f.a.contiguous(), 2, shard, lg.name), f.g)
    return lg.replace(data=f, shape=tuple(shard.full_shape), shard=None)


def unshard_batch(batch: GradBatch) -> GradBatch:
    """``unshard`` every sharded layer of a batch (same ids, step and token counts)."""
    layers = {n: unshard(lg) for n, lg in batch.layers.items()}
    return GradBatch(batch.step, batch.sample_ids, layers, batch.micro_batch, batch.token_counts)
