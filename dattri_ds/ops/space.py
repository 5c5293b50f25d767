"""Space: THE place a LayerGrad changes space (identity, projected, whitened, TP shards).

A layer's per-example gradients live in one ``gradient.Space`` (``LayerGrad.space``,
re-exported here; its tag is what stores and factor files record); inner products need
both sides in one space. ``project`` / ``project_batch`` take gradients into a projection's
space (the layer's kind does the maths); a tensor-parallel shard is projected with its
slice of the full layer's seeded matrix and its ``[B, P]`` partial all-reduced
(``_project_shard``); ``gather_shards`` (full rows) and ``unshard`` (full factors)
all-gather along the feature dimension.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import torch

from dattri_ds.distributed import all_gather_object, all_reduce_sum
from dattri_ds.errors import ShapeError, UnsupportedLayerError
from dattri_ds.gradient import Dense, Factorized, GradBatch, LayerGrad, ShardInfo, Space
from dattri_ds.ops.cost import CostModel, default_cost_model
from dattri_ds.ops.projection import PROJECTION_KINDS, Projector
from dattri_ds.ops.stacked import project_stacked, strategy

__all__ = ["Space", "project", "project_batch", "project_layers", "gather_shards", "unshard",
           "unshard_batch"]


def project(lg: LayerGrad, projector: Projector, cost: CostModel | None = None,
            path: str | None = None) -> LayerGrad:
    """Project one layer's per-example gradients to ``Dense [B, P]``.

    Layers with ``O*I' <= dim`` are kept exactly (projection tag ``identity:<tag>``). The
    kind does the maths (module docstring): ``project_factors`` for a Kronecker projection
    of a Kronecker-structured kind (factors or dense rows land in the same space),
    ``project_rows`` otherwise; each routed by the cost model. Whitened rows
    (``KFACFactors.whiten``) are projected alike, into ``<projection>+whitened:<method>``.
    """
    space = lg.space
    if space == projector.space and isinstance(lg.data, Factorized):  # kronecker.logra_sides
        return lg.replace(data=Dense(lg.kind.rows(lg.data, lg.shape)))
    if not (space.canonical or space.awaiting_projection):
        raise ShapeError(f"Layer '{lg.name}' is already projected ({space.tag})")
    if lg.shard is not None:
        return _project_shard(lg, projector, cost, path)
    o, i = lg.shape
    done = _projected_space(lg, projector)
    if o * i <= projector.config.dim:
        vals = lg.kind.rows(lg.data, lg.shape)
    else:
        vals = projector.kind_for(o, i).project(projector, lg, cost or default_cost_model(
            lg.device), path)
    return lg.replace(data=Dense(vals), space=done)


def _projected_space(lg: LayerGrad, projector: Projector) -> Space:
    """The space ``project`` takes an unsharded layer into: kept exactly when no larger than
    the projection, whitened-then-projected rows tagged so."""
    o, i = lg.shape
    done = projector.exact_space if o * i <= projector.config.dim else projector.space
    if lg.space.whitened is not None:
        done = _whitened_first(done, lg.space.whitened)
    return done


@lru_cache(maxsize=None)
def _whitened_first(projected: Space, method: str) -> Space:
    """``<projection>+whitened:<method>``: whitened rows, then projected into ``projected``."""
    return projected.replace(whitened=method, whitened_first=True)


def project_batch(batch: GradBatch, projector: Projector, cost: CostModel | None = None,
                  path: str | None = None) -> GradBatch:
    """Project every layer of a batch (same ids, step and token counts): ``project_layers``."""
    return batch.with_layers(project_layers(batch.layers, projector, cost, path))


def project_layers(layers: Mapping[str, LayerGrad], projector: Projector,
                   cost: CostModel | None = None, path: str | None = None,
                   scale: torch.Tensor | None = None) -> dict[str, LayerGrad]:
    """Project every layer, in order; layers of one kind, shape and projection kind as one
    stacked group (``ops/stacked.py``: kernels per group, not per layer).

    Sharded layers' partial projections are reduced together: one all-reduce per group.
    The default cost model is resolved once when every layer is on one device type.
    ``scale`` (``[B]`` float32): multiplied into the rows of every layer given as factors
    (a capture's per-example scale, cheaper on the projected rows); dense rows are taken as
    they are.
    """
    if cost is None and len({lg.device.type for lg in layers.values()}) == 1:
        cost = default_cost_model(next(iter(layers.values())).device)
    cm = cost or default_cost_model(next(iter(layers.values())).device)
    hows = {n: strategy(lg, projector, cm) for n, lg in layers.items()}
    stackable = [n for n, how in hows.items() if how is not None]
    rows = project_stacked([layers[n] for n in stackable], [hows[n] for n in stackable],
                           projector, cm, scale, path) if stackable else {}
    out: dict[str, LayerGrad] = {}
    deferred: list[tuple[str, ShardInfo]] = []
    for n, lg in layers.items():
        shard = lg.shard
        if n in rows:
            done = _projected_space(lg, projector)
            out[n] = lg.replace(data=Dense(rows[n]), space=done)
            continue
        if (shard is not None and lg.space.canonical
                and shard.full_shape[0] * shard.full_shape[1] > projector.config.dim):
            out[n] = _project_shard(lg, projector, cost, path, reduce=False)
            deferred.append((n, shard))
        else:
            out[n] = project(lg, projector, cost, path)
    _reduce_layers(out, deferred)
    if scale is not None:  # the layers projected one at a time
        for n, lg in layers.items():
            if n not in rows and isinstance(lg.data, Factorized):
                values = out[n].data.values
                out[n] = out[n].replace(data=Dense(values * scale.to(values.device)[:, None]))
    return out


def _reduce_shard(t: torch.Tensor, shard: ShardInfo | None) -> torch.Tensor:
    """All-reduce a partial result over the shard group (nothing unsharded or at world 1)."""
    if shard is not None and shard.world > 1:
        t = all_reduce_sum(t.contiguous(), shard.group, shard.world)
    return t


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
    if not lg.space.canonical or tuple(lg.shape) != tuple(shard.full_shape):
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
    if shard.dim == 1 and lg.kind.index_input:
        raise UnsupportedLayerError(
            f"Layer '{lg.name}' ({lg.kind}): index-input factors cannot be sliced to a "
            f"vocabulary shard; materialize the full layer first")
    sliced = (Factorized(f.a, f.g.narrow(-1, shard.start, n)) if shard.dim == 0
              else Factorized(f.a.narrow(-1, shard.start, n), f.g))
    return lg.replace(data=sliced, shape=tuple(local_shape))


def _project_shard(lg: LayerGrad, projector: Projector, cost: CostModel | None,
                   path: str | None, reduce: bool = True) -> LayerGrad:
    """Project a shard with its slice of the full layer's seeded matrix
    (``ProjectionKind.project_shard``); reduce ``[B, P]``. ``reduce=False`` leaves the
    partial ``[B, P]`` for a batched reduction.
    """
    shard, cfg = lg.shard, projector.config
    o, i = shard.full_shape
    if o * i <= cfg.dim:
        return lg.replace(data=Dense(gather_shards(lg)), shape=tuple(shard.full_shape),
                          shard=None, space=projector.exact_space)
    kind = projector.kind_for(o, i)
    if not kind.shardable:
        raise UnsupportedLayerError(
            f"Layer '{lg.name}' is a tensor-parallel shard and projection kind '{kind.name}' "
            f"has no shard rule (only {[n for n, k in PROJECTION_KINDS.items() if k.shardable]}"
            f"); unshard it first (dattri_ds.ops.space.unshard_batch) or use one of those kinds")
    vals = kind.project_shard(projector, lg, shard, cost or default_cost_model(lg.device), path)
    if reduce:
        vals = _reduce_shard(vals, shard)
    return lg.replace(data=Dense(vals), shape=tuple(shard.full_shape), shard=None,
                      space=projector.space)


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
        return lg.kind.rows(lg.data, lg.shape)
    local = lg.kind.rows(lg.data, lg.shape)
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
    if lg.kind.index_input:
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
    return batch.with_layers(layers)
