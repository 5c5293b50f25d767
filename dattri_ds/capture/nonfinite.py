"""Non-finite examples: one device-side total per batch, read once with the sample ids.

The capture must drop (or refuse) examples whose gradient holds a NaN/inf, and it must give
every row a content-hash id, which needs the tokens on the host. Both are read in one copy
per batch (``semantics.read_once``: the batch's one host sync): the sample ids' tokens and
``finite_total``, one number whose finiteness is the batch's. Only when it is not finite
does ``nonfinite_rows`` look for the examples, one reduction per tensor (and more syncs):
the rare path pays, the common one does not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from dattri_ds.gradient import Dense, Factorized, GradBatch, LayerGrad
from dattri_ds.capture.semantics import read_once

__all__ = ["finite_total", "agreed_total", "read_with_flag", "nonfinite_rows", "shard_groups"]


def _tensors(layers: Iterable[LayerGrad]) -> dict[tuple, list[torch.Tensor]]:
    """Every float tensor the layers' rows are made of (inputs shared by several layers
    once), by ``(dtype, device)``."""
    seen: set[int] = set()
    out: dict[tuple, list[torch.Tensor]] = {}
    for lg in layers:
        d = lg.data
        for t in ((d.values,) if isinstance(d, Dense) else (d.a, d.g)):
            if t.is_floating_point() and t.numel() and id(t) not in seen:
                seen.add(id(t))
                out.setdefault((t.dtype, t.device), []).append(t)
    return out


def finite_total(layers: Iterable[LayerGrad]) -> torch.Tensor | None:
    """0-d float64: the sum of the L2 norms of every tensor of the layers, finite exactly
    when every value is (a norm that overflows reads as non-finite: ``nonfinite_rows`` then
    finds every example finite). One multi-tensor norm per dtype, then one sum; None when
    there is no float value."""
    groups = _tensors(layers)
    if not groups:
        return None
    norms = [n for (dtype, _), ts in groups.items() for n in torch._foreach_norm(
        ts, 2, dtype=torch.float32 if dtype.itemsize < 4 else None)]
    dev = norms[0].device
    return torch.stack([n.to(dev) for n in norms]).sum(dtype=torch.float64)


def agreed_total(total: torch.Tensor, groups: Iterable) -> torch.Tensor:
    """``total`` as a flag every tensor-parallel peer agrees on: 1.0 when any rank's total
    is not finite (max-reduced over each shard group), else 0.0."""
    import torch.distributed as dist

    flag = (~torch.isfinite(total)).to(torch.float64)
    for shard in groups:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard.group)
    return torch.where(flag > 0, torch.full_like(flag, float("nan")), flag)


def read_with_flag(tensors: list[torch.Tensor], layers: Iterable[LayerGrad],
                   agree: bool) -> tuple[list[torch.Tensor], bool]:
    """Host copies of ``tensors`` (int64) and whether every value of ``layers`` is finite,
    in one copy: the caller's one host sync. With ``agree`` (unprojected tensor-parallel
    shards) the peers of every shard group take the same answer."""
    layers = list(layers)
    total = finite_total(layers)
    if total is None:
        return read_once(tensors), True
    groups = shard_groups(layers) if agree else []
    if groups:
        total = agreed_total(total, groups)
    host = read_once(tensors + [total.reshape(1).view(torch.int64)])
    return host[:-1], math.isfinite(host[-1].view(torch.float64)[0].item())


def _bad_rows(data: Factorized | Dense) -> torch.Tensor:
    """``[B]`` bool: examples with a NaN/inf in their factors (one reduction per tensor: NaN
    and inf propagate through the per-example sums)."""
    if isinstance(data, Dense):
        return ~torch.isfinite(data.values.sum(dim=1, dtype=torch.float32))
    bad = ~torch.isfinite(data.g.sum(dim=(1, 2), dtype=torch.float32))
    if data.a.is_floating_point():
        bad |= ~torch.isfinite(data.a.sum(dim=tuple(range(1, data.a.dim())), dtype=torch.float32))
    return bad


def nonfinite_rows(batch: GradBatch, agree: bool) -> tuple[torch.Tensor | None, str | None]:
    """``([B] bool of examples with a NaN/inf gradient in any layer, first such layer)``, or
    ``(None, None)`` when every example is finite.

    Tensor-parallel ranks must take the same decision per example (a rank dropping an
    example its peers keep would desynchronize their collectives). Projected batches already
    agree: sharded layers were all-reduced. With ``agree`` (unprojected factors, each rank
    checks only its shard) the ``[B]`` mask is max-reduced over each shard group: one
    B-element reduction per batch. The layer is ``""`` when only a peer's shard was bad.
    """
    per_layer = {n: _bad_rows(lg.data) for n, lg in batch.layers.items()}
    if not per_layer:
        return None, None
    bad = None  # OR of every layer's rows on the device: no host sync per layer
    for rows in per_layer.values():
        bad = rows if bad is None else bad | rows.to(bad.device)
    groups = shard_groups(batch.layers.values()) if agree else []
    if groups:
        import torch.distributed as dist

        flag = bad.to(torch.float32)
        for shard in groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard.group)
        bad = flag > 0
    if not bool(bad.any()):
        return None, None
    first = next((n for n, rows in per_layer.items() if bool(rows.any())), "")
    return bad, first


def shard_groups(layers: Iterable[LayerGrad]) -> list:
    """One ``ShardInfo`` per tensor-parallel group (world > 1) the layers are sharded over."""
    return list({id(lg.shard.group): lg.shard for lg in layers
                 if lg.shard is not None and lg.shard.world > 1}.values())
