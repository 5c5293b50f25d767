"""TRL's fused LM head, replaced while capturing by one that calls the ``lm_head`` module.

TRL's fused head (``model(..., fused_lm_head=True)``) computes log-probabilities from the
head's weight without calling ``lm_head``, so its hook never runs. ``unfuse_lm_head`` swaps
in a forward with the same outputs from the model's own ``[B, T, V]`` logits (memory for
large vocabularies, but every layer's gradient exact)."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["unfuse_lm_head"]


def _is_fused(model: nn.Module) -> bool:
    fwd = model.__dict__.get("forward")
    code = getattr(getattr(fwd, "__func__", fwd), "__code__", None)
    return code is not None and code.co_name == "_fused_forward"  # functools.wraps renames it


def unfuse_lm_head(model: nn.Module) -> Callable[[], None] | None:
    """Replace TRL's fused head forward of ``model``; returns the undo, or None if unfused."""
    if not _is_fused(model):
        return None
    fused = model.__dict__["forward"]
    cls_forward = type(model).forward

    def forward(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None,
                num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return fused(*args, labels=labels, shift_labels=shift_labels,
                         num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        logits = cls_forward(self, *args, **kwargs).logits
        return _head_outputs(logits, labels, shift_labels, num_items_in_batch)

    mine = model.forward = types.MethodType(forward, model)

    def undo() -> None:
        if model.__dict__.get("forward") is mine:  # not wrapped since (accelerate does)
            model.forward = fused
    return undo


def _head_outputs(logits: torch.Tensor, labels, shift_labels, num_items_in_batch):
    """TRL's ``FusedCausalLMOutput`` fields from full logits ``[B, T, V]`` (temperature 1)."""
    from trl.trainer.utils import FusedCausalLMOutput

    if shift_labels is None:
        logits, target = logits[:, :-1], labels[:, 1:]
    else:
        target = shift_labels
    mask = target != -100
    logp = torch.log_softmax(logits.float(), dim=-1)
    log_probs = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1) * mask
        is_top1 = (logp.argmax(-1) == target) & mask
    denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-log_probs.sum() / denom, log_probs=log_probs,
                               entropy=entropy, is_top1=is_top1, label_mask=mask)
