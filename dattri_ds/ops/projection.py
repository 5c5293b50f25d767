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
  generated in the same seeded column blocks, each kept as a CSR tensor and applied to the
  rows with one sparse-dense product per block (``SparseKind.apply``).
* kronecker (LoGra): ``P = P_out (x) P_in`` with ``P_out [ko, O]`` and ``P_in [ki, I']``,
  each of variance ``1/ko`` and ``1/ki``. Then ``P vec(G) = vec(P_out G P_in^T)``, which the
  factorized form computes as ``sum_t (P_out g_t)(P_in a_t)^T`` without building ``G``.
  Its distortion is larger than a dense map of the same size: for low-rank gradients the
  relative error of an inner product scales like ``sqrt(2/ko) + sqrt(2/ki)``, not
  ``sqrt(2/(ko*ki))`` (the price of never materializing ``G``).

* auto: per layer, ``choose_projection`` (here; the flop counts of the cost model) picks
  sparse, or
  Kronecker where the sparse path costs more than ``ProjectionConfig.kron_speedup`` times
  the factorized Kronecker path (large layers), and reports the choice and its error.

Every kind is a ``ProjectionKind`` strategy in one registry (``PROJECTION_KINDS``): what a
layer stores (``width``), the bytes of its seeded matrices, its projection flops per
example and its expected relative error of an inner product. Stores, the planner and the
cost model read the kinds from there.

Matrices are generated on the CPU with a ``torch.Generator`` (same bits on every device and
rank), kept once per process (``_MADE``, reused by every ``Projector`` of the same seed) and
cached per device. A layer whose gradient is no larger than the target dimension is
kept exactly (the "identity" projection).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.gradient import Dense, Factorized, Space
from dattri_ds.layers.base import COMPUTE_DTYPE
from dattri_ds.registry import Registry
from dattri_ds.io.schema import bounds, check

__all__ = ["ProjectionConfig", "Projector", "stable_seed", "random_matrix", "kron_dims",
           "sparse_columns", "sparse_csr", "KINDS", "SPARSE_NNZ", "ProjectionKind", "PROJECTION_KINDS",
           "projection_kind", "ProjectionChoice", "choose_projection", "explain_projection",
           "REF_TOKENS"]

#: Columns per independently seeded block of a dense or sparse projection matrix.
BLOCK = 1 << 14
#: Non-zeros per column of a sparse projection. 16: relative error of train x query dot
#: products of real LM gradients 0.34 / 0.17 / 0.10 at k = 256 / 1024 / 4096 vs dense
#: 0.33 / 0.17 / 0.08 (4 non-zeros: 0.35 / 0.20 / 0.13), at 1/3.5 (k=1024) to 1/20
#: (k=4096) of the dense CPU time (docs/attribution_fidelity.md).
SPARSE_NNZ = 16
#: Bytes of one stored non-zero of a sparse matrix (CSR): an int32 column index and a float32
#: value.
_SPARSE_ENTRY_BYTES = 8


class ProjectionKind:
    """One projection kind: how a layer ``[O, I']`` is projected, what it stores, costs and
    loses at size k.

    A new kind is this one class: ``class X(ProjectionKind, name="x")`` registers it, and
    ``ProjectionConfig(kind="x")`` uses it everywhere a projection runs (capture, stores,
    queries: ``ops.space.project`` calls ``project``). Every method is per layer and per
    example, for a layer larger than k (a layer with ``O*I' <= k`` is kept exactly by
    every kind, before ``project`` is asked).
    """

    name: ClassVar[str]
    #: Projects the factors ``(a, g)`` without materializing ``G`` (no ``[B, O*I']``): one
    #: seeded side per factor, ``side_dims`` and ``Projector.kron_sides`` (curvature factors
    #: can be fitted in its space: LoGra).
    factorized: ClassVar[bool] = False
    #: A tensor-parallel shard can be projected alone (``project_shard``), its partial rows
    #: summed over the shard group.
    shardable: ClassVar[bool] = False
    #: Chooses a kind per layer (``resolve``): ``kron_speedup`` is part of its tag.
    per_layer: ClassVar[bool] = False
    #: The matrix kind (``DenseKind``, ``SparseKind``: ``apply``, ``matrix``,
    #: ``project_rows``) that projects materialized rows under this kind
    #: (``Projector.matrix_kind``): a dense-only layer's, or whitened rows.
    rows_kind: ClassVar[str] = "dense"
    #: The stacked strategy of its layers (``ops/stacked.py``), None: projected one at a time.
    stacked: ClassVar[str | None] = None

    def __init_subclass__(cls, *, name: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = name
        PROJECTION_KINDS.register(name, cls())

    def width(self, k: int, o: int, i: int) -> int:
        """Values stored per example."""
        return k

    def project(self, projector: Projector, lg, cost, path: str | None = None) -> torch.Tensor:
        """``[B, width]`` projected rows of one unsharded, unprojected ``LayerGrad`` (factors
        or dense rows). Default: the projector's matrix kind applies its seeded dense or
        sparse matrix (``project_rows``, routed by the cost model ``cost``)."""
        rows = projector.matrix_kind
        if isinstance(lg.data, Dense):
            return rows.apply(projector, lg.name, lg.data.values.to(COMPUTE_DTYPE),
                              projector.config.dim)
        return rows.project_rows(projector, lg, cost, path)

    def project_shard(self, projector: Projector, lg, shard, cost, path: str | None = None
                      ) -> torch.Tensor:
        """``[B, width]`` partial rows of one tensor-parallel shard ``lg`` (``shardable``
        kinds): summed over the shard group they are the full layer's ``project``. Default:
        the materialized local rows times the columns of the seeded matrix they hold (each
        rank generates the seeded column blocks its entries touch)."""
        o, i = shard.full_shape
        x = lg.kind.rows(lg.data, lg.shape)
        return projector.apply(lg.name, x, projector.config.dim,
                               shard.flat_index(lg.shape, x.device), o * i)

    def matrix_bytes(self, k: int, o: int, i: int) -> int:
        """Bytes of the layer's seeded matrices (fp32 values)."""
        raise NotImplementedError

    def block_bytes(self, k: int, o: int, i: int) -> int:
        """Bytes of the largest matrix made at once (the unit the process-wide cache keeps
        or regenerates, ``ProjectionConfig.cache_bytes``): one seeded column block of
        ``BLOCK`` columns by default."""
        return self.matrix_bytes(k, 1, min(BLOCK, o * i))

    def flops(self, k: int, o: int, i: int, t: int) -> float:
        """Multiply-adds x 2 to project one example of ``t`` tokens from its factors."""
        raise NotImplementedError

    def cost_op(self, k: int, o: int, i: int) -> tuple[str, dict[str, int]]:
        """The cost model's op (``ops.cost.OPS``) that prices this projection of a layer, and
        its sizes (the planner routes it): the seeded dense matrix by default."""
        return "project_dense", {"P": k}

    def error(self, k: int, o: int, i: int) -> float:
        """Expected relative error of ``<Px, Py>`` vs ``<x, y>`` (units of ``|x||y|``):
        the JL scale ``sqrt(2 / k)``; test_projection checks every pair within 5x it."""
        return math.sqrt(2.0 / k)


#: name -> ProjectionKind strategy (filled by the subclasses below).
PROJECTION_KINDS: Registry[ProjectionKind] = Registry(
    "projection kind", hint="define class X(ProjectionKind, name='x')")


class KroneckerKind(ProjectionKind, name="kronecker"):
    """``P_out (x) P_in`` (LoGra): sides ``[ko, O]`` and ``[ki, I']``, ``ko*ki ~ k``
    (``side_dims``; a subclass with another split is another factorized kind)."""

    factorized = shardable = True
    stacked = "kron"

    def side_dims(self, k: int, o: int, i: int) -> tuple[int, int]:
        """``(ko, ki)``: the rows of the two seeded sides (``kron_dims``)."""
        return kron_dims(k, o, i)

    def width(self, k: int, o: int, i: int) -> int:
        ko, ki = self.side_dims(k, o, i)
        return ko * ki

    def matrix_bytes(self, k: int, o: int, i: int) -> int:
        ko, ki = self.side_dims(k, o, i)
        return 4 * (ko * o + ki * i)

    def block_bytes(self, k: int, o: int, i: int) -> int:
        ko, ki = self.side_dims(k, o, i)
        return 4 * max(ko * o, ki * i)

    def flops(self, k: int, o: int, i: int, t: int) -> float:
        ko, ki = self.side_dims(k, o, i)
        return 2.0 * t * (o * ko + i * ki + ko * ki)

    def cost_op(self, k: int, o: int, i: int) -> tuple[str, dict[str, int]]:
        ko, ki = self.side_dims(k, o, i)
        return "project_kron", {"ko": ko, "ki": ki}

    def project(self, projector, lg, cost, path=None):
        """``vec(P_out G P_in^T)`` (``LayerKind.project_factors``); kinds without Kronecker
        structure (dense-only rows) fall back to the seeded dense matrix."""
        if lg.kind.dense_only:
            return super().project(projector, lg, cost, path)
        p_out, p_in = projector.kron_sides(lg.name, *lg.shape, lg.device)
        return lg.kind.project_factors(lg.name, lg.data, lg.shape, p_out, p_in, cost, path)

    def project_shard(self, projector, lg, shard, cost, path=None):
        """Factors: ``P vec(G) = sum_r vec(P_out[:, R_r] G_r P_in^T)`` for row blocks ``R_r``
        (column-parallel), likewise with ``P_in[:, C_r]`` for column blocks (row-parallel);
        dense rows: the seeded dense matrix's columns."""
        if not isinstance(lg.data, Factorized):
            return super().project_shard(projector, lg, shard, cost, path)
        p_out, p_in = projector.kron_sides(lg.name, *shard.full_shape, lg.device)
        n = lg.shape[shard.dim]
        if shard.dim == 0:
            p_out = p_out.narrow(1, shard.start, n)
        else:
            p_in = p_in.narrow(1, shard.start, n)
        return lg.kind.project_factors(lg.name, lg.data, lg.shape, p_out, p_in, cost, path)

    def error(self, k: int, o: int, i: int) -> float:
        """``sqrt(2/ko) + sqrt(2/ki)``: each side is a JL map of its own factor."""
        ko, ki = self.side_dims(k, o, i)
        return math.sqrt(2.0 / ko) + math.sqrt(2.0 / ki)


class DenseKind(ProjectionKind, name="dense"):
    """One Gaussian/Rademacher ``[k, O*I']`` matrix on the materialized gradient."""

    shardable = True

    def matrix_bytes(self, k: int, o: int, i: int) -> int:
        return 4 * k * o * i

    def flops(self, k: int, o: int, i: int, t: int) -> float:
        return 2.0 * t * o * i + 2.0 * k * o * i

    def apply(self, projector: Projector, layer: str, x: torch.Tensor, rows: int,
              index: torch.Tensor | None = None, d: int | None = None) -> torch.Tensor:
        """``x [B, n] @ P[:, index]^T`` -> ``[B, rows]``: ``x`` holds columns ``index [n]``
        of a ``[B, D]`` matrix (None: all of them), streamed over the seeded column blocks
        they touch, each as built for the full width ``d``: a tensor-parallel shard's
        partial rows sum to the full row's."""
        out = x.new_zeros(x.shape[0], rows)
        if index is None:
            d = x.shape[1]
            for blk, start in enumerate(range(0, d, BLOCK)):
                cols = min(BLOCK, d - start)
                p = projector.dense_block(layer, blk, rows, cols, x.device, x.dtype)
                out += x[:, start:start + cols] @ p.T
            return out
        index = index.to(x.device)
        for blk, sel, width in _touched(index, d):
            p = projector.dense_block(layer, blk, rows, width, x.device, x.dtype)
            out += x[:, sel] @ p[:, index[sel] - blk * BLOCK].T
        return out

    def matrix(self, projector: Projector, layer: str, d: int, rows: int) -> torch.Tensor:
        """The whole ``[rows, D]`` matrix (references, small layers)."""
        return torch.cat([projector.dense_block(layer, b, rows, min(BLOCK, d - s),
                                                torch.device("cpu"))
                          for b, s in enumerate(range(0, d, BLOCK))], dim=1)

    def project_rows(self, projector: Projector, lg, cost, path: str | None = None
                     ) -> torch.Tensor:
        """``[B, k]`` of a layer given as factors, routed (op ``project_dense``): the ghost
        path ``sum_t g_t^T P_p a_t`` only wins when T is 1; an index input materializes."""
        k, kind, shape = projector.config.dim, lg.kind, lg.shape
        f = kind.f32(lg.data)

        def dense() -> torch.Tensor:
            return self.apply(projector, lg.name, kind.materialize(f, shape), k)
        if kind.index_input:
            return dense()

        def ghost() -> torch.Tensor:
            m = self.matrix(projector, lg.name, shape[0] * shape[1], k).to(f.g.device)
            return kind.cross_dense(f, m, shape)
        return cost.route("project_dense", lg.name, kind, f, shape,
                          {"ghost": ghost, "dense": dense}, path=path, P=k)


class SparseKind(ProjectionKind, name="sparse"):
    """Sparse JL: ``SPARSE_NNZ`` non-zeros per column on the materialized gradient."""

    shardable = True
    rows_kind = stacked = "sparse"

    def matrix_bytes(self, k: int, o: int, i: int) -> int:
        """The CSR blocks: ``_SPARSE_ENTRY_BYTES`` per non-zero and an int32 row-pointer
        array of ``k + 1`` per seeded column block."""
        blocks = -(-o * i // BLOCK)
        return _SPARSE_ENTRY_BYTES * min(SPARSE_NNZ, k) * o * i + 4 * (k + 1) * blocks

    def flops(self, k: int, o: int, i: int, t: int) -> float:
        return 2.0 * t * o * i + 2.0 * min(SPARSE_NNZ, k) * o * i

    def cost_op(self, k: int, o: int, i: int) -> tuple[str, dict[str, int]]:
        return "project_sparse", {"P": k}

    def apply(self, projector: Projector, layer: str, x: torch.Tensor, rows: int,
              index: torch.Tensor | None = None, d: int | None = None) -> torch.Tensor:
        """``DenseKind.apply`` with the sparse matrix: one sparse-dense product
        ``P_blk x_blk^T`` per seeded column block (``BLOCK`` columns, CSR, cached),
        accumulated into ``[rows, B]``. Every non-zero reads one row of ``x_blk^T`` (the B
        examples' values of one column, contiguous) and a block's rows fit in cache:
        ``B*D*s`` multiply-adds at gather speed, no ``[B, D, s]`` intermediate and no
        scatter. A column subset (a tensor-parallel shard) is zero-padded to the blocks it
        touches (same blocks, same sums as the whole row: the shards' partials add up to it).
        """
        if index is None:  # every column: block by block
            return self.apply_columns(projector, layer, lambda start, stop: x[:, start:stop],
                                      x.shape[1] if d is None else d, rows)
        out = x.new_zeros(rows, x.shape[0])
        index = index.to(x.device)
        for blk, sel, width in _touched(index, d):
            m = projector.sparse_csr(layer, blk, rows, width, x.device, x.dtype)
            xb = x.new_zeros(width, x.shape[0])
            xb[index[sel] - blk * BLOCK] = x[:, sel].T
            out += torch.sparse.mm(m, xb)
        return out.T

    def apply_columns(self, projector: Projector, layer: str, columns, d: int, rows: int,
                      span: int = 0) -> torch.Tensor:
        """``x [B, D] @ P^T`` -> ``[B, rows]``, ``x`` given a few seeded column blocks at a
        time: ``columns(start, stop)`` -> ``x[:, start:stop]``, asked for at least ``span``
        columns (whole blocks) per call.

        The rows need never exist whole: a layer's kind materializes a span from its factors
        while it is in cache (``project_rows``; ``span`` keeps its products large enough to
        run at matmul speed), and each block's CSR product consumes it.
        """
        span = max(1, -(-span // BLOCK)) * BLOCK
        out = None
        for c0 in range(0, d, span):
            xs = columns(c0, min(d, c0 + span))
            for start in range(c0, min(d, c0 + span), BLOCK):
                cols = min(BLOCK, d - start)
                x = xs[:, start - c0:start - c0 + cols]
                m = projector.sparse_csr(layer, start // BLOCK, rows, cols, x.device, x.dtype)
                part = torch.sparse.mm(m, x.T.contiguous())  # row-major [cols, B]: fast
                out = part if out is None else out.add_(part)
        if out is None:
            raise ConfigError(f"Layer '{layer}': nothing to project (D = {d} columns)")
        return out.T

    def matrix(self, projector: Projector, layer: str, d: int, rows: int) -> torch.Tensor:
        """The whole ``[rows, D]`` matrix, its non-zeros written in (references)."""
        out = torch.zeros(rows, d)
        for b, start in enumerate(range(0, d, BLOCK)):
            cols = min(BLOCK, d - start)
            idx, val = projector.sparse_block(layer, b, rows, cols, torch.device("cpu"))
            out[idx, (torch.arange(cols) + start).unsqueeze(1).expand_as(idx)] = val
        return out

    def project_rows(self, projector: Projector, lg, cost, path: str | None = None
                     ) -> torch.Tensor:
        """``[B, k]`` of a layer given as factors: always materialized (the product is
        ``B*D*s``), a cache-sized span of output rows at a time where the kind can."""
        k, kind, (o, i) = projector.config.dim, lg.kind, lg.shape
        f = kind.f32(lg.data)
        if kind.output_sliceable:  # >= 64 output rows per product
            return self.apply_columns(projector, lg.name, lambda start, stop: (
                kind.materialize_columns(f, lg.shape, start, stop)), o * i, k, span=64 * i)
        return self.apply(projector, lg.name, kind.materialize(f, lg.shape), k)


def _touched(index: torch.Tensor, d: int):
    """``(block, positions in index, block width)`` of each seeded column block of a
    ``D = d`` wide matrix that the columns ``index`` touch."""
    blocks = torch.div(index, BLOCK, rounding_mode="floor")
    for blk in torch.unique(blocks).tolist():
        yield blk, (blocks == blk).nonzero().squeeze(1), min(BLOCK, d - blk * BLOCK)


class AutoKind(ProjectionKind, name="auto"):
    """Per layer the cheaper-where-it-pays of sparse and Kronecker (``resolve``)."""

    per_layer = True
    rows_kind = "sparse"

    def resolve(self, config: ProjectionConfig, o: int, i: int) -> ProjectionKind:
        """The kind a layer ``[O, I']`` gets (``choose_projection``)."""
        return PROJECTION_KINDS.lookup(choose_projection(o, i, config.dim,
                                                         config.kron_speedup).kind)

    def width(self, k: int, o: int, i: int) -> int:
        raise ConfigError("the 'auto' projection has no width of its own: resolve it per "
                          "layer first (AutoKind.resolve / Projector.kind_of)")

    matrix_bytes = flops = error = cost_op = width  # type: ignore[assignment]


#: The built-in projection kinds (``PROJECTION_KINDS.names()`` lists user kinds too).
KINDS = tuple(PROJECTION_KINDS)


def projection_kind(name: str) -> ProjectionKind:
    """The registered kind ``name``; ConfigError naming the known kinds otherwise."""
    return PROJECTION_KINDS.lookup(name)


#: Tokens per example of the projection-kind comparison (the ratio is the same for any T
#: up to the per-example scatter term of sparse).
REF_TOKENS = 512


@dataclass(frozen=True)
class ProjectionChoice:
    """The projection kind one layer gets, and why.

    Attributes:
        kind: ``identity`` (kept exactly), ``sparse`` or ``kronecker``.
        width: values stored per example. error: expected relative inner-product error.
        speedup: flops of the sparse path / flops of the Kronecker path (``REF_TOKENS``).
    """

    kind: str
    width: int
    error: float
    speedup: float


def choose_projection(o: int, i: int, k: int, kron_speedup: float = 8.0) -> ProjectionChoice:
    """Identity, sparse or Kronecker for a layer ``[O, I']`` at size k (module docstring)."""
    if o * i <= k:
        return ProjectionChoice("identity", o * i, 0.0, 1.0)
    sparse, kron = PROJECTION_KINDS.lookup("sparse"), PROJECTION_KINDS.lookup("kronecker")
    ratio = sparse.flops(k, o, i, REF_TOKENS) / kron.flops(k, o, i, REF_TOKENS)
    pick = kron if ratio > kron_speedup else sparse
    return ProjectionChoice(pick.name, pick.width(k, o, i), pick.error(k, o, i), ratio)


def explain_projection(shapes: Mapping[str, tuple[int, int]], k: int,
                       kron_speedup: float = 8.0) -> str:
    """One line per layer: its ``auto`` projection kind, width, error and the flops ratio."""
    lines = []
    for name, (o, i) in shapes.items():
        c = choose_projection(o, i, k, kron_speedup)
        lines.append(f"{name} [{o}x{i}] k={k} -> {c.kind} (width {c.width}, relative error "
                     f"~{c.error:.3f}, sparse/kronecker flops {c.speedup:.1f})")
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class ProjectionConfig:
    """How per-layer gradients are compressed."""

    kind: str = "auto"
    """A registered ``ProjectionKind`` (``PROJECTION_KINDS``): ``kronecker``: project input and output sides
    separately (LoGra); ``dense``: one ``[k, D]`` matrix on the materialized gradient;
    ``sparse``: a sparse JL matrix with ``SPARSE_NNZ`` non-zeros per column on the
    materialized gradient (dense-JL error at a fraction of its cost); ``auto`` (default):
    sparse, or Kronecker per layer where it pays (``kron_speedup``), small layers exact.
    Chosen by fidelity per byte on ``benchmarks/lds.py`` (docs/attribution_fidelity.md): at
    equal bytes (k = 4096) whitened sparse rows keep 94% of the default method's exact
    LDS where Kronecker with LoGra factors keeps 79% (5 seeds). The LoGra fit
    (``KFACFactors(projector=...)``) needs ``kronecker``."""

    dim: int = field(default=4096, metadata=bounds(ge=1, le=2**26))
    """Target size per layer (``ko * ki`` for kronecker, about ``dim``). 4096: the smallest
    of 256 / 1024 / 4096 at which the default method's projected recipe (whitened rows,
    ``CaptureConfig.whiten``) keeps >= 90% of its exact LDS on ``benchmarks/lds.py`` (mean of
    5 seeds: 68% / 84% / 94%, and 94-96% at 4096 in three other regimes; README), at 27%
    of the exact
    rows' bytes there; plain projected rows keep >= 90% for grad-dot and TracIn already at
    1024."""

    kron_speedup: float = field(default=8.0, metadata=bounds(ge=1))
    """``auto`` only: a layer is Kronecker-projected when the sparse path needs more than
    this many times the flops of the factorized Kronecker path (``ops.cost``)."""

    distribution: Literal["gaussian", "rademacher"] = "gaussian"
    """Entry distribution (both scaled to variance ``1/rows``)."""

    seed: int = 0
    """Base seed; the matrix of a layer depends only on (seed, layer name, role)."""

    cache_bytes: int = field(default=1 << 31, metadata=bounds(ge=0, le=2**38))
    """Keep at most this many bytes of seeded matrices per process (host; device copies as
    much per ``Projector``); the rest is regenerated on every use, at about 12x the cost of
    applying it (sparse: drawing and sorting a block vs its product). 2 GiB holds the sparse
    matrices of GPT-2 small at k = 4096 (0.9 GB: ``auto`` keeps its attention projections
    sparse) and of a 512-wide model's blocks at 8 bytes per non-zero; 512 MiB (the former
    default) regenerated half of them per batch (docs/projection.md)."""

    def __post_init__(self) -> None:
        check(self, "projection")
        if self.kind not in PROJECTION_KINDS:
            raise ConfigError(f"projection.kind '{self.kind}' is not a registered projection "
                              f"kind; registered: {PROJECTION_KINDS.names()} (a new one is "
                              f"class X(ProjectionKind, name='x'))")

    @property
    def strategy(self) -> ProjectionKind:
        """The registered ``ProjectionKind`` named by ``kind``."""
        return PROJECTION_KINDS.lookup(self.kind)

    @property
    def tag(self) -> str:
        """Identifier stored with projected gradients; equal tags = comparable vectors."""
        auto = f":x{self.kron_speedup:g}" if self.strategy.per_layer else ""
        return f"{self.kind}:{self.distribution}:k{self.dim}:s{self.seed}{auto}"

    @classmethod
    def from_tag(cls, tag: str | None) -> ProjectionConfig:
        """The config whose ``tag`` is ``tag`` (inverse of ``tag``; a ``Space``'s
        ``projection``).

        Raises:
            ConfigError: ``tag`` is not a config's ``<kind>:<distribution>:k<dim>:s<seed>
                [:x<speedup>]``, or names an unregistered kind.
        """
        parts = (tag or "").split(":")
        try:
            if len(parts) not in (4, 5) or parts[2][0] != "k" or parts[3][0] != "s" or (
                    len(parts) == 5 and parts[4][0] != "x"):
                raise ValueError
            extra = {"kron_speedup": float(parts[4][1:])} if len(parts) == 5 else {}
            return cls(kind=parts[0], distribution=parts[1], dim=int(parts[2][1:]),
                       seed=int(parts[3][1:]), **extra)
        except (ValueError, IndexError):
            raise ConfigError(f"projection tag {tag!r} is not a ProjectionConfig tag "
                              f"'<kind>:<distribution>:k<dim>:s<seed>[:x<speedup>]'") from None


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


def sparse_csr(index: torch.Tensor, value: torch.Tensor, rows: int) -> torch.Tensor:
    """The block ``[rows, cols]`` of ``sparse_columns``' non-zeros (``index``/``value``
    ``[cols, s]``) as a CSR tensor, int32 indices; each row's entries in column order.

    A stable sort of the column-major entries by row: the products of a row are summed in
    ascending column order (the order of the column-major scatter this replaces).
    """
    cols, s = index.shape
    flat = index.reshape(-1).to(torch.int32)  # int32 keys: a 3x faster stable sort
    order = torch.sort(flat, stable=True).indices
    crow = torch.zeros(rows + 1, dtype=torch.int64)
    crow[1:] = torch.bincount(flat, minlength=rows).cumsum(0)
    col = torch.div(order, s, rounding_mode="floor")
    with warnings.catch_warnings():  # torch's one-time "CSR support is in beta" notice
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support")
        return torch.sparse_csr_tensor(crow.to(torch.int32), col.to(torch.int32),
                                       value.reshape(-1)[order], (rows, cols),
                                       check_invariants=False)


def _nbytes(m: torch.Tensor) -> int:
    """Bytes a cached matrix holds (a CSR tensor: its values and index arrays)."""
    if m.layout == torch.sparse_csr:
        parts = (m.values(), m.crow_indices(), m.col_indices())
        return sum(t.numel() * t.element_size() for t in parts)
    return m.numel() * m.element_size()


def kron_dims(dim: int, out_dim: int, in_dim: int) -> tuple[int, int]:
    """Split a target size ``dim`` into ``(ko, ki)`` with ``ko <= O``, ``ki <= I'``.

    ``ko = min(O, ceil(sqrt(dim)))`` and ``ki = min(I', max(1, dim // ko))``: a square
    split when both sides are large enough (1024 -> 32 x 32).
    """
    ko = min(out_dim, math.isqrt(dim - 1) + 1 if dim > 1 else 1)
    ki = min(in_dim, max(1, dim // ko))
    return ko, ki


class _MadeMatrices:
    """Process-wide store of the matrices every ``Projector`` generates on the CPU, keyed by
    (seed, distribution, role and shape): every ``Projector`` of one config (a capture, a
    ``collect`` per checkpoint, a query) reuses them instead of drawing and sorting them
    again. Holds at most the asking config's ``cache_bytes``: matrices of other seeds are
    dropped first (least recently used); those of the asking seed are kept until it is full
    and the rest regenerated on use (an LRU would evict every block of a layer-by-layer
    sweep that does not fit before its next use). Device copies stay per ``Projector``."""

    def __init__(self) -> None:
        self._items: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple, make, budget: int) -> torch.Tensor:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
            return hit
        m = make()
        nbytes = _nbytes(m)
        others = [k for k in self._items if k[:2] != key[:2]]
        while others and self._bytes + nbytes > budget:
            self._bytes -= _nbytes(self._items.pop(others.pop(0)))
        if self._bytes + nbytes <= budget:
            self._items[key] = m
            self._bytes += nbytes
        return m

    def clear(self) -> None:
        """Drop every kept matrix (e.g. after the last projection of a long process)."""
        self._items.clear()
        self._bytes = 0


_MADE = _MadeMatrices()


class Projector:
    """Builds and caches the seeded matrices of one ProjectionConfig."""

    def __init__(self, config: ProjectionConfig) -> None:
        self.config = config
        #: The space of the rows it projects, and of layers small enough to be kept exactly.
        self.space = Space(config.tag)
        self.exact_space = Space(config.tag, identity=True)
        self._cache: dict[tuple, torch.Tensor] = {}
        self._cached_bytes = 0
        #: The configured kind (``auto`` unresolved: ``kind_for`` resolves it per layer).
        self.kind = config.strategy
        #: The kind that projects materialized rows (``ProjectionKind.rows_kind``).
        self.matrix_kind = PROJECTION_KINDS.lookup(self.kind.rows_kind)

    def kind_for(self, o: int, i: int) -> ProjectionKind:
        """The ProjectionKind a layer ``[O, I']`` is projected with (``auto`` resolved)."""
        kind = self.kind
        if isinstance(kind, AutoKind):
            kind = kind.resolve(self.config, o, i)
        return kind

    def kind_of(self, o: int, i: int) -> str:
        """The name of ``kind_for(o, i)``."""
        return self.kind_for(o, i).name

    def _get(self, key: tuple, make, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        full_key = key + (str(device), dtype)
        hit = self._cache.get(full_key)
        if hit is not None:
            return hit
        cfg = self.config
        m = _MADE.get((cfg.seed, cfg.distribution) + key, make, cfg.cache_bytes)
        m = m.to(device=device, dtype=dtype)
        nbytes = _nbytes(m)
        if self._cached_bytes + nbytes <= cfg.cache_bytes:
            self._cache[full_key] = m
            self._cached_bytes += nbytes
        return m

    def _keep(self, key: tuple, m: torch.Tensor) -> torch.Tensor:
        """Keep a derived device matrix under ``key`` while the budget allows."""
        nbytes = _nbytes(m)
        if self._cached_bytes + nbytes <= self.config.cache_bytes:
            self._cache[key] = m
            self._cached_bytes += nbytes
        return m

    def stacked_sides(self, layers: tuple[str, ...], o: int, i: int, device: torch.device,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The Kronecker sides of layers of one shape ``[O, I']``, transposed and stacked:
        ``(P_out^T [L, O, ko], P_in^T [L, I', ki])`` (each layer's ``kron_sides``), for one
        batched product per side (``ops/stacked.py``)."""
        out = []
        for role, k in (("out", 0), ("in", 1)):
            key = ("sides", layers, role, o, i, str(device), dtype)
            hit = self._cache.get(key)
            if hit is None:
                hit = self._keep(key, torch.stack(
                    [self.kron_sides(n, o, i, device, dtype)[k].T for n in layers]))
            out.append(hit)
        return out[0], out[1]

    def stacked_csr(self, layers: tuple[str, ...], d: int, rows: int, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, int]:
        """The sparse matrices of layers of one width ``D`` as one block-diagonal CSR
        ``[L * nb * rows, L * D]`` and ``nb``, the seeded blocks per layer: row block
        ``(l, b)`` holds layer l's block b (``sparse_csr``) over its columns
        ``l * D + b * BLOCK ...``, so one sparse-dense product gives every block's partial
        projection, summed over b as ``apply_columns`` sums them."""
        key = ("csr_stack", layers, d, rows, str(device), dtype)
        nb = -(-d // BLOCK)
        hit = self._cache.get(key)
        if hit is not None:
            return hit, nb
        crows, cols, vals, nnz = [torch.zeros(1, dtype=torch.int64)], [], [], 0
        for li, name in enumerate(layers):
            for blk in range(nb):
                width = min(BLOCK, d - blk * BLOCK)
                m = self.sparse_csr(name, blk, rows, width, torch.device("cpu"), dtype)
                crows.append(m.crow_indices()[1:].to(torch.int64) + nnz)
                cols.append(m.col_indices().to(torch.int64) + (li * d + blk * BLOCK))
                vals.append(m.values())
                nnz += m.values().numel()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support")
            m = torch.sparse_csr_tensor(torch.cat(crows).to(torch.int32),
                                        torch.cat(cols).to(torch.int32), torch.cat(vals),
                                        (len(layers) * nb * rows, len(layers) * d),
                                        check_invariants=False)
        return self._keep(key, m.to(device)), nb

    def side(self, layer: str, role: str, rows: int, cols: int, device: torch.device,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One Kronecker side ``[rows, cols]`` for ``role`` in {"out", "in"}."""
        cfg = self.config
        seed = stable_seed(cfg.seed, layer, role)
        return self._get(("side", layer, role, rows, cols),
                         lambda: random_matrix(rows, cols, seed, cfg.distribution), device, dtype)

    def kron_sides(self, layer: str, o: int, i: int, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The Kronecker sides ``(P_out [ko, O], P_in [ki, I'])`` of a layer ``[O, I']``
        (``kron_dims``): the one place they are built (stores, queries, shards and LoGra
        curvature factors share them)."""
        ko, ki = self.side_dims(o, i)
        return (self.side(layer, "out", ko, o, device, dtype),
                self.side(layer, "in", ki, i, device, dtype))

    def side_dims(self, o: int, i: int) -> tuple[int, int]:
        """``(ko, ki)`` of a layer ``[O, I']`` under its factorized kind (``side_dims``)."""
        return self.kind_for(o, i).side_dims(self.config.dim, o, i)

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

    def apply(self, layer: str, x: torch.Tensor, rows: int, index: torch.Tensor | None = None,
              d: int | None = None) -> torch.Tensor:
        """``x [B, n] @ P[:, index]^T`` -> ``[B, rows]`` with the matrix of materialized rows
        (``matrix_kind.apply``; ``index=None``: all columns)."""
        return self.matrix_kind.apply(self, layer, x, rows, index, d)

    def sparse_csr(self, layer: str, block: int, rows: int, cols: int, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Columns ``[block*BLOCK, block*BLOCK + cols)`` of the sparse matrix as a CSR tensor
        ``[rows, cols]`` (``sparse_csr``): the same non-zeros as ``sparse_block``."""
        cfg = self.config
        seed = stable_seed(cfg.seed, layer, "sparse", block)
        return self._get(("csr", layer, block, rows, cols),
                         lambda: sparse_csr(*sparse_columns(rows, cols, seed, cfg.distribution),
                                            rows), device, dtype)

    def dense_matrix(self, layer: str, d: int, rows: int) -> torch.Tensor:
        """The whole ``[rows, D]`` matrix of ``apply`` (references, small layers)."""
        return self.matrix_kind.matrix(self, layer, d, rows)
