"""Optimizer-aware (LESS-style) target: ``P g_target`` with Adam's diagonal preconditioner.

An Adam step on example b moves the parameters by ``-lr * P g_b`` (first step of a fresh
moment; in general the update direction is preconditioned by ``P = 1/(sqrt(v_hat) + eps)``),
so the first-order drop of the target loss is ``lr * <g_target, P g_b> = lr * <g_b, P g_target>``.
``P`` is diagonal, so it is applied to the (dense, one-row) target once per target refresh
and the candidates stay factorized: scoring cost is unchanged.

Where the second moments live:

* a torch optimizer (plain loop, DDP, Megatron backend): ``optimizer.state[p]["exp_avg_sq"]``;
* DeepSpeed ZeRO-3: each rank holds the flat partition ``[r * n_r, (r + 1) * n_r)`` of every
  parameter's state (``safe_get_local_optimizer_state``); each rank scales its own partition
  of the target and one all-reduce per refresh reassembles ``P g_target``;
* DeepSpeed ZeRO-1/2: ``safe_get_full_optimizer_state`` (a collective, once per refresh).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.gradient import Dense, GradBatch
from dattri_ds.layers.base import LayerKind
from dattri_ds.selection.state import grad_batch_from_state, grad_batch_state
from dattri_ds.selection.target import TargetProvider

__all__ = ["SecondMoments", "TorchAdamMoments", "DeepSpeedMoments", "second_moments",
           "precondition_target", "PreconditionedTarget", "preconditioned"]


def _adam_hyper(optimizer) -> tuple[float, float]:
    """``(beta2, eps)`` of an Adam-family torch optimizer; ConfigError for any other."""
    groups = getattr(optimizer, "param_groups", None) or []
    if not groups or "betas" not in groups[0] or "eps" not in groups[0]:
        raise ConfigError(f"selection.precondition='adam' needs an Adam-family optimizer with "
                          f"second moments (betas, eps, exp_avg_sq); got "
                          f"{type(optimizer).__name__}. Use Adam/AdamW or set "
                          f"selection.precondition to 'none'")
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


class DeepSpeedMoments(SecondMoments):
    """A DeepSpeed ZeRO optimizer wrapping an Adam-family optimizer (stage 1, 2 or 3)."""

    def __init__(self, zero_optimizer, ctx: ParallelContext) -> None:
        super().__init__(zero_optimizer.optimizer)
        self.ctx = ctx
        self.partitioned = True

    def local(self, param):
        from deepspeed.utils import safe_get_full_optimizer_state, safe_get_local_optimizer_state

        if not hasattr(param, "ds_id"):  # ZeRO-1/2: the full state (collective)
            v = safe_get_full_optimizer_state(param, "exp_avg_sq")
            if v is None:
                return None
            # every rank has all of it: only rank 0 contributes to the reduced sum
            return (v.flatten(), 0) if self.ctx.dp_rank == 0 else (v.flatten()[:0], 0)
        if self.step() == 0:
            return None
        v = safe_get_local_optimizer_state(param, "exp_avg_sq").flatten()
        part = param.ds_tensor.ds_numel
        lo = self.ctx.dp_rank * part
        return v[:max(0, min(part, param.ds_numel - lo))], lo

    def step(self) -> int:
        return _step_count(self.optimizer)


def second_moments(optimizer, ctx: ParallelContext | None = None) -> SecondMoments:
    """The SecondMoments of a torch optimizer or a DeepSpeed ZeRO optimizer; ConfigError
    (at start) when it keeps no Adam second moment."""
    inner = getattr(optimizer, "optimizer", None)
    names = {c.__name__ for c in type(optimizer).__mro__}
    if inner is not None and any("Zero" in n or "ZeRO" in n for n in names):
        return DeepSpeedMoments(optimizer, ctx or ParallelContext())
    if optimizer is None:
        raise ConfigError("selection.precondition='adam' needs the training optimizer: pass "
                          "optimizer= to the selector (launch/train.py does)")
    return TorchAdamMoments(optimizer)


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


class PreconditionedTarget(TargetProvider):
    """A TargetProvider whose target is ``P g`` of another's, recomputed once per refresh."""

    def __init__(self, inner: TargetProvider, layers: dict[str, tuple[nn.Module, LayerKind]],
                 moments: SecondMoments, ctx: ParallelContext | None = None) -> None:
        self.inner, self.layers, self.moments, self.ctx = inner, layers, moments, ctx
        self._seen = -1
        self._value: GradBatch | None = None

    @property
    def refreshes(self) -> int:
        return self.inner.refreshes

    @property
    def rows_per_rank(self) -> int:
        return self.inner.rows_per_rank

    def state_dict(self) -> dict:
        """The inner provider's state and the cached ``P g`` (the second moments of the
        refresh that made it are gone after more optimizer steps)."""
        return {"inner": self.inner.state_dict(), "value": grad_batch_state(self._value),
                "seen": self._seen}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self._value = grad_batch_from_state(state["value"], self.layers)
        self._seen = int(state["seen"])

    def get(self, step: int) -> GradBatch:
        raw = self.inner.get(step)
        if self._value is None or self.refreshes != self._seen:
            self._value = precondition_target(raw, self.layers, self.moments, self.ctx)
            self._seen = self.refreshes
        return self._value


def preconditioned(gradient: TargetProvider, probe, ctx: ParallelContext | None,
                   optimizer) -> TargetProvider:
    """``gradient`` in the optimizer's metric, ``P g`` (``selection.precondition="adam"``)."""
    return PreconditionedTarget(gradient, probe.layers, second_moments(optimizer, ctx), ctx)
