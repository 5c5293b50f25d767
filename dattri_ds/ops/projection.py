"""Random projections seeded by (seed, layer name, role): every process builds the same matrix.

Three families, all unbiased for inner products (``E[<Px, Py>] = <x, y>``):

* dense: ``P [k, D]`` with i.i.d. entries of variance ``1/k`` (Gaussian or Rademacher),
  generated in column blocks of ``BLOCK`` so a huge layer never needs the whole matrix at
  once and any column range is reproducible on its own.
* sparse (sparse JL, Kane & Nelson 2014): every column of ``P [k, D]`` has ``SPARSE_NNZ``
  non-zeros ``+-1/sqrt(s)`` (Rademacher; Gaussian ``N(0, 1/s)``), one in each of ``s``
  row blocks of ``k // s`` rows (so they never collide). Same JL error as dense at equal
  k for spread-out vectors, at ``s / k`` of the dense cost: ``B*D*s`` multiply-adds
  instead of ``2*B*D*k``, and a matrix of ``D*s`` indices instead of ``D*k`` floats;
  generated in the same seeded column blocks.
* kronecker (LoGra): ``P = P_out (x) P_in`` with ``P_out [ko, O]`` and ``P_in [ki, I']``,
  each of variance ``1/ko`` and ``1/ki``. Then ``P vec(G) = vec(P_out G P_in^T)``, which the
  factorized form computes as ``sum_t (P_out g_t)(P_in a_t)^T`` without building ``G``.
  Its distortion is larger than a dense map of the same size: for low-rank gradients the
  relative error of an inner product scales like ``sqrt(2/ko) + sqrt(2/ki)``, not
  ``sqrt(2/(ko*ki))`` (the price of never materializing ``G``).

Matrices are generated on the CPU with a ``torch.Generator`` (same bits on every device and
rank) and cached per device. A layer whose gradient is no larger than the target dimension is
kept exactly (the "identity" projection).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from dattri_ds.schema import bounds, check

__all__ = ["ProjectionConfig", "Projector", "stable_seed", "random_matrix", "kron_dims",
           "sparse_columns", "KINDS", "SPARSE_NNZ"]

#: Columns per independently seeded block of a dense or sparse projection matrix.
BLOCK = 1 << 14
#: Non-zeros per column of a sparse projection. 16: relative error of train x query dot
#: products of real LM gradients 0.34 / 0.17 / 0.10 at k = 256 / 1024 / 4096 vs dense
#: 0.33 / 0.17 / 0.08 (4 non-zeros: 0.35 / 0.20 / 0.13), at 1/3.5 (k=1024) to 1/20
#: (k=4096) of the dense CPU time (README, "Attribution fidelity").
SPARSE_NNZ = 16
#: Projection kinds.
KINDS = ("kronecker", "dense", "sparse")


@dataclass(frozen=True, kw_only=True)
class ProjectionConfig:
    """How per-layer gradients are compressed."""

    kind: Literal["kronecker", "dense", "sparse"] = "kronecker"
    """``kronecker``: project input and output sides separately (LoGra); ``dense``: one
    ``[k, D]`` matrix on the materialized gradient; ``sparse``: a sparse JL matrix with
    ``SPARSE_NNZ`` non-zeros per column on the materialized gradient (dense-JL error at a
    fraction of its cost)."""

    dim: int = field(default=1024, metadata=bounds(ge=1))
    """Target size per layer (``ko * ki`` for kronecker, about ``dim``)."""

    distribution: Literal["gaussian", "rademacher"] = "gaussian"
    """Entry distribution (both scaled to variance ``1/rows``)."""

    seed: int = 0
    """Base seed; the matrix of a layer depends only on (seed, layer name, role)."""

    cache_bytes: int = field(default=1 << 29, metadata=bounds(ge=0))
    """Cache at most this many bytes of matrices per process (larger ones are regenerated)."""

    def __post_init__(self) -> None:
        check(self, "projection")

    @property
    def tag(self) -> str:
        """Identifier stored with projected gradients; equal tags = comparable vectors."""
        return f"{self.kind}:{self.distribution}:k{self.dim}:s{self.seed}"


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from the parts' text (independent of PYTHONHASHSEED and process)."""
    h = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def random_matrix(rows: int, cols: int, seed: int, distribution: str) -> torch.Tensor:
    """``[rows, cols]`` float32 on CPU with entries of variance ``1/rows``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if distribution == "rademacher":
        m = torch.randint(0, 2, (rows, cols), generator=gen, dtype=torch.int8)
        return (m.float() * 2 - 1) / math.sqrt(rows)
    return torch.randn(rows, cols, generator=gen) / math.sqrt(rows)


def sparse_columns(rows: int, cols: int, seed: int,
                   distribution: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-zeros of a sparse JL block ``[rows, cols]``: ``(index [cols, s], value [cols, s])``.

    Column j has ``s = min(SPARSE_NNZ, rows)`` entries, entry l in row
    ``l * (rows // s) + u`` with ``u`` uniform in ``[0, rows // s)`` (distinct rows), of
    value ``+-1/sqrt(s)`` (rademacher) or ``N(0, 1/s)`` (gaussian): ``E[P^T P] = I``.
    """
    s = min(SPARSE_NNZ, rows)
    width = rows // s
    gen = torch.Generator(device="cpu").manual_seed(seed)
    index = torch.randint(0, width, (cols, s), generator=gen) + torch.arange(s) * width
    if distribution == "rademacher":
        value = torch.randint(0, 2, (cols, s), generator=gen).float() * 2 - 1
    else:
        value = torch.randn(cols, s, generator=gen)
    return index, value / math.sqrt(s)


def kron_dims(dim: int, out_dim: int, in_dim: int) -> tuple[int, int]:
    """Split a target size ``dim`` into ``(ko, ki)`` with ``ko <= O``, ``ki <= I'``.

    ``ko = min(O, ceil(sqrt(dim)))`` and ``ki = min(I', max(1, dim // ko))``: a square
    split when both sides are large enough (1024 -> 32 x 32).
    """
    ko = min(out_dim, math.isqrt(dim - 1) + 1 if dim > 1 else 1)
    ki = min(in_dim, max(1, dim // ko))
    return ko, ki


class Projector:
    """Builds and caches the seeded matrices of one ProjectionConfig."""

    def __init__(self, config: ProjectionConfig) -> None:
        self.config = config
        self._cache: dict[tuple, torch.Tensor] = {}
        self._cached_bytes = 0

    def _get(self, key: tuple, make, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        full_key = key + (str(device), dtype)
        hit = self._cache.get(full_key)
        if hit is not None:
            return hit
        m = make().to(device=device, dtype=dtype)
        nbytes = m.numel() * m.element_size()
        if self._cached_bytes + nbytes <= self.config.cache_bytes:
            self._cache[full_key] = m
            self._cached_bytes += nbytes
        return m

    def side(self, layer: str, role: str, rows: int, cols: int, device: torch.device,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One Kronecker side ``[rows, cols]`` for ``role`` in {"out", "in"}."""
        cfg = self.config
        seed = stable_seed(cfg.seed, layer, role)
        return self._get(("side", layer, role, rows, cols),
                         lambda: random_matrix(rows, cols, seed, cfg.distribution), device, dtype)

    def dense_block(self, layer: str, block: int, rows: int, cols: int, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Columns ``[block*BLOCK, block*BLOCK + cols)`` of the dense matrix ``[rows, D]``."""
        cfg = self.config
        seed = stable_seed(cfg.seed, layer, "dense", block)
        return self._get(("dense", layer, block, rows, cols),
                         lambda: random_matrix(rows, cols, seed, cfg.distribution), device, dtype)

    def sparse_block(self, layer: str, block: int, rows: int, cols: int, device: torch.device,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-zeros (index, value) ``[cols, s]`` of columns ``[block*BLOCK, ...)``."""
        cfg = self.config
        seed = stable_seed(cfg.seed, layer, "sparse", block)
        made: dict = {}

        def part(i: int):
            if not made:
                made["v"] = sparse_columns(rows, cols, seed, cfg.distribution)
            return made["v"][i]
        key = ("sparse", layer, block, rows, cols)
        return (self._get(key + ("index",), lambda: part(0), device, torch.long),
                self._get(key + ("value",), lambda: part(1), device, dtype))

    def apply(self, layer: str, x: torch.Tensor, rows: int) -> torch.Tensor:
        """``x [B, D] @ P^T`` -> ``[B, rows]`` for the dense or sparse kind."""
        if self.config.kind == "sparse":
            return self.apply_at(layer, x, rows, None, x.shape[1])
        return self.dense_apply(layer, x, rows)

    def dense_apply(self, layer: str, x: torch.Tensor, rows: int) -> torch.Tensor:
        """``x [B, D] @ P^T`` -> ``[B, rows]``, streaming over seeded column blocks."""
        out = x.new_zeros(x.shape[0], rows)
        d = x.shape[1]
        for blk, start in enumerate(range(0, d, BLOCK)):
            cols = min(BLOCK, d - start)
            p = self.dense_block(layer, blk, rows, cols, x.device, x.dtype)
            out += x[:, start:start + cols] @ p.T
        return out

    def dense_apply_at(self, layer: str, x: torch.Tensor, rows: int, index: torch.Tensor,
                       d: int) -> torch.Tensor:
        """``x [B, n]`` holds columns ``index [n]`` of a ``[B, D]`` matrix: ``x @ P[:, index]^T``.

        The tensor-parallel form of ``dense_apply``: a shard's partial projection, streamed
        over the seeded column blocks that ``index`` touches (each block as ``dense_apply``
        builds it for the full width ``d``), so the shards' partial results sum to the
        projection of the full row. Returns ``[B, rows]``.
        """
        out = x.new_zeros(x.shape[0], rows)
        index = index.to(x.device)
        blocks = torch.div(index, BLOCK, rounding_mode="floor")
        for blk in torch.unique(blocks).tolist():
            sel = (blocks == blk).nonzero().squeeze(1)
            width = min(BLOCK, d - blk * BLOCK)
            p = self.dense_block(layer, blk, rows, width, x.device, x.dtype)
            out += x[:, sel] @ p[:, index[sel] - blk * BLOCK].T
        return out

    def apply_at(self, layer: str, x: torch.Tensor, rows: int, index: torch.Tensor | None,
                 d: int) -> torch.Tensor:
        """``dense_apply_at`` for both matrix kinds; ``index=None``: all ``d`` columns."""
        if self.config.kind != "sparse":
            if index is None:
                return self.dense_apply(layer, x, rows)
            return self.dense_apply_at(layer, x, rows, index, d)
        out = x.new_zeros(x.shape[0], rows)
        if index is None:
            index = torch.arange(d, device=x.device)
        index = index.to(x.device)
        blocks = torch.div(index, BLOCK, rounding_mode="floor")
        for blk in torch.unique(blocks).tolist():
            sel = (blocks == blk).nonzero().squeeze(1)
            width = min(BLOCK, d - blk * BLOCK)
            idx, val = self.sparse_block(layer, blk, rows, width, x.device, x.dtype)
            cols = index[sel] - blk * BLOCK
            contrib = x[:, sel].unsqueeze(-1) * val[cols]  # [B, n, s], n <= BLOCK
            out.index_add_(1, idx[cols].reshape(-1), contrib.reshape(x.shape[0], -1))
        return out

    def dense_matrix(self, layer: str, d: int, rows: int) -> torch.Tensor:
        """The whole ``[rows, D]`` matrix, dense or sparse kind (references, small layers)."""
        if self.config.kind == "sparse":
            out = torch.zeros(rows, d)
            for b, start in enumerate(range(0, d, BLOCK)):
                cols = min(BLOCK, d - start)
                idx, val = self.sparse_block(layer, b, rows, cols, torch.device("cpu"))
                out[idx, (torch.arange(cols) + start).unsqueeze(1).expand_as(idx)] = val
            return out
        blocks = [self.dense_block(layer, b, rows, min(BLOCK, d - s), torch.device("cpu"))
                  for b, s in enumerate(range(0, d, BLOCK))]
        return torch.cat(blocks, dim=1)
