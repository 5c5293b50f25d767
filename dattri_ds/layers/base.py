"""LayerKind: the extension point that teaches dattri-ds one module type, plus its registry.

A kind knows three things about its module type, and nothing else in the library does:

1. *Capture*: which tensor is the layer input to save and which output tensor to hook,
   batch-first (``[B, T, I]`` and ``[B, T, O]``); the canonical shape ``(O, I')`` read from
   module attributes, never from ``weight.shape`` (an empty placeholder under ZeRO-3).
2. *Per-layer maths*, both paths side by side: on factors (ghost) ``materialize``,
   ``cross_gram``, ``sq_norms``, ``cross_dense``, ``project_kron``; on any ``LayerGrad``
   data (factorized or dense) ``rows``, ``gram``, ``sq_norms_of``, ``sum_rows``,
   ``project_factors`` (dense and sparse matrices of rows: ``ops.projection``), each
   routed by ``CostModel.route`` (which reads the shapes, and ``index_input``, to build
   the cost model's ``LayerDims``). Ops ask the kind and never test the data's form themselves.
3. *Reference layout*: how the module's parameter gradients map onto the canonical
   ``[O, I']`` layout (used by tests and by consumers that write gradients back).

A new layer type is one class ``class MyKind(LayerKind, name="my", modules=(M,))`` (in its
own module or the user's code): subclassing registers it, and the ops dispatch through it.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from dattri_ds.errors import UnsupportedLayerError
from dattri_ds.gradient import Dense, Factorized, ShardInfo
from dattri_ds.layers.stacking import scale_examples
from dattri_ds.registry import Registry

if TYPE_CHECKING:
    from dattri_ds.layers.factor_forms import FactorForm

__all__ = ["LayerDims", "LayerKind", "KINDS", "kind_for", "get_kind", "param_shape",
           "registered_kinds", "unregister_kind", "COMPUTE_DTYPE", "batch_dim_of"]

#: Dtype of every inner product and materialized row, whatever the capture dtype.
COMPUTE_DTYPE = torch.float32


@dataclass(frozen=True)
class LayerDims:
    """Shapes the cost model needs for one layer's factorized gradient.

    Attributes:
        B: examples. T: tokens per example. I: input width (incl. bias column).
        O: output width. index_input: the input side is a one-hot index (embedding), so
        input-side products cost T*S compares instead of T*S*I multiply-adds.
        itemsize: bytes per element of the factors.
    """

    B: int
    T: int
    I: int  # noqa: E741 - the letter is the documented shape name
    O: int  # noqa: E741
    index_input: bool = False
    itemsize: int = 4


KINDS: Registry[LayerKind] = Registry(
    "layer kind", error=UnsupportedLayerError,
    hint="define class MyKind(LayerKind, name='my', modules=(MyModule,)) before using it")
_MATCH_ORDER: list[LayerKind] = []
#: Instance attributes that change how one module matches start with this (integrations
#: mark modules, e.g. ``integrations.megatron.prepare_model``): such a module is matched on
#: its own, never from its class's cached plan.
MARK_PREFIX = "_dattri_ds_"
#: class -> (kinds to ask per module, in match order; the kind every other module of the
#: class gets): ``kind_for``'s per-class plan, cleared whenever a kind registers or leaves.
_BY_CLASS: dict[type, tuple[tuple[LayerKind, ...], LayerKind | None]] = {}


class LayerKind(ABC):
    """One module type's capture rules and factorized maths (see module docstring)."""

    name: ClassVar[str]
    modules: ClassVar[tuple[type, ...]] = ()
    #: True when the kind produces ``Dense`` directly (materializing is as cheap as reading).
    dense_only: ClassVar[bool] = False
    #: True when the input factor ``a`` is a token index ``[B, T]`` (one-hot input side).
    index_input: ClassVar[bool] = False
    #: True when ``materialize`` of the factors with ``g`` narrowed to outputs ``[o0, o1)``
    #: gives rows ``o0..o1`` of the canonical ``[O, I']`` gradient (outer products,
    #: embeddings): a sparse projection then materializes one column block at a time.
    output_sliceable: ClassVar[bool] = False

    def __init_subclass__(cls, name: str | None = None,
                          modules: tuple[type, ...] = (), **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:  # intermediate abstract base
            return
        cls.name = name
        cls.modules = tuple(modules)
        inst = KINDS.register(name, cls())
        _MATCH_ORDER.insert(0, inst)  # later registrations win (user kinds override ours)
        _BY_CLASS.clear()

    def __reduce__(self):  # pickles / deep copies resolve to the registered instance
        return get_kind, (self.name,)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<LayerKind {self.name!r}>"

    # ---- matching -------------------------------------------------------------------
    def matches(self, module: nn.Module) -> bool:
        """Whether this kind handles ``module`` (default: isinstance of ``modules``)."""
        return bool(self.modules) and isinstance(module, self.modules)

    def match_class(self, cls: type) -> bool | None:
        """Whether every module of class ``cls`` matches (True), none does (False), or each
        must be asked (None: ``matches`` reads the instance). ``kind_for`` asks it once per
        class (unmarked modules). Default: by ``modules`` when ``matches`` is the default."""
        if type(self).matches is LayerKind.matches:
            return bool(self.modules) and issubclass(cls, self.modules)
        return None

    def check(self, module: nn.Module, name: str) -> None:
        """Raise UnsupportedLayerError when a matching module uses an unsupported variant."""

    # ---- capture --------------------------------------------------------------------
    def activation(self, module: nn.Module, args: tuple) -> torch.Tensor:
        """The layer input to save, as the module received it."""
        return args[0]

    def output(self, module: nn.Module, output) -> torch.Tensor:
        """The output tensor whose gradient is the output-grad factor."""
        return output

    @abstractmethod
    def layer_shape(self, module: nn.Module) -> tuple[int, int]:
        """Canonical ``(O, I')`` of the local parameter gradient, from module attributes (read
        once, when a capture attaches)."""

    def shard_info(self, module: nn.Module) -> ShardInfo | None:
        """Where this module's local parameter sits in the full one (tensor parallelism); read
        once when a capture attaches, before ``check``: module attributes only."""
        return None

    @abstractmethod
    def build(self, module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> Factorized | Dense:
        """Turn a saved input and its output-grad (already scaled per example) into data.

        Args:
            a: saved input, as returned by ``activation`` (any leading layout).
            g: gradient w.r.t. ``output``, same leading layout, scaled so that example b's
                gradient is the gradient of its own loss.
        """

    def build_many(self, modules: list[nn.Module], pairs: list[tuple[torch.Tensor, torch.Tensor]],
                   scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                   cost=None) -> list[Factorized | Dense]:
        """``build`` of several layers of this kind from one backward, in order.

        Args:
            modules: each layer's module (a module may repeat: one entry per call).
            pairs: each layer's saved input and output-grad, as ``build`` takes them.
            scale: ``[B]`` float32 per-example factors multiplied into every output-grad
                first (``layers.stacking.scale_examples``; None: already scaled, or scaled
                later by the projection).
            dtype: the dtype of the scaled output-grads (default: their own).
            cost: the ``CostModel`` that says where stacking pays (``CostModel.stacks``).

        Kinds stack the layers of one shape and do their work once per group
        (``layers/stacking.py``); the default builds one layer at a time.
        """
        out = []
        for m, (a, g) in zip(modules, pairs):
            if scale is not None:
                g = scale_examples(g, scale, batch_dim_of(self, m), dtype)
            out.append(self.build(m, a, g))
        return out

    # ---- maths on the factorized form -----------------------------------------------
    @abstractmethod
    def materialize(self, f: Factorized, shape: tuple[int, int]) -> torch.Tensor:
        """Per-example gradients ``[B, O*I']`` in canonical layout (``shape = (O, I')``)."""

    @abstractmethod
    def cross_gram(self, x: Factorized, y: Factorized) -> torch.Tensor:
        """Ghost inner products ``[B1, B2]`` without materializing."""

    def sq_norms(self, f: Factorized) -> torch.Tensor:
        """Ghost squared norms ``[B]``: the diagonal of ``cross_gram(f, f)``."""
        return torch.stack([self.cross_gram(f.index(slice(b, b + 1)),
                                            f.index(slice(b, b + 1)))[0, 0]
                            for b in range(f.batch_size)])

    @abstractmethod
    def cross_dense(self, x: Factorized, y: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """Inner products of factorized ``x`` with dense canonical rows ``y [Q, O*I']`` -> ``[B, Q]``."""

    @abstractmethod
    def project_kron(self, f: Factorized, p_out: torch.Tensor, p_in: torch.Tensor) -> torch.Tensor:
        """``vec(P_out G_b P_in^T)`` for every example: ``[B, ko*ki]``.

        Equals ``materialize(f) @ kron(P_out, P_in)^T`` (row-major vec).
        """

    def stacked_side_in(self, a: torch.Tensor, p_in_t: torch.Tensor, out: torch.Tensor) -> None:
        """``P_in a_t`` of ``L`` stacked layers into ``out [L, B*T, ki]``: the input side of
        ``project_kron`` (``a [L, B*T, I']``, ``p_in_t [L, I', ki]``; ``ops/stacked.py``)."""
        torch.bmm(a, p_in_t, out=out)

    # ---- maths on LayerGrad data: both forms side by side ------------------------------
    def factor_form(self, width: int, full_max: int, side_projected: bool = False) -> FactorForm:
        """The curvature ``FactorForm`` (``ops/factor_forms.py``) of this kind's gradients;
        ``width`` = values per example row, ``full_max`` = ``KFACConfig.full_max``,
        ``side_projected``: the factors are Kronecker side-projected (an index input becomes
        a dense ``P_in`` column, so the index form no longer applies)."""
        from dattri_ds.layers.factor_forms import FORMS  # the forms build on kinds, not back

        if self.dense_only:
            return FORMS.lookup("full" if width <= full_max else "diagonal")
        return FORMS.lookup("kron_index" if self.index_input and not side_projected else "kron")

    def rows(self, data: Factorized | Dense, shape: tuple[int, int]) -> torch.Tensor:
        """``[B, D]`` rows in ``COMPUTE_DTYPE``: dense values, or materialized factors."""
        if isinstance(data, Dense):
            return data.values.to(COMPUTE_DTYPE)
        return self.materialize(self.f32(data), shape)

    def gram(self, layer: str, x: Factorized | Dense, y: Factorized | Dense,
             shape: tuple[int, int], cost, path: str | None = None) -> torch.Tensor:
        """``[B1, B2]`` inner products ``<G_b, G_q>`` of two data of this layer (same space).

        Both factorized: op ``cross_gram`` (ghost ``sum_{t,s} (a.a)(g.g)`` vs materialize
        both); one factorized: op ``cross_dense`` (ghost ``sum_t g_t . (Y a_t)`` vs
        materialize); both dense: a matmul. ``cost`` is the ``CostModel`` that routes.
        """
        if isinstance(x, Dense):
            if isinstance(y, Dense):
                return x.values.to(COMPUTE_DTYPE) @ y.values.to(COMPUTE_DTYPE).T
            return self.gram(layer, y, x, shape, cost, path).T
        fx = self.f32(x)
        if isinstance(y, Factorized):
            fy = self.f32(y)
            return cost.route("cross_gram", layer, self, fx, shape, {
                "ghost": lambda: self.cross_gram(fx, fy),
                "dense": lambda: self.materialize(fx, shape) @ self.materialize(fy, shape).T,
            }, path=path, B2=fy.g.shape[0], S=fy.g.shape[1])
        yv = y.values.to(COMPUTE_DTYPE)
        return cost.route("cross_dense", layer, self, fx, shape, {
            "ghost": lambda: self.cross_dense(fx, yv, shape),
            "dense": lambda: self.materialize(fx, shape) @ yv.T,
        }, path=path, Q=yv.shape[0])

    def sq_norms_of(self, layer: str, data: Factorized | Dense, shape: tuple[int, int],
                    cost, path: str | None = None) -> torch.Tensor:
        """``[B]`` squared norms ``||G_b||^2``: op ``norm`` (ghost ``sum_{t,s} (a_t.a_s)
        (g_t.g_s)`` vs materialize), a row sum of squares when dense."""
        if isinstance(data, Dense):
            return data.values.to(COMPUTE_DTYPE).pow(2).sum(1)
        f = self.f32(data)
        return cost.route("norm", layer, self, f, shape, {
            "ghost": lambda: self.sq_norms(f),
            "dense": lambda: torch.linalg.vector_norm(self.materialize(f, shape), dim=1).square(),
        }, path=path)

    def sum_rows(self, layer: str, data: Factorized | Dense, shape: tuple[int, int],
                 cost, path: str | None = None) -> torch.Tensor:
        """``[1, D]`` sum over examples: op ``sum`` (ghost: batch and tokens flattened into
        one example, ``G = g^T a`` in one product; dense: materialize, then sum)."""
        if isinstance(data, Dense):
            return data.values.to(COMPUTE_DTYPE).sum(0, keepdim=True)
        f = self.f32(data)
        flat = Factorized(f.a.reshape(1, -1, *f.a.shape[2:]), f.g.reshape(1, -1, f.g.shape[-1]))
        return cost.route("sum", layer, self, f, shape, {
            "ghost": lambda: self.materialize(flat, shape),
            "dense": lambda: self.materialize(f, shape).sum(0, keepdim=True),
        }, path=path)

    def project_factors(self, layer: str, data: Factorized | Dense, shape: tuple[int, int],
                        p_out: torch.Tensor, p_in: torch.Tensor, cost,
                        path: str | None = None) -> torch.Tensor:
        """``vec(P_out G_b P_in^T)`` ``[B, ko*ki]``: op ``project_kron`` on factors (ghost
        ``project_kron`` vs materialize, then two products); dense rows (e.g. a
        preconditioned query) take the product directly, so both land in one space."""
        o, i = shape
        if isinstance(data, Dense):
            g = data.values.to(COMPUTE_DTYPE).view(-1, o, i)
            return (p_out @ g @ p_in.T).reshape(g.shape[0], -1)
        f = self.f32(data)

        def dense() -> torch.Tensor:
            g = self.materialize(f, shape).view(-1, o, i)
            return (p_out @ g @ p_in.T).reshape(g.shape[0], -1)
        return cost.route("project_kron", layer, self, f, shape, {
            "ghost": lambda: self.project_kron(f, p_out, p_in), "dense": dense,
        }, path=path, ko=p_out.shape[0], ki=p_in.shape[0])

    def materialize_columns(self, f: Factorized, shape: tuple[int, int], start: int,
                            stop: int) -> torch.Tensor:
        """Columns ``[start, stop)`` of ``materialize(f, shape)``, ``[B, stop - start]``, from
        the output rows that hold them only (``output_sliceable`` kinds)."""
        o, i = shape
        o0, o1 = start // i, -(-stop // i)
        part = self.materialize(Factorized(f.a, f.g[..., o0:o1]), (o1 - o0, i))
        return part[:, start - o0 * i:stop - o0 * i]

    @staticmethod
    def f32(f: Factorized) -> Factorized:
        """Factors in ``COMPUTE_DTYPE`` (index factors keep int64)."""
        return f if f.g.dtype == COMPUTE_DTYPE else f.to(dtype=COMPUTE_DTYPE)

    def side_project(self, f: Factorized, p_out: torch.Tensor, p_in: torch.Tensor) -> Factorized:
        """Factors projected per side, ``(P_in a, P_out g)``: the working space of LoGra
        curvature factors (an index input gathers columns of ``P_in``)."""
        dt = p_out.dtype
        a = p_in.T[f.a] if self.index_input else f.a.to(dt) @ p_in.T
        return Factorized(a, f.g.to(dt) @ p_out.T)

    # ---- planning: one layer's sizes before a run (dattri_ds/plan/) -------------------------
    def capture_bytes(self, rows: int, tokens: int, shape: tuple[int, int],
                      itemsize: int) -> dict[str, int]:
        """Bytes of one captured batch of ``rows`` examples of ``tokens`` tokens, as
        ``GradBatch`` holds it, in the capture dtype (``itemsize`` bytes): ``inputs``
        (``a [B, T, I']``, an index input int64 ``[B, T]``) and ``grads`` (``g [B, T, O]``),
        or a dense-only kind's ``dense`` rows ``[B, O*I']``."""
        o, i = shape
        if self.dense_only:
            return {"dense": rows * o * i * itemsize}
        return {"inputs": rows * tokens * (8 if self.index_input else i * itemsize),
                "grads": rows * tokens * o * itemsize}

    def forward_macs(self, shape: tuple[int, int]) -> int:
        """Multiply-adds of the forward per token: ``O*I'`` for a matmul; 0 for an index
        input (a gather) and a dense-only kind (elementwise, not counted)."""
        return 0 if self.dense_only or self.index_input else shape[0] * shape[1]

    def factor_bytes(self, dims: tuple[int, int], full_max: int, side_projected: bool = False,
                     dtype: torch.dtype = torch.float32) -> int:
        """Bytes of this layer's K-FAC / EK-FAC factors as ``KFACFactors`` holds them (and a
        factor file stores them) after ``eigendecompose``: its ``factor_form``'s sums in
        ``dtype`` (``KFACConfig.dtype``; the EK-FAC sums are opened there too), float64
        counts and the float64 eigenbasis, sized by the form itself on the meta device.
        ``dims``: the working space ``(o, i)`` (the shape, or ``(ko, ki)`` when Kronecker
        side-projected; a dense-only kind's rows are ``o * i`` wide)."""
        o, i = dims
        form = self.factor_form(o * i, full_max, side_projected)
        return _form_bytes(form, (1, o * i) if self.dense_only else (o, i), dtype)

    # ---- reference layout -----------------------------------------------------------
    @abstractmethod
    def canonical(self, module: nn.Module, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Map parameter gradients ``{param_name: [..., *param.shape]}`` to ``[..., O*I']``."""


@functools.lru_cache(maxsize=4096)
def _form_bytes(form: FactorForm, dims: tuple[int, int], dtype: torch.dtype) -> int:
    """Bytes of ``form``'s pass-1 sums, opened EK-FAC sums and eigenbasis in a working
    space of ``dims`` (its ``zero_sums`` and ``decompose`` on meta tensors: no data)."""
    sums: dict[str, torch.Tensor] = {}
    form.zero_sums(sums, form.cov_keys, dims, dtype, "meta")
    eig = form.decompose(sums, dims, dtype)
    return sum(t.numel() * t.element_size() for t in (*sums.values(), *eig.values()))


def batch_dim_of(kind: LayerKind, module: nn.Module) -> int:
    """Where B sits in the saved input and output-grad: 0, or 1 for sequence-first kinds
    (Megatron ``[S, B, H]``) that define ``batch_dim(module)``."""
    fn = getattr(kind, "batch_dim", None)
    return fn(module) if fn is not None else 0


def param_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape, also when ZeRO-3 has replaced its data by a placeholder."""
    ds_shape = getattr(p, "ds_shape", None)
    return tuple(ds_shape) if ds_shape is not None else tuple(p.shape)


def kind_for(module: nn.Module) -> LayerKind | None:
    """The registered kind that handles ``module``, or None (later registrations first).

    Resolved once per class (``LayerKind.match_class``); only kinds that must read the
    instance are asked per module. A marked module (``MARK_PREFIX``) asks every kind."""
    if any(k.startswith(MARK_PREFIX) for k in vars(module)):
        return next((kind for kind in _MATCH_ORDER if kind.matches(module)), None)
    plan = _BY_CLASS.get(type(module))
    if plan is None:
        plan = _BY_CLASS[type(module)] = _class_plan(type(module))
    ask, answer = plan
    return next((kind for kind in ask if kind.matches(module)), answer)


def _class_plan(cls: type) -> tuple[tuple[LayerKind, ...], LayerKind | None]:
    """``(kinds to ask per module, the class's kind)`` in match order."""
    ask = []
    for kind in _MATCH_ORDER:
        every = kind.match_class(cls)
        if every is None:
            ask.append(kind)
        elif every:
            return tuple(ask), kind
    return tuple(ask), None


def unregister_kind(name: str) -> LayerKind:
    """Remove the kind ``name`` from the registry and from matching; returns it.

    Raises:
        UnsupportedLayerError: no kind of that name is registered.
    """
    kind = KINDS.unregister(name)
    _MATCH_ORDER.remove(kind)
    _BY_CLASS.clear()
    return kind


def get_kind(name: str | LayerKind) -> LayerKind:
    """The registered kind called ``name`` (a LayerKind is returned as is).

    Raises:
        UnsupportedLayerError: no kind of that name is registered (message lists them).
    """
    return name if isinstance(name, LayerKind) else KINDS.lookup(name)


def registered_kinds() -> dict[str, LayerKind]:
    """Name -> kind of every registered layer kind."""
    return KINDS.as_dict()
