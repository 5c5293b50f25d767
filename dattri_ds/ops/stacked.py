"""Projecting the layers of one kind and shape as one stacked group: kernels per group.

``ops.space.project_batch`` hands over the layers a stacked product can take (unsharded,
canonical factors, batch-first) and projects the rest one at a time. Three strategies, each
the layer kind's own per-example maths on ``L`` layers stacked as ``L * B`` examples
(``layers/stacking.py``), so every row equals its one-layer projection up to float
rounding:

* ``exact`` (``O*I' <= k``, kept exactly): the materialized rows ``[L*B, O*I']`` in one
  product.
* ``kron`` (Kronecker, ghost path): one batched product per side and group,
  ``P_out g_t`` (``[L, B*T, ko]``) and ``P_in a_t`` (``[L, B*T, ki]``, a gather for index
  inputs), written into one buffer per ``(ko, ki, B, T)``; then
  ``sum_t (P_out g_t)(P_in a_t)^T`` for every layer of the buffer in one product.
* ``sparse`` (sparse JL, a layer materialized in one span): the group's rows, transposed to
  ``[L*D, B]``, times the layers' seeded blocks as one block-diagonal CSR
  (``Projector.stacked_csr``); the blocks' partial sums added as ``apply_columns`` adds
  them.

Groups are cut where stacking does not pay on the device (``CostModel.stacks``: a copy of
the group's factors against the launches it saves; a CPU core keeps large layers apart) or
past ``STACK_BYTES``. ``scale`` (``[B]``), when given, multiplies every row: the capture's
per-example scale, applied to the few projected values instead of the output-grads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dattri_ds.gradient import Dense, Factorized, LayerGrad
from dattri_ds.layers.base import COMPUTE_DTYPE
from dattri_ds.layers.stacking import grouped, stack, stack_pays
from dattri_ds.ops.projection import BLOCK, Projector

__all__ = ["STACK_BYTES", "strategy", "project_stacked"]

#: Upper bound on the bytes one stacked group copies (its stacked factors or rows).
STACK_BYTES = 1 << 28
#: Output rows per product of a sparse layer's span on a CPU (``SparseKind.project_rows``).
_SPAN_ROWS = 64


def strategy(lg: LayerGrad, projector: Projector, cost) -> str | None:
    """``exact``, ``kron`` or ``sparse`` for a layer a stacked group can project, else None.

    A sparse layer is stacked when its rows are materialized whole anyway (one span of
    ``SparseKind.project_rows``), or when writing and reading them costs no more than one
    launch on the device (``CostModel``'s roofline): a CPU core keeps streaming larger
    layers a cache-sized span at a time, a GPU takes them whole."""
    data, space, (o, i) = lg.data, lg.space, lg.shape
    if lg.shard is not None:
        return None
    dense = isinstance(data, Dense)  # rows (whitened, or a dense-only kind's): sparse only
    if not (space.canonical or (dense and space.awaiting_projection)):
        return None
    if o * i <= projector.config.dim:
        return None if dense else "exact"
    how = projector.kind_for(o, i).stacked
    if how == "kron" and not dense and not lg.kind.dense_only:
        return how
    if how != "sparse" or not (dense or lg.kind.output_sliceable):
        return None
    r = cost.roofline
    rows = data.values.shape[0] if dense else data.g.shape[0]
    whole = 8 * rows * o * i <= r.launch_s * r.bytes_per_s
    return "sparse" if o * i <= _span(i) or whole else None


def _span(i: int) -> int:
    """Columns ``SparseKind.project_rows`` materializes at once on a CPU (whole blocks)."""
    return max(1, -(-_SPAN_ROWS * i // BLOCK)) * BLOCK


def _key(lg: LayerGrad, how: str | None) -> tuple | None:
    """What the layers of one stacked group share (None: projected alone)."""
    f = lg.data
    if how is None:
        return None
    if isinstance(f, Dense):
        v = f.values
        return how, id(lg.kind), lg.shape, lg.space, v.shape, v.dtype, v.device
    return how, id(lg.kind), lg.shape, f.a.shape, f.a.dtype, f.g.shape, f.g.dtype, f.g.device


#: Launches per layer alone and the extra launches of a stacked group, per strategy:
#: exact (product, scale | stack a, stack g), sparse (product, transpose, sparse product,
#: scale | the stacks, the blocks' sum), kron (one product per side | none).
_LAUNCHES = {"exact": (2, 2), "sparse": (4, 3), "kron": (2, 0)}


def _chunks(group: list[LayerGrad], cost, how: str) -> list[list[LayerGrad]]:
    """``group`` cut into stacked chunks under ``STACK_BYTES``; single layers where stacking
    does not pay (``stack_pays``)."""
    lg = group[0]
    f = lg.data
    if isinstance(f, Dense):
        per = 8 * f.values.numel()
    else:
        per = 4 * (f.g.numel() + (f.a.numel() if f.a.is_floating_point() else 0))
        if how != "kron":  # the materialized rows
            per += 4 * f.g.shape[0] * lg.shape[0] * lg.shape[1]
    step = max(1, STACK_BYTES // max(per, 1))
    each, extra = _LAUNCHES[how]
    out = []
    for start in range(0, len(group), step):
        part = group[start:start + step]
        if len(part) > 1 and not stack_pays(cost, [_main(x) for x in part], each, extra):
            out.extend([x] for x in part)
        else:
            out.append(part)
    return out


def _main(lg: LayerGrad) -> torch.Tensor:
    """The tensor a stacked group copies most of: the output-grads, or the rows."""
    return lg.data.values if isinstance(lg.data, Dense) else lg.data.g


def _factors(part: list[LayerGrad]) -> Factorized:
    """The layers' factors stacked as ``L * B`` examples, in ``COMPUTE_DTYPE``."""
    f = part[0].data
    if len(part) == 1 and f.g.dtype == COMPUTE_DTYPE and (
            f.a.dtype == COMPUTE_DTYPE or not f.a.is_floating_point()):
        return f  # one layer as it is
    a = stack([lg.data.a for lg in part])
    g = stack([lg.data.g for lg in part]).to(COMPUTE_DTYPE)
    if a.is_floating_point():
        a = a.to(COMPUTE_DTYPE)
    return Factorized(a.flatten(0, 1), g.flatten(0, 1))


def project_stacked(layers: Sequence[LayerGrad], hows: Sequence[str], projector: Projector,
                    cost, scale: torch.Tensor | None = None,
                    path: str | None = None) -> dict[str, torch.Tensor]:
    """``[B, P]`` projected rows of every layer, by groups (``hows``: each one's
    ``strategy``).

    Kronecker layers whose cost-model route is not the ghost path are left out (the caller
    projects them alone). ``scale``: ``[B]`` float32 multiplied into the rows of factors.
    """
    out: dict[str, torch.Tensor] = {}
    kron: list[LayerGrad] = []
    for idx in grouped([_key(lg, how) for lg, how in zip(layers, hows)]):
        group = [layers[j] for j in idx]
        how = hows[idx[0]]
        if how == "kron":
            if _ghost(group[0], projector, cost, path):
                kron.extend(group)
            continue
        own = scale if isinstance(group[0].data, Factorized) else None  # rows: as they are
        for part in _chunks(group, cost, how):
            rows = _materialize(part)
            if how == "sparse":
                rows = _sparse(part, rows, projector, own)
            elif own is not None:
                rows = rows.mul_(own.view(1, -1, 1))
            out.update((lg.name, rows[n]) for n, lg in enumerate(part))
    out.update(_kron(kron, projector, cost, scale))
    return out


def _ghost(lg: LayerGrad, projector: Projector, cost, path: str | None) -> bool:
    """Whether the cost model routes this layer's Kronecker projection to the ghost path
    (the decision ``LayerKind.project_factors`` takes, on float32 factors). A calibrating
    cost model times both paths per layer: its layers are projected one at a time."""
    if getattr(cost, "calibrate", False):
        return False
    o, i = lg.shape
    ko, ki = projector.side_dims(o, i)
    return cost.decide("project_kron", lg.name, lg.kind, lg.data, lg.shape, path=path,
                       itemsize=4, ko=ko, ki=ki).path == "ghost"


def _materialize(part: list[LayerGrad]) -> torch.Tensor:
    """``[L, B, O*I']`` rows of the part's layers: materialized in one product, or the
    given rows stacked."""
    lg = part[0]
    if isinstance(lg.data, Dense):
        return stack([x.data.values for x in part]).to(COMPUTE_DTYPE)
    b = lg.data.g.shape[0]
    return lg.kind.materialize(_factors(part), lg.shape).view(len(part), b, -1)


def _sparse(part: list[LayerGrad], rows: torch.Tensor, projector: Projector,
            scale: torch.Tensor | None) -> torch.Tensor:
    """``[L, B, k]``: the rows ``[L, B, D]`` times each layer's sparse matrix, in one
    block-diagonal sparse-dense product."""
    n, b, d = rows.shape
    k = projector.config.dim
    m, nb = projector.stacked_csr(tuple(lg.name for lg in part), d, k, rows.device,
                                  rows.dtype)
    xt = rows.transpose(1, 2).contiguous().view(n * d, b)  # row-major [cols, B]: fast
    y = torch.sparse.mm(m, xt).view(n, nb, k, b)
    y = y[:, 0] if nb == 1 else y.sum(1)
    out = rows.new_empty(n, b, k)
    if scale is None:
        return out.copy_(y.transpose(1, 2))
    return torch.mul(y.transpose(1, 2), scale.view(1, b, 1), out=out)


def _kron(layers: list[LayerGrad], projector: Projector, cost,
          scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Rows of the Kronecker (ghost) layers: both sides per group into one buffer per
    ``(ko, ki, B, T)``, then one product per buffer."""
    out: dict[str, torch.Tensor] = {}
    buckets = [(projector.side_dims(*lg.shape), *lg.data.g.shape[:2], lg.device)
               for lg in layers]
    for idx in grouped(buckets):
        members = [layers[j] for j in idx]
        (ko, ki), b, t, dev = buckets[idx[0]]
        ga = torch.empty(len(members), b * t, ko, dtype=COMPUTE_DTYPE, device=dev)
        aa = torch.empty(len(members), b * t, ki, dtype=COMPUTE_DTYPE, device=dev)
        pos, order = 0, []
        for gidx in grouped([_key(lg, "kron") for lg in members]):
            for part in _chunks([members[j] for j in gidx], cost, "kron"):
                n = len(part)
                _sides(part, projector, ga[pos:pos + n], aa[pos:pos + n])
                order.extend(part)
                pos += n
        rows = torch.bmm(ga.view(-1, t, ko).transpose(1, 2), aa.view(-1, t, ki))
        rows = rows.view(len(members), b, ko * ki)
        if scale is not None:
            rows.mul_(scale.view(1, b, 1))
        out.update((lg.name, rows[n]) for n, lg in enumerate(order))
    return out


def _sides(part: list[LayerGrad], projector: Projector, ga: torch.Tensor,
           aa: torch.Tensor) -> None:
    """``P_out g_t`` into ``ga [L, B*T, ko]`` and ``P_in a_t`` into ``aa [L, B*T, ki]``."""
    lg = part[0]
    p_out_t, p_in_t = projector.stacked_sides(tuple(x.name for x in part), *lg.shape,
                                              lg.device)
    f = _factors(part)
    n = len(part)
    torch.bmm(f.g.reshape(n, -1, f.g.shape[-1]), p_out_t, out=ga)  # L*B rows -> L blocks
    lg.kind.stacked_side_in(f.a.reshape(n, -1, *f.a.shape[2:]), p_in_t, aa)
