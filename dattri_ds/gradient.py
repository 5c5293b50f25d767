"""The data model at the centre: per-layer per-example gradients and batches of them.

Shapes use fixed letters: B batch, T tokens, I layer input, O layer output, D flattened
parameter size, P projection size.

The *canonical* per-example gradient of a layer is the gradient of its parameters laid
out as ``[O, I']`` (``I' = I + 1`` when a bias is folded in as a column of ones), flattened
row-major to ``[D]``. Every LayerKind maps its parameters onto that layout, so that all
operations below agree no matter how the module stores its weight (``nn.Linear`` keeps
``[O, I]``, HF ``Conv1D`` keeps ``[I, O]``).

Every LayerGrad lives in one ``Space`` (canonical, projected, kept exactly, whitened): a
typed value compared as an object; its tag string (``Space.tag`` / ``Space.parse``, the one
grammar) is what stores and factor files record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dattri_ds.errors import ConfigError, ShapeError

__all__ = ["Factorized", "Dense", "ShardInfo", "Space", "LayerGrad", "GradBatch", "Kind"]


class Kind(Protocol):
    """What the data model needs of a layer kind: its registered name (what stores and factor
    files record). ``dattri_ds.layers.LayerKind`` implements it, with the per-layer maths the
    ops call on ``LayerGrad.kind``; the data model sits below the layers and never imports
    them."""

    name: str


@dataclass(frozen=True)
class Factorized:
    """Per-example gradient in factorized ("ghost") form.

    The per-example gradient of example b is ``sum_t g[b, t]^T a[b, t]``: an ``[O, I]``
    matrix that is never built unless an operation finds it cheaper.

    Attributes:
        a: layer input ``[B, T, I]`` (float), or token indices ``[B, T]`` (int64) for
            embedding-like kinds whose input side is one-hot.
        g: gradient of the per-example loss w.r.t. the layer output ``[B, T, O]``.
    """

    a: torch.Tensor
    g: torch.Tensor

    def __post_init__(self) -> None:
        a, g = self.a, self.g
        if g.dim() != 3:
            raise ShapeError(f"Factorized.g must be [B, T, O], got shape {tuple(g.shape)}")
        if a.dim() not in (2, 3) or tuple(a.shape[:2]) != tuple(g.shape[:2]):
            raise ShapeError(
                f"Factorized.a must be [B, T, I] or [B, T] with the same B, T as g "
                f"{tuple(g.shape[:2])}, got shape {tuple(a.shape)}"
            )

    @property
    def batch_size(self) -> int:
        return self.g.shape[0]

    @property
    def tokens(self) -> int:
        return self.g.shape[1]

    def index(self, idx: torch.Tensor | slice) -> Factorized:
        """Select examples along B."""
        return Factorized(self.a[idx], self.g[idx])

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> Factorized:
        """Move to a device and cast the float factors (index factors keep int64)."""
        a_dtype = dtype if self.a.is_floating_point() else None
        return Factorized(self.a.to(device=device, dtype=a_dtype),
                          self.g.to(device=device, dtype=dtype))


@dataclass(frozen=True)
class Dense:
    """Per-example gradient as rows of a matrix: materialized ``[B, D]`` or projected ``[B, P]``."""

    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.values.dim() != 2:
            raise ShapeError(f"Dense.values must be [B, D], got shape {tuple(self.values.shape)}")

    @property
    def batch_size(self) -> int:
        return self.values.shape[0]

    def index(self, idx: torch.Tensor | slice) -> Dense:
        return Dense(self.values[idx])

    def to(self, device: torch.device | str | None = None,
           dtype: torch.dtype | None = None) -> Dense:
        return Dense(self.values.to(device=device, dtype=dtype))


@dataclass(frozen=True)
class ShardInfo:
    """Where a layer's captured gradient sits inside the full (unsharded) parameter.

    A shard is the contiguous block ``[offset, offset + n)`` of the canonical ``(O, I')``
    layout along ``dim`` (``n`` = the local LayerGrad's ``shape[dim]``); the other dimension
    is whole. Shards of one layer tile it exactly once, so inner products, norms and
    projections of the full layer are sums of per-shard terms over ``group``.

    Attributes:
        dim: which canonical dimension is sharded: 0 = O (column-parallel), 1 = I (row-parallel).
        rank: this shard's index in its tensor-parallel group.
        world: number of shards.
        full_shape: the canonical ``(O, I')`` shape of the unsharded layer.
        offset: first index of this shard along ``dim`` (None = ``rank * full_shape[dim] //
            world``, equal shards).
        group: the process group the shards are spread over (not compared).
    """

    dim: int
    rank: int
    world: int
    full_shape: tuple[int, int]
    offset: int | None = None
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def start(self) -> int:
        """First index of this shard along ``dim`` of the full canonical layout."""
        if self.offset is not None:
            return self.offset
        return self.rank * self.full_shape[self.dim] // self.world

    def local_of(self, full: torch.Tensor, local_shape: tuple[int, int]) -> torch.Tensor:
        """This shard's entries of full canonical rows: ``[Q, O*I'] -> [Q, o*i']``."""
        q = full.shape[0]
        n = local_shape[self.dim]
        part = full.reshape(q, *self.full_shape).narrow(self.dim + 1, self.start, n)
        return part.reshape(q, -1)

    def flat_index(self, local_shape: tuple[int, int],
                   device: torch.device | str | None = None) -> torch.Tensor:
        """``[o*i']`` positions of this shard's entries in the flattened full layout."""
        i_full = self.full_shape[1]
        rows = torch.arange(local_shape[0], device=device)
        cols = torch.arange(local_shape[1], device=device)
        if self.dim == 0:
            rows = rows + self.start
        else:
            cols = cols + self.start
        return (rows[:, None] * i_full + cols[None, :]).reshape(-1)


@dataclass(frozen=True)
class Space:
    """The space a layer's gradient rows live in; ``tag`` / ``parse`` is the one tag grammar
    (the strings stores and factor files record; ``Space.parse(t).tag == t`` for each).

    Tags: None (canonical ``[O, I']``), ``<projection>`` (randomly projected),
    ``identity:<projection>`` (small enough to be kept exactly under that projection),
    ``whitened:<method>[:<projection>]`` (curvature-whitened rows, of an already projected
    space if given) and ``<projection>+whitened:<method>`` (whitened, then projected), where
    ``<projection>`` is a ``ProjectionConfig.tag``, kept here as an opaque name (its grammar
    and fields are ``ProjectionConfig``'s: ``ProjectionConfig.from_tag``).

    Attributes:
        projection: the projection tag (``ProjectionConfig.tag``), or None (not projected).
        identity: the layer was small enough to keep exactly under ``projection``.
        whitened: curvature whitening method (``kfac``/``ekfac``) or None.
        whitened_first: whitened, then projected (``<projection>+whitened:<method>``);
            otherwise whitened rows of an already projected space (``whitened:m:<proj>``).
    """

    projection: str | None = None
    identity: bool = False
    whitened: str | None = None
    whitened_first: bool = False
    # Derived once from the four fields above (not compared, not given):
    #: The rows were randomly projected (or kept exactly by a projection).
    projected: bool = field(default=False, init=False, compare=False, repr=False)
    #: The canonical ``[O, I']`` layout: neither projected nor whitened.
    canonical: bool = field(default=True, init=False, compare=False, repr=False)
    #: Whitened rows not randomly projected yet (``ops.space.project`` may project them).
    awaiting_projection: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.projection is not None and (not isinstance(self.projection, str)
                                            or not self.projection):
            raise ConfigError(f"Space.projection must be a non-empty projection tag or None, "
                              f"got {self.projection!r}")
        projected = self.projection is not None
        set_ = object.__setattr__
        set_(self, "projected", projected)
        set_(self, "canonical", not projected and self.whitened is None)
        set_(self, "awaiting_projection", self.whitened is not None and not self.whitened_first
             and not projected)

    @property
    def tag(self) -> str | None:
        """The tag string of this space (None = canonical, unprojected, not whitened)."""
        base = self.projection
        if self.identity:
            base = f"identity:{base}"
        if self.whitened is None:
            return base
        if self.whitened_first:
            return f"{base}+whitened:{self.whitened}"
        return f"whitened:{self.whitened}" + ("" if base is None else f":{base}")

    @classmethod
    def parse(cls, tag: str | None) -> Space:
        """The space a tag names (inverse of ``tag``).

        Raises:
            ConfigError: an empty tag or a malformed whitening part.
        """
        if tag is None:
            return CANONICAL
        if not isinstance(tag, str) or not tag:
            raise ConfigError(f"projection tag must be a non-empty string or None, got {tag!r}")
        whitened, first = None, False
        if "+whitened:" in tag:
            tag, whitened = tag.split("+whitened:", 1)
            first = True
        elif tag.startswith("whitened:"):
            whitened, _, rest = tag[len("whitened:"):].partition(":")
            tag = rest or None
        if whitened is not None and not whitened:
            raise ConfigError(f"projection tag {tag!r}: 'whitened:' needs a method name")
        identity = tag is not None and tag.startswith("identity:")
        if identity:
            tag = tag[len("identity:"):]
        return cls(tag, identity, whitened, first)

    def replace(self, **changes) -> Space:
        """A copy with ``changes`` applied (e.g. ``whitened="ekfac"``)."""
        return dataclasses.replace(self, **changes)


#: The canonical space (not projected, not whitened).
CANONICAL = Space()


@dataclass(frozen=True, init=False)
class LayerGrad:
    """Everything about one layer's per-example gradients in one object.

    Attributes:
        name: fully qualified module name, e.g. ``"transformer.h.0.attn.c_attn"``.
        kind: the layer's ``LayerKind`` object (a name is refused: ``get_kind(name)``); it
            does the per-layer maths. ``kind_name`` is its name.
        data: the factorized or dense form.
        shape: canonical ``(O, I')`` shape of this layer's (local) parameter gradient.
        space: the ``Space`` of ``data`` (canonical, projected, kept exactly, whitened); a
            tag string is accepted and parsed once here; ``projection`` reads the tag back.
        shard: tensor-parallel shard description (None = the layer is not sharded).
        device: where the gradient tensors live (read from ``data`` once, at construction).
    """

    name: str
    kind: Kind
    data: Factorized | Dense
    shape: tuple[int, int]
    space: Space = CANONICAL
    shard: ShardInfo | None = None

    def __init__(self, name: str, kind: Kind, data: Factorized | Dense,
                 shape: tuple[int, int], space: Space | str | None = None,
                 shard: ShardInfo | None = None):
        set_ = object.__setattr__
        set_(self, "name", name)
        set_(self, "kind", kind)
        set_(self, "data", data)
        set_(self, "shape", shape)
        set_(self, "space", space)
        set_(self, "shard", shard)
        self.__post_init__()
        set_(self, "device", data.g.device if isinstance(data, Factorized) else data.values.device)

    def __post_init__(self) -> None:
        if isinstance(self.kind, str):
            raise ConfigError(f"Layer '{self.name}': LayerGrad takes the layer kind object, got "
                              f"its name '{self.kind}'; pass "
                              f"dattri_ds.layers.get_kind('{self.kind}')")
        if not isinstance(self.space, Space):
            object.__setattr__(self, "space", Space.parse(self.space))
        if isinstance(self.data, Dense) and self.space.canonical:
            d = self.shape[0] * self.shape[1]
            if self.data.values.shape[1] != d:
                raise ShapeError(
                    f"Layer '{self.name}': dense gradient must have D = O*I' = "
                    f"{self.shape[0]}*{self.shape[1]} = {d} columns, got "
                    f"shape {tuple(self.data.values.shape)}"
                )
        if (isinstance(self.data, Factorized) and not self.space.projected  # LoGra sides: ko
                and self.data.g.shape[2] != self.shape[0]):
            raise ShapeError(
                f"Layer '{self.name}': output-grad has O = {self.data.g.shape[2]} but the "
                f"layer shape is {self.shape}"
            )

    @property
    def projection(self) -> str | None:
        """The tag of ``space`` (``Space.tag``): what stores and messages record."""
        return self.space.tag

    @property
    def kind_name(self) -> str:
        """The registered name of ``kind`` (what stores and factor files record)."""
        return self.kind.name

    @property
    def batch_size(self) -> int:
        return self.data.batch_size

    @property
    def is_factorized(self) -> bool:
        return isinstance(self.data, Factorized)

    def replace(self, **changes) -> LayerGrad:
        """A copy with ``changes`` applied (``space=`` a ``Space`` or its tag)."""
        fields = dict(name=self.name, kind=self.kind, data=self.data, shape=self.shape,
                      space=self.space, shard=self.shard)
        fields.update(changes)
        return LayerGrad(**fields)

    def index(self, idx: torch.Tensor | slice) -> LayerGrad:
        """Select examples along B."""
        return self.replace(data=self.data.index(idx))


@dataclass(frozen=True)
class GradBatch:
    """Per-example gradients of one micro-batch (or a query set), for every captured layer.

    Attributes:
        step: optimizer step during which the micro-batch was captured.
        sample_ids: one stable id per example (content hash of its tokens, optionally
            prefixed by a user id).
        layers: layer name -> LayerGrad, in module order.
        micro_batch: running index of the micro-batch within the capture.
        token_counts: ``[B]`` number of loss-bearing tokens of each example.
        kept: ``[B]`` positions of these examples among those of the forward that captured
            them, when the capture dropped some (non-finite gradients); None: all of them.
            Kept by ``with_layers``; ``index`` and ``cat`` make other batches (None).
    """

    step: int
    sample_ids: tuple[str, ...]
    layers: Mapping[str, LayerGrad]
    micro_batch: int = 0
    token_counts: torch.Tensor | None = field(default=None, compare=False)
    kept: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        b = len(self.sample_ids)
        for name, lg in self.layers.items():
            if lg.batch_size != b:
                raise ShapeError(
                    f"Layer '{name}' holds {lg.batch_size} examples but the batch has "
                    f"{b} sample ids"
                )

    @property
    def batch_size(self) -> int:
        return len(self.sample_ids)

    def with_layers(self, layers: Mapping[str, LayerGrad]) -> GradBatch:
        """The same examples (step, ids, micro-batch, token counts, kept) holding ``layers``."""
        return GradBatch(self.step, self.sample_ids, layers, self.micro_batch, self.token_counts,
                         self.kept)

    @staticmethod
    def cat(batches: Sequence[GradBatch]) -> GradBatch:
        """One batch holding the examples of several, in order (e.g. all query batches).

        Every batch must hold the same layers in the same form: dense rows concatenate;
        factorized layers are zero-padded along T to the longest batch (a zero token adds
        nothing to ``sum_t g_t^T a_t``, padded index factors point at row 0 with a zero
        output-grad). ``step`` is that of the first batch.

        Raises:
            ShapeError: no batch, or the batches differ in layers or in form.
        """
        if not batches:
            raise ShapeError("GradBatch.cat got no batches")
        first = batches[0]
        layers = {}
        for name, lg in first.layers.items():
            parts = []
            for b in batches:
                other = b.layers.get(name)
                if other is None or type(other.data) is not type(lg.data) or (
                        other.space != lg.space or other.shape != lg.shape):
                    raise ShapeError(
                        f"Layer '{name}' differs between the batches to concatenate (missing, "
                        f"or another form, projection or shape): collect them with one "
                        f"CaptureConfig")
                parts.append(other.data)
            layers[name] = lg.replace(data=_cat_data(parts))
        extra = [n for b in batches for n in b.layers if n not in first.layers]
        if extra:
            raise ShapeError(f"Layer '{extra[0]}' is not in the first batch to concatenate")
        ids = tuple(i for b in batches for i in b.sample_ids)
        counts = None
        if all(b.token_counts is not None for b in batches):
            counts = torch.cat([b.token_counts.cpu() for b in batches])
        return GradBatch(first.step, ids, layers, first.micro_batch, counts)

    def index(self, idx: torch.Tensor | list[int]) -> GradBatch:
        """Select a subset of examples (ids, layers and token counts alike)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        ids = tuple(self.sample_ids[i] for i in idx_t.tolist())
        layers = {n: lg.index(idx_t.to(lg.device)) for n, lg in self.layers.items()}
        counts = None if self.token_counts is None else self.token_counts[idx_t]
        return GradBatch(self.step, ids, layers, self.micro_batch, counts)


def _cat_data(parts: list[Factorized | Dense]) -> Factorized | Dense:
    """Concatenate along B; factorized parts are zero-padded along T first."""
    if isinstance(parts[0], Dense):
        return Dense(torch.cat([p.values for p in parts]))
    t = max(p.tokens for p in parts)

    def pad(x: torch.Tensor) -> torch.Tensor:
        extra = t - x.shape[1]
        if extra == 0:
            return x
        return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], 1)
    return Factorized(torch.cat([pad(p.a) for p in parts]), torch.cat([pad(p.g) for p in parts]))
