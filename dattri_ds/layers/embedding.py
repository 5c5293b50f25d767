"""nn.Embedding: the input side is a one-hot index, so it is kept as indices ``[B, T]``.

Canonical layout: ``G_b = sum_t g_bt^T onehot(idx_bt)`` is ``[D, V]`` (O = embedding dim,
I = vocabulary), the transpose of the weight ``[V, D]``.
"""

from __future__ import annotations

import torch
from torch import nn

from dattri_ds.errors import UnsupportedLayerError
from dattri_ds.gradient import Factorized
from dattri_ds.layers.base import LayerKind
from dattri_ds.layers.outer import row_chunks, rows_matmul

__all__ = ["EmbeddingKind"]


class EmbeddingKind(LayerKind, name="embedding", modules=(nn.Embedding,)):
    """Per-example embedding gradients from indices and output-grads (the index case of
    every op lives here: the input side is a one-hot column, never a matrix)."""

    index_input = True
    output_sliceable = True

    def check(self, module: nn.Module, name: str) -> None:
        if module.max_norm is not None:
            raise UnsupportedLayerError(
                f"Layer '{name}': nn.Embedding with max_norm={module.max_norm} renormalizes "
                f"its weight in forward; per-example gradients are not supported. Exclude it "
                f"with capture.exclude=['{name}']"
            )

    def layer_shape(self, module: nn.Module) -> tuple[int, int]:
        return module.embedding_dim, module.num_embeddings

    def build(self, module, a, g):
        if tuple(a.shape) != tuple(g.shape[:-1]):
            a = a.expand(g.shape[:-1])  # e.g. position ids [1, T] broadcast over the batch
        idx = a.reshape(a.shape[0], -1)
        g3 = g.reshape(g.shape[0], -1, g.shape[-1])
        if module.padding_idx is not None:
            g3 = g3 * (idx != module.padding_idx).unsqueeze(-1).to(g3.dtype)
        return Factorized(idx, g3)

    def materialize(self, f: Factorized, shape: tuple[int, int]) -> torch.Tensor:
        """Scatter-add ``g_bt`` into column ``idx_bt``: ``[B, D*V]``; cost B*T*D adds.

        Straight into the ``[B, D, V]`` layout (an ``[B, V, D]`` index-add and a transposing
        copy cost 3-5x as much on the CPU; the same sums in the same order)."""
        b, t, d = f.g.shape
        m = f.g.new_zeros(b, d, shape[1])
        m.scatter_add_(2, f.a.unsqueeze(1).expand(b, d, t), f.g.transpose(1, 2))
        return m.view(b, -1)

    def cross_gram(self, x: Factorized, y: Factorized) -> torch.Tensor:
        """``sum_{t,s} [idx_bt == idx_qs] (g_bt . g_qs)``; cost B1*B2*T*S*(2*D + 1)."""
        b1, t = x.a.shape
        b2, s = y.a.shape
        yi = y.a.reshape(-1)
        yg = y.g.reshape(b2 * s, -1)
        out = x.g.new_empty(b1, b2)
        for sl in row_chunks(b1, t * b2 * s):
            eq = x.a[sl].reshape(-1, 1) == yi.unsqueeze(0)
            prod = (x.g[sl].reshape(-1, x.g.shape[-1]) @ yg.T) * eq
            out[sl] = prod.view(-1, t, b2, s).sum(dim=(1, 3))
        return out

    def sq_norms(self, f: Factorized) -> torch.Tensor:
        """``sum_{t,s} [idx_t == idx_s] (g_t.g_s)`` per example."""
        eq = f.a.unsqueeze(2) == f.a.unsqueeze(1)
        return (torch.bmm(f.g, f.g.transpose(1, 2)) * eq).sum((1, 2))

    def cross_dense(self, x: Factorized, y: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """``sum_t g_bt . Y_q[:, idx_bt]`` -> ``[B, Q]``; cost 2*B*T*D*Q (a gather, no V)."""
        vocab = shape[1]
        b, t, d = x.g.shape
        q = y.shape[0]
        y3 = y.reshape(q, d, vocab)
        out = x.g.new_empty(b, q)
        for sl in row_chunks(b, t * q * d):
            cols = y3[:, :, x.a[sl].reshape(-1)]  # [Q, D, c*T]
            z = torch.einsum("qdn,nd->nq", cols, x.g[sl].reshape(-1, d))
            out[sl] = z.view(-1, t, q).sum(1)
        return out

    def project_kron(self, f: Factorized, p_out: torch.Tensor, p_in: torch.Tensor) -> torch.Tensor:
        """``sum_t (P_out g_t)(P_in[:, idx_t])^T``: the one-hot side is a column gather."""
        ga = rows_matmul(f.g, p_out.T)  # [B, T, ko]
        aa = p_in.T[f.a]  # [B, T, ki]
        return torch.bmm(ga.transpose(1, 2), aa.to(ga.dtype)).reshape(f.g.shape[0], -1)

    def stacked_side_in(self, a, p_in_t, out):
        """The one-hot side: a gather of ``P_in`` columns per layer (``a [L, B*T]``)."""
        for n in range(a.shape[0]):
            torch.index_select(p_in_t[n], 0, a[n], out=out[n])

    def canonical(self, module, grads):
        return grads["weight"].transpose(-1, -2).flatten(-2)
