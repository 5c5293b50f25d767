"""nn.Linear and Hugging Face Conv1D: outer-product kinds that differ only in weight layout."""

from __future__ import annotations

import torch
from torch import nn

from dattri_ds.layers.outer import OuterProductKind

__all__ = ["LinearKind", "Conv1DKind"]


class LinearKind(OuterProductKind, name="linear", modules=(nn.Linear,)):
    """``y = x W^T + b``, W ``[O, I]``: canonical layout is W itself, bias as last column."""

    def layer_shape(self, module: nn.Module) -> tuple[int, int]:
        bias = getattr(module, "bias", None) is not None
        return module.out_features, module.in_features + int(bias)

    def canonical(self, module, grads):
        w = grads["weight"]
        if "bias" in grads:
            w = torch.cat([w, grads["bias"].unsqueeze(-1)], dim=-1)
        return w.flatten(-2)


def _is_hf_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


class Conv1DKind(OuterProductKind, name="conv1d"):
    """Hugging Face ``Conv1D`` (GPT-2): ``y = x W + b`` with W ``[I, O]``.

    Matched by class name so that ``import dattri_ds`` does not import transformers.
    Canonical layout is ``W^T`` (``[O, I]``) with the bias as last column.
    """

    def matches(self, module: nn.Module) -> bool:
        return _is_hf_conv1d(module)

    def match_class(self, cls: type) -> bool | None:
        """Hugging Face's own class always has ``nf``/``nx``; another class of the name is
        asked one module at a time."""
        if cls.__name__ != "Conv1D":
            return False
        return True if cls.__module__.startswith("transformers.") else None

    def layer_shape(self, module: nn.Module) -> tuple[int, int]:
        bias = getattr(module, "bias", None) is not None
        return module.nf, module.nx + int(bias)

    def canonical(self, module, grads):
        w = grads["weight"].transpose(-1, -2)
        if "bias" in grads:
            w = torch.cat([w, grads["bias"].unsqueeze(-1)], dim=-1)
        return w.flatten(-2)
