"""Layers of one shape, worked on as one: stacked tensors, so one kernel serves them all.

A captured backward hands over one ``(a, g)`` pair per layer; doing each layer's small
per-example work on its own launches a kernel per layer, and on a GPU at the sizes of
fine-tuning and selection the step then waits on launches, not on flops (docs/kernels.md).
Layers whose tensors have one shape (every block's q/o, every MLP up-projection) are
stacked along a new leading dim ``L`` and handled as ``L * B`` examples by the layer kind's
ordinary maths: the per-example values are the same, the launches are per group.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["grouped", "stack", "scale_examples", "scaled", "owned", "stack_pays", "shape_key",
           "shape_groups"]

def grouped(keys: Sequence[Hashable | None]) -> list[list[int]]:
    """Positions of ``keys`` in groups of equal key, first appearance first; a ``None`` key
    is a group of its own."""
    groups: dict[object, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(("alone", i) if k is None else ("key", k), []).append(i)
    return list(groups.values())


def shape_key(t: torch.Tensor) -> tuple:
    """What tensors must share to be stacked: shape, dtype and device."""
    return tuple(t.shape), t.dtype, t.device


def shape_groups(ts: Sequence[torch.Tensor]) -> list[list[int]]:
    """Positions of ``ts`` in groups of one ``shape_key``."""
    return grouped([(tuple(t.shape), t.dtype, t.device) for t in ts])


def stack_pays(cost, ts: Sequence[torch.Tensor], each: int, extra: int = 0) -> bool:
    """Whether doing the work of the layers of ``ts`` (one tensor each, equal shapes) as one
    stacked group pays on their device: stacking writes and reads every tensor once more,
    ``copy_bytes``, against ``len(ts) * each`` launches becoming ``each + extra``, each
    worth ``launch_s * bytes_per_s`` bytes of copy on the cost model's roofline. A GPU at
    the sizes of fine-tuning stacks (20 us buys 40 MB of copies); a CPU core stacks small
    layers only (5 us buys 100 kB), so its large layers run as before. A ``cost`` of None
    always stacks."""
    n = len(ts)
    saved = n * each - (each + extra)
    if n < 2 or saved <= 0:
        return False
    if cost is None:
        return True
    r = cost.roofline  # read here: the price of a launch in bytes of copy
    return 2 * n * ts[0].numel() * ts[0].element_size() <= saved * r.launch_s * r.bytes_per_s


def stack(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[L, ...]`` of equal-shape tensors: a view when they already are consecutive slices of
    one tensor (or there is one), else one copy (``torch.stack``)."""
    if len(ts) == 1:
        return ts[0].unsqueeze(0)
    base = _common_base(ts)
    return base if base is not None else torch.stack(list(ts))


def _common_base(ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The ``[L, ...]`` tensor whose slices ``0..L-1`` are ``ts``, when there is one."""
    base = ts[0]._base
    if base is None or base.dim() != ts[0].dim() + 1 or base.shape[0] != len(ts) or \
            not base.is_contiguous():
        return None
    step = base.stride(0)
    for i, t in enumerate(ts):
        if t._base is not base or t.storage_offset() != base.storage_offset() + i * step or \
                t.shape != base.shape[1:] or t.stride() != base.stride()[1:]:
            return None
    return base


def owned(stacked: torch.Tensor, ts: Sequence[torch.Tensor]) -> bool:
    """Whether ``stack(ts)`` returned a fresh tensor (safe to change in place)."""
    return len(ts) > 1 and stacked._base is None and all(stacked is not t._base for t in ts)


def scale_examples(g: torch.Tensor, scale: torch.Tensor, bdim: int = 0,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``g`` with example ``b`` (along ``bdim``) multiplied by ``scale[b]``; computed in
    float32 and returned in ``dtype`` (default ``g``'s)."""
    dtype = dtype or g.dtype
    shape = [1] * g.dim()
    shape[bdim] = -1
    return (g.float() * scale.to(device=g.device, dtype=torch.float32).view(shape)).to(dtype)


def scaled(gs: Sequence[torch.Tensor], scale: torch.Tensor, dtype: torch.dtype | None = None,
           cost=None) -> list[torch.Tensor]:
    """``scale_examples`` of batch-first tensors, one multiply per group of equal shapes
    where stacking pays (``stack_pays``): the group is stacked ``[L, B, ...]`` and scaled in
    place. Returns the scaled tensors (views of the stacks), in order."""
    out: list[torch.Tensor] = list(gs)
    for idx in shape_groups(gs):
        members = [gs[i] for i in idx]
        if not stack_pays(cost, members, 1, 1):
            for i in idx:
                out[i] = scale_examples(gs[i], scale, 0, dtype)
            continue
        g = stack(members)
        view = [1, -1] + [1] * (g.dim() - 2)
        s = scale.to(device=g.device, dtype=torch.float32).view(view)
        if g.dtype == torch.float32 and owned(g, members):
            g = g.mul_(s)
        else:
            g = g.float() * s
        g = g.to(dtype or members[0].dtype)
        for j, i in enumerate(idx):
            out[i] = g[j]
    return out
