"""The torch optimizer and lr schedule of the backends that step one themselves (torch, megatron).

From the DeepSpeed JSON, read as DeepSpeed reads it: the optimizer (``AdamW``/``Adam``/
``SGD``; ``Adam`` is AdamW unless ``adam_w_mode`` is false, as in DeepSpeed), the scheduler
(the DeepSpeed ``lr_schedules`` class), the three batch keys (DeepSpeed's rule:
launch/engine.py ``resolve_batch``) and ``gradient_clipping`` (DeepSpeed's default when left
out); every other key is named in a notice as ignored. ``TorchOptimized`` is the part of
``Backend`` the two share (the learning rate, and each micro-batch's backward of its loss
scaled by ``1 / gas``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.launch.backend import Backend
from dattri_ds.launch.engine import resolve_batch

__all__ = ["TorchOptimized", "make_optimizer", "make_schedule", "optimizer_spec", "OPTIMIZERS",
           "USED_DS_KEYS"]

logger = logging.getLogger("dattri_ds.launch")

#: DeepSpeed keys the torch optimizer path honours; every other key of the JSON is named in
#: a notice as ignored.
USED_DS_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "gradient_clipping", "optimizer", "scheduler")

#: ``optimizer.type`` of the DeepSpeed JSON (lower case) -> torch optimizer.
OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def optimizer_spec(ds_config: dict) -> tuple[str, dict]:
    """``(kind, params)`` of the JSON's optimizer: kind in ``OPTIMIZERS`` (``adam`` with
    DeepSpeed's default ``adam_w_mode: true`` is ``adamw``, as DeepSpeed builds it),
    DeepSpeed-only params (``torch_adam``, ``adam_w_mode``, ``fp32_optimizer_states``)
    dropped.

    Raises:
        ConfigError: another optimizer type.
    """
    spec = ds_config.get("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
    kind, p = spec.get("type", "AdamW").lower(), dict(spec.get("params", {}))
    if kind not in OPTIMIZERS:
        raise ConfigError(f"optimizer.type '{spec.get('type')}' of the DeepSpeed JSON is not "
                          f"supported by the torch optimizer of --backend torch/megatron; use "
                          f"one of AdamW, Adam, SGD (or --backend deepspeed)")
    if kind == "adam" and p.get("adam_w_mode", True):
        kind = "adamw"
    for key in ("torch_adam", "adam_w_mode", "fp32_optimizer_states"):
        p.pop(key, None)
    return kind, p


def make_optimizer(ds_config: dict, params):
    """A torch optimizer and (optionally) a DeepSpeed lr schedule from the DeepSpeed JSON."""
    kind, p = optimizer_spec(ds_config)
    opt = OPTIMIZERS[kind](params, **p)
    return opt, make_schedule(ds_config, opt)


def make_schedule(ds_config: dict, opt):
    """The DeepSpeed ``lr_schedules`` class of the JSON driving a torch optimizer, or None.

    Raises:
        ConfigError: the JSON names a scheduler and DeepSpeed is not installed.
    """
    if "scheduler" not in ds_config:
        return None
    try:
        from deepspeed.runtime import lr_schedules
    except ImportError:
        raise ConfigError("the DeepSpeed JSON has a 'scheduler': its lr_schedules class comes "
                          "from DeepSpeed, which is not installed; pip install deepspeed, or "
                          "remove 'scheduler' for a constant learning rate") from None
    s = ds_config["scheduler"]
    return getattr(lr_schedules, s["type"])(opt, **s.get("params", {}))


def _clipping_default() -> float:
    """DeepSpeed's ``gradient_clipping`` when the JSON leaves it out (the installed
    DeepSpeed's constant; 0.0, no clipping, without DeepSpeed)."""
    try:
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    except ImportError:  # pragma: no cover - deepspeed is an optional extra
        return 0.0
    return float(GRADIENT_CLIPPING_DEFAULT)


class TorchOptimized(Backend):
    """A backend that steps a torch optimizer (``_opt``, schedule ``sched``) itself
    (``--backend torch`` and ``megatron``): batch sizes and clipping from the DeepSpeed JSON,
    each micro-batch's loss scaled by ``1 / gas``."""

    _opt: Any

    def _from_json(self, ds_config: dict, name: str) -> None:
        """The JSON's clipping (DeepSpeed's default when left out), micro-batch and
        accumulation (DeepSpeed's batch rule on this run's data-parallel ranks); a notice
        naming every key it ignores."""
        self.clip = float(ds_config.get("gradient_clipping", _clipping_default()))
        _, self.micro, self.gas = resolve_batch(ds_config, self.ctx.dp_world,
                                                "the DeepSpeed config")
        ignored = sorted(set(ds_config) - set(USED_DS_KEYS))
        if ignored:
            logger.info("--backend %s ignores these DeepSpeed keys: %s (it honours %s)",
                        name, ", ".join(ignored), ", ".join(USED_DS_KEYS))

    @property
    def optimizer(self):
        return self._opt

    def lr(self) -> float:
        return float(self._opt.param_groups[0]["lr"])

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.backward_reused(self.model(**batch).loss)

    def backward_reused(self, loss: torch.Tensor) -> torch.Tensor:
        (loss / self.gas).backward()
        return loss.detach()

