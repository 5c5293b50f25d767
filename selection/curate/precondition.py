"""Adam's diagonal preconditioner on a target gradient (LESS): ``P g_target``,
``P = 1/(sqrt(v_hat) + eps)``, so the first-order drop of the target loss after an Adam step
on example b is ``lr * <g_b, P g_target>``. ``P`` is applied to the dense target rows; the
candidates stay factorized. Used by offline curation's ``--method adam-cosine``."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.gradient import Dense, GradBatch
from dattri_ds.layers.base import LayerKind

__all__ = ["SecondMoments", "TorchAdamMoments", "precondition_target"]


def _adam_hyper(optimizer) -> tuple[float, float]:
    """``(beta2, eps)`` of an Adam-family torch optimizer; ConfigError for any other."""
    groups = getattr(optimizer, "param_groups", None) or []
    if not groups or "betas" not in groups[0] or "eps" not in groups[0]:
        raise ConfigError(f"Adam preconditioning needs an Adam-family optimizer with second "
                          f"moments (betas, eps, exp_avg_sq); got {type(optimizer).__name__}. "
                          f"Use Adam/AdamW, or a method without Adam preconditioning")
    return float(groups[0]["betas"][1]), float(groups[0]["eps"])


def _step_count(optimizer) -> int:
    for st in optimizer.state.values():
        if "step" in st:
            return int(st["step"])
    group = optimizer.param_groups[0]
    return int(group.get("step", 0))


class SecondMoments(ABC):
    """This rank's part of Adam's ``v`` for a parameter, with the bias-correction data."""

    partitioned: bool = False
    """Each rank holds only a slice: results must be summed over the data-parallel group."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.beta2, self.eps = _adam_hyper(optimizer)

    def step(self) -> int:
        """Optimizer steps taken (0: no second moment yet)."""
        return _step_count(self.optimizer)

    @abstractmethod
    def local(self, param: nn.Parameter) -> tuple[torch.Tensor, int] | None:
        """``(v_slice flat, offset into the flattened parameter)``; None: no state yet."""


class TorchAdamMoments(SecondMoments):
    """A torch ``Adam``/``AdamW`` (any optimizer keeping ``state[p]["exp_avg_sq"]``)."""

    def local(self, param):
        st = self.optimizer.state.get(param, {})
        v = st.get("exp_avg_sq")
        return None if v is None else (v.detach().flatten(), 0)


def _index_map(module: nn.Module, kind: LayerKind) -> tuple[torch.Tensor, list]:
    """``[D]`` position of every canonical entry in the concatenated flat parameters."""
    params, parts, off = [], {}, 0
    for name, p in module.named_parameters(recurse=False):
        shape = tuple(getattr(p, "ds_shape", p.shape))
        n = int(torch.Size(shape).numel())
        parts[name] = torch.arange(off, off + n, dtype=torch.float64).view(shape)
        params.append((p, off, n))
        off += n
    return kind.canonical(module, parts).flatten().round().long(), params


@torch.no_grad()
def precondition_target(target: GradBatch, layers: dict[str, tuple[nn.Module, LayerKind]],
                        moments: SecondMoments,
                        ctx: ParallelContext | None = None) -> GradBatch:
    """``P g_target`` per layer, ``P = 1 / (sqrt(v / (1 - beta2^t)) + eps)``; the target
    unchanged before the optimizer's first step (no second moment yet)."""
    ctx = ctx or ParallelContext()
    t = moments.step()
    if t == 0:
        return target
    corr = 1.0 - moments.beta2 ** t
    out = {}
    for name, lg in target.layers.items():
        module, kind = layers[name]
        idx, params = _index_map(module, kind)
        vals = lg.data.values
        flat = torch.zeros(int(idx.max()) + 1, dtype=torch.float32, device=vals.device)
        flat[idx] = vals[0].float()
        scaled = torch.zeros_like(flat)
        for p, off, n in params:
            got = moments.local(p)
            if got is None:
                return target
            v, lo = got
            v = v.to(flat.device, torch.float32)
            sl = slice(off + lo, off + lo + v.numel())
            scaled[sl] = flat[sl] / ((v / corr).sqrt() + moments.eps)
        if moments.partitioned:
            all_reduce_sum(scaled, ctx.dp_group, ctx.dp_world)
        out[name] = lg.replace(data=Dense(scaled[idx].to(vals.dtype).unsqueeze(0)))
    return GradBatch(step=target.step, sample_ids=target.sample_ids, layers=out)
