"""LayerNorm and RMSNorm-style modules: per-example gradients are produced dense.

For ``y = xhat * w (+ b)`` the per-example gradients are ``dw_b = sum_t g_bt * xhat_bt`` and
``db_b = sum_t g_bt``: ``[B, D]`` each, no larger than the factors themselves, so the
factorized form would never be cheaper (the cost model is not consulted). Canonical layout:
rows ``[w; b]``, shape ``(1 + has_bias, D)``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dattri_ds.errors import UnsupportedLayerError
from dattri_ds.gradient import Dense
from dattri_ds.layers.base import LayerKind, param_shape
from dattri_ds.layers.stacking import grouped, scaled, stack, stack_pays

__all__ = ["DenseKind", "LayerNormKind", "RMSNormKind"]


class DenseKind(LayerKind):
    """Base for kinds whose ``build`` returns ``Dense``; factorized maths does not apply."""

    dense_only = True

    def _no_factorized(self, *_args, **_kwargs):
        raise UnsupportedLayerError(f"LayerKind '{self.name}' has no factorized form")

    materialize = cross_gram = cross_dense = project_kron = _no_factorized

    def _dense(self, module: nn.Module, xhat: torch.Tensor, g: torch.Tensor,
               token_dim: int | None = None) -> Dense:
        """``[sum_t g_t * xhat_t ; sum_t g_t]`` per example -> ``[B, (1 + bias) * D]``.

        ``token_dim=None``: batch-first ``[B, *, D]``; ``0``: sequence-first ``[S, B, D]``,
        summed in place (no transpose copy). The sums run in fp32 (``xhat`` is fp32); the
        rows come back in ``g``'s dtype, the capture dtype, like the factors of other kinds.
        """
        if token_dim is None:
            xhat = xhat.reshape(xhat.shape[0], -1, xhat.shape[-1])
            g, token_dim = g.reshape(g.shape[0], -1, g.shape[-1]), 1
        out_dtype, g = g.dtype, g.to(xhat.dtype)
        prod = g * xhat
        if getattr(module, "bias", None) is None:
            return Dense(prod.sum(token_dim).to(out_dtype))
        rows = prod.new_empty(prod.shape[1 - token_dim], 2, prod.shape[-1])
        torch.sum(prod, token_dim, out=rows[:, 0])  # the two sums straight into [w; b]
        torch.sum(g, token_dim, out=rows[:, 1])
        return Dense(rows.view(rows.shape[0], -1).to(out_dtype))

    def stack_key(self, module: nn.Module) -> tuple | None:
        """What ``normalized`` and ``_dense`` read of a module: modules with one key (and
        inputs of one shape) are built as one stacked group. None: built on its own."""
        return None

    def build_many(self, modules, pairs, scale=None, dtype=None, cost=None):
        """``build`` of many layers, one stacked group per ``stack_key`` and shape where
        stacking pays: one normalization, one product and one or two sums for the group."""
        if type(self).build is not DenseKind.build:
            return super().build_many(modules, pairs, scale, dtype, cost)
        out: list = [None] * len(pairs)
        keys = [self.stack_key(m) for m in modules]
        keys = [None if k is None else (k, a.shape, a.dtype, a.device, g.shape, g.dtype)
                for k, (a, g) in zip(keys, pairs)]
        for idx in grouped(keys):
            if not stack_pays(cost, [pairs[i][0] for i in idx], 6, 2):
                for i, data in zip(idx, super().build_many(
                        [modules[i] for i in idx], [pairs[i] for i in idx], scale, dtype)):
                    out[i] = data
                continue
            gs = [pairs[i][1] for i in idx]
            if scale is not None:
                gs = scaled(gs, scale, dtype)
            a, g = stack([pairs[i][0] for i in idx]), stack(gs)
            m, b = modules[idx[0]], a.shape[1]
            rows = self.build(m, a.flatten(0, 1), g.flatten(0, 1)).values
            for n, i in enumerate(idx):
                out[i] = Dense(rows[n * b:(n + 1) * b])
        return out

    def normalized(self, module: nn.Module, a: torch.Tensor) -> torch.Tensor:
        """``xhat`` (fp32) of the module's input ``a``, any layout with features last."""
        raise NotImplementedError

    def build(self, module, a, g):
        return self._dense(module, self.normalized(module, a), g)

    def canonical(self, module, grads):
        rows = [grads["weight"]]
        if "bias" in grads:
            rows.append(grads["bias"])
        return torch.stack(rows, dim=-2).flatten(-2)


class LayerNormKind(DenseKind, name="layernorm", modules=(nn.LayerNorm,)):
    """``nn.LayerNorm`` over the last dimension, ``xhat = (x - mean) / sqrt(var + eps)``."""

    def check(self, module: nn.Module, name: str) -> None:
        if len(module.normalized_shape) != 1:
            raise UnsupportedLayerError(
                f"Layer '{name}': LayerNorm over {module.normalized_shape} (more than the last "
                f"dimension) is not supported; exclude it with capture.exclude=['{name}']"
            )

    def layer_shape(self, module):
        return 1 + int(module.bias is not None), module.normalized_shape[0]

    def normalized(self, module, a):
        return F.layer_norm(a.float(), a.shape[-1:], eps=module.eps)

    def stack_key(self, module):
        return module.eps, module.bias is not None


def _rms_eps(module: nn.Module) -> float | None:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        if hasattr(module, attr):
            return getattr(module, attr)
    return None


def _is_rmsnorm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm")
            and isinstance(getattr(module, "weight", None), nn.Parameter)
            and any(hasattr(module, k) for k in ("eps", "variance_epsilon", "epsilon")))


class RMSNormKind(DenseKind, name="rmsnorm"):
    """``torch.nn.RMSNorm`` and HF ``*RMSNorm``: ``xhat = x / sqrt(mean(x^2) + eps)``.

    Gemma-style ``(1 + w)`` scaling has the same weight gradient and is covered too.
    """

    def matches(self, module):
        return _is_rmsnorm(module)

    def match_class(self, cls):
        return None if cls.__name__.endswith("RMSNorm") else False

    def layer_shape(self, module):
        return 1 + int(getattr(module, "bias", None) is not None), param_shape(module.weight)[-1]

    def normalized(self, module, a):
        eps = _rms_eps(module)
        if eps is None:
            eps = torch.finfo(a.dtype).eps
        return F.rms_norm(a.float(), a.shape[-1:], eps=eps)

    def stack_key(self, module):
        return _rms_eps(module), getattr(module, "bias", None) is not None
