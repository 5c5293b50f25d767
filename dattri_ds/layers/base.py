"""LayerKind: the extension point that teaches dattri-ds one module type, plus its registry.

A kind knows three things about its module type, and nothing else in the library does:

1. *Capture*: which tensor is the layer input to save and which output tensor to hook,
   batch-first (``[B, T, I]`` and ``[B, T, O]``); the canonical shape ``(O, I')`` read from
   module attributes, never from ``weight.shape`` (an empty placeholder under ZeRO-3).
2. *Maths on its factorized form*: materialize, ghost cross-gram, Kronecker projection,
   and the dimensions the cost model needs.
3. *Reference layout*: how the module's parameter gradients map onto the canonical
   ``[O, I']`` layout (used by tests and by consumers that write gradients back).

Adding a layer type is one new file with ``class MyKind(LayerKind, name="my", modules=(M,))``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from dattri_ds.errors import UnsupportedLayerError
from dattri_ds.gradient import Dense, Factorized, ShardInfo

__all__ = ["LayerDims", "LayerKind", "kind_for", "get_kind", "param_shape", "registered_kinds"]


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


_REGISTRY: dict[str, LayerKind] = {}
_MATCH_ORDER: list[LayerKind] = []


class LayerKind(ABC):
    """One module type's capture rules and factorized maths (see module docstring)."""

    name: ClassVar[str]
    modules: ClassVar[tuple[type, ...]] = ()
    #: True when the kind produces ``Dense`` directly (materializing is as cheap as reading).
    dense_only: ClassVar[bool] = False

    def __init_subclass__(cls, name: str | None = None,
                          modules: tuple[type, ...] = (), **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:  # intermediate abstract base
            return
        cls.name = name
        cls.modules = tuple(modules)
        inst = cls()
        _REGISTRY[name] = inst
        _MATCH_ORDER.insert(0, inst)  # later registrations win (user kinds override ours)

    # ---- matching -------------------------------------------------------------------
    def matches(self, module: nn.Module) -> bool:
        """Whether this kind handles ``module`` (default: isinstance of ``modules``)."""
        return bool(self.modules) and isinstance(module, self.modules)

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
        """Canonical ``(O, I')`` of the local parameter gradient, from module attributes."""

    def shard_info(self, module: nn.Module) -> ShardInfo | None:
        """Where this module's local parameter sits in the full one (tensor parallelism)."""
        return None

    @abstractmethod
    def build(self, module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> Factorized | Dense:
        """Turn a saved input and its output-grad (already scaled per example) into data.

        Args:
            a: saved input, as returned by ``activation`` (any leading layout).
            g: gradient w.r.t. ``output``, same leading layout, scaled so that example b's
                gradient is the gradient of its own loss.
        """

    def to_batch_first(self, t: torch.Tensor, feature_dims: int = 1) -> torch.Tensor:
        """Reshape ``[B, *, F]`` to ``[B, T, F]`` (``[B, F]`` becomes ``[B, 1, F]``)."""
        if feature_dims == 0:
            return t.reshape(t.shape[0], -1)
        return t.reshape(t.shape[0], -1, t.shape[-1])

    # ---- maths on the factorized form -----------------------------------------------
    def dims(self, f: Factorized, shape: tuple[int, int]) -> LayerDims:
        """Cost-model dimensions of ``f`` for a layer of canonical ``shape = (O, I')``."""
        return LayerDims(B=f.g.shape[0], T=f.g.shape[1], I=shape[1], O=shape[0],
                         index_input=not f.a.is_floating_point(), itemsize=f.g.element_size())

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

    def input_width(self, module: nn.Module) -> int:
        """I' of the canonical layout (what a Kronecker input projection multiplies)."""
        return self.layer_shape(module)[1]

    # ---- reference layout -----------------------------------------------------------
    @abstractmethod
    def canonical(self, module: nn.Module, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Map parameter gradients ``{param_name: [..., *param.shape]}`` to ``[..., O*I']``."""


class PredicateKind(LayerKind):
    """A kind matched by a predicate instead of a type (e.g. any ``*RMSNorm`` class)."""

    predicate: ClassVar[Callable[[nn.Module], bool]]

    def matches(self, module: nn.Module) -> bool:
        return type(self).predicate(module)


def param_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape, also when ZeRO-3 has replaced its data by a placeholder."""
    ds_shape = getattr(p, "ds_shape", None)
    return tuple(ds_shape) if ds_shape is not None else tuple(p.shape)


def kind_for(module: nn.Module) -> LayerKind | None:
    """The registered kind that handles ``module``, or None."""
    for kind in _MATCH_ORDER:
        if kind.matches(module):
            return kind
    return None


def get_kind(name: str) -> LayerKind:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnsupportedLayerError(
            f"No LayerKind named '{name}'; registered kinds: {sorted(_REGISTRY)}"
        ) from None


def registered_kinds() -> dict[str, LayerKind]:
    return dict(_REGISTRY)
