"""Registered layer kinds; importing this package registers the built-in kinds."""

from dattri_ds.layers.base import LayerDims, LayerKind, get_kind, kind_for, registered_kinds
from dattri_ds.layers import embedding, linear, norm  # noqa: F401  (registration)
from dattri_ds.layers import megatron  # noqa: F401  (registration; megatron imported lazily)

__all__ = ["LayerDims", "LayerKind", "get_kind", "kind_for", "registered_kinds"]
