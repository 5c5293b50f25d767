"""Shared maths of layers whose per-example gradient is a sum of outer products.

For example b: ``G_b = sum_t g[b,t]^T a[b,t]`` (``[O, I']``), with a bias folded in as a
column of ones on ``a``. Linear-like kinds (nn.Linear, HF Conv1D, Megatron parallel
linears) subclass ``OuterProductKind`` and only say how to read their module.
"""

from __future__ import annotations

import torch

from dattri_ds.gradient import Factorized
from dattri_ds.layers.base import LayerKind
from dattri_ds.layers.stacking import scaled, shape_groups, stack, stack_pays

__all__ = ["OuterProductKind", "row_chunks", "rows_matmul", "with_bias_column", "bias_columns"]

#: Upper bound on elements of one ``[c, T, B2, S]`` ghost intermediate (about 64 MB fp32).
GHOST_CHUNK_ELEMENTS = 1 << 24


def row_chunks(n_rows: int, row_elems: int, budget: int = GHOST_CHUNK_ELEMENTS):
    """Yield slices over ``n_rows`` so each chunk holds at most ``budget`` elements."""
    step = max(1, budget // max(1, row_elems))
    for start in range(0, n_rows, step):
        yield slice(start, min(n_rows, start + step))


def with_bias_column(a: torch.Tensor) -> torch.Tensor:
    """``[..., I] -> [..., I+1]``, appending the constant 1 that multiplies the bias."""
    return torch.cat([a, a.new_ones(a.shape[:-1] + (1,))], dim=-1)


def bias_columns(a: list[torch.Tensor], cost=None) -> list[torch.Tensor]:
    """``with_bias_column`` of every tensor, three kernels per group of one shape where
    stacking pays (``stacking.stack_pays``): the group is written stacked into one
    ``[L, ..., I+1]`` tensor (its last column filled with 1s) and returned as views."""
    out: list[torch.Tensor] = list(a)
    for idx in shape_groups(a):
        if not stack_pays(cost, [a[j] for j in idx], 2, 1):
            for j in idx:
                out[j] = with_bias_column(a[j])
            continue
        first = a[idx[0]]
        buf = first.new_empty((len(idx),) + tuple(first.shape[:-1]) + (first.shape[-1] + 1,))
        buf[..., -1].fill_(1)
        buf[..., :-1].copy_(stack([a[j] for j in idx]))
        for n, j in enumerate(idx):
            out[j] = buf[n]
    return out


def rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for ``x [B, T, F]``, also when ``x`` is a ``[T, B, F]`` tensor seen through
    ``transpose(0, 1)`` (sequence-first layers): multiplied in its own memory layout, so
    the large factor is never copied; only the ``[B, T, k]`` result is a strided view."""
    if x.dim() == 3 and not x.is_contiguous() and x.transpose(0, 1).is_contiguous():
        return (x.transpose(0, 1) @ w).transpose(0, 1)
    return x @ w


class OuterProductKind(LayerKind):
    """Kinds with ``G_b = sum_t g_t^T a_t``; subclasses define capture and layout only."""

    output_sliceable = True

    def build(self, module, a, g):
        """Batch-first factors ``[B, T, I']`` (a bias column of ones when the module has a
        bias) and ``[B, T, O]``."""
        a3 = a.reshape(a.shape[0], -1, a.shape[-1])
        if getattr(module, "bias", None) is not None:
            a3 = with_bias_column(a3)
        return Factorized(a3, g.reshape(g.shape[0], -1, g.shape[-1]))

    def build_many(self, modules, pairs, scale=None, dtype=None, cost=None):
        """``build`` of many layers: output-grads scaled one stacked group of one shape at a
        time (``stacking.scaled``), and the bias column added once per distinct input (q, k
        and v share theirs), one stacked group of one shape at a time (``bias_columns``)."""
        if type(self).build is not OuterProductKind.build:  # a kind with its own layout
            return super().build_many(modules, pairs, scale, dtype, cost)
        gs = [g for _, g in pairs]
        if scale is not None:
            gs = scaled(gs, scale, dtype, cost)
        biased = list({id(a): a for (a, _), m in zip(pairs, modules)  # q, k, v share theirs
                       if getattr(m, "bias", None) is not None}.values())
        with_bias = dict(zip(map(id, biased), bias_columns(
            [a.reshape(a.shape[0], -1, a.shape[-1]) for a in biased], cost))) if biased else {}
        return [Factorized(with_bias[id(a)] if getattr(m, "bias", None) is not None
                           else a.reshape(a.shape[0], -1, a.shape[-1]),
                           g.reshape(g.shape[0], -1, g.shape[-1]))
                for (a, _), g, m in zip(pairs, gs, modules)]

    def materialize(self, f: Factorized, shape: tuple[int, int]) -> torch.Tensor:
        """``einsum('bto,bti->boi')`` flattened: ``[B, O*I]``; cost 2*B*T*O*I flops."""
        b = f.g.shape[0]
        return torch.bmm(f.g.transpose(1, 2), f.a).reshape(b, -1)

    def cross_gram(self, x: Factorized, y: Factorized) -> torch.Tensor:
        """``<G_b, G_q> = sum_{t,s} (a_bt . a_qs)(g_bt . g_qs)``.

        Computed as two flat matmuls ``[B1*T, B2*S]`` and a reduction, chunked over B1 so
        the intermediate stays under GHOST_CHUNK_ELEMENTS. Cost 2*B1*B2*T*S*(I+O) flops.
        """
        b1, t, _ = x.a.shape
        b2, s, _ = y.a.shape
        ya = y.a.reshape(b2 * s, -1)
        yg = y.g.reshape(b2 * s, -1)
        out = x.g.new_empty(b1, b2)
        for sl in row_chunks(b1, t * b2 * s):
            xa = x.a[sl].reshape(-1, x.a.shape[-1])
            xg = x.g[sl].reshape(-1, x.g.shape[-1])
            prod = (xa @ ya.T) * (xg @ yg.T)
            out[sl] = prod.view(-1, t, b2, s).sum(dim=(1, 3))
        return out

    def sq_norms(self, f: Factorized) -> torch.Tensor:
        """``sum_{t,s} (a_t.a_s)(g_t.g_s)`` per example via two batched ``[T, T]`` grams."""
        t = f.g.shape[1]
        out = f.g.new_empty(f.g.shape[0])
        for sl in row_chunks(f.g.shape[0], t * t):
            a, g = f.a[sl], f.g[sl]
            out[sl] = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
        return out

    def cross_dense(self, x: Factorized, y: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """``<G_b, Y_q> = sum_t g_bt . (Y_q a_bt)`` -> ``[B, Q]``; cost 2*B*T*I*O*Q flops."""
        b, t, i = x.a.shape
        o = x.g.shape[-1]
        q = y.shape[0]
        y3 = y.reshape(q * o, i)
        out = x.g.new_empty(b, q)
        for sl in row_chunks(b, t * q * o):
            z = (x.a[sl].reshape(-1, i) @ y3.T).view(-1, t, q, o)
            # a broadcast product + sum: einsum("btqo,bto->bq") permuted z into a copy
            # first, which doubled the time of this op (in the selection step)
            out[sl] = (z * x.g[sl].unsqueeze(2)).sum(dim=(1, 3))
        return out

    def project_kron(self, f: Factorized, p_out: torch.Tensor, p_in: torch.Tensor) -> torch.Tensor:
        """``sum_t (P_out g_t)(P_in a_t)^T`` -> ``[B, ko*ki]``; cost 2*B*T*(O*ko + I*ki + ko*ki)."""
        ga = rows_matmul(f.g, p_out.T)  # [B, T, ko]
        aa = rows_matmul(f.a, p_in.T)  # [B, T, ki]
        return torch.bmm(ga.transpose(1, 2), aa).reshape(f.g.shape[0], -1)
