"""The torch optimizer and lr schedule of the backends that step one themselves (torch, megatron).

From the DeepSpeed JSON: the optimizer (``AdamW``/``Adam``/``SGD``), the scheduler (the
DeepSpeed ``lr_schedules`` class, the only import from DeepSpeed), batch sizes and clipping;
``TorchOptimized`` is the part of ``Backend`` the two share (the learning rate, and each
micro-batch's backward of its loss scaled by ``1 / gas``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.launch.backend import Backend

__all__ = ["TorchOptimized", "make_optimizer", "make_schedule", "optimizer_spec", "OPTIMIZERS",
           "USED_DS_KEYS"]

logger = logging.getLogger("dattri_ds.launch")

#: DeepSpeed keys the torch optimizer path reads; the other keys of the JSON are ignored
#: (and logged).
USED_DS_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "optimizer", "scheduler", "train_batch_size")

#: ``optimizer.type`` of the DeepSpeed JSON (lower case) -> torch optimizer.
OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def optimizer_spec(ds_config: dict) -> tuple[str, dict]:
    """``(kind, params)`` of the JSON's optimizer: kind in ``OPTIMIZERS``, DeepSpeed-only
    params (``torch_adam``, ``adam_w_mode``) dropped.

    Raises:
        ConfigError: another optimizer type.
    """
    spec = ds_config.get("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
    kind, p = spec.get("type", "AdamW").lower(), dict(spec.get("params", {}))
    if kind not in OPTIMIZERS:
        raise ConfigError(f"optimizer.type '{spec.get('type')}' of the DeepSpeed JSON is not "
                          f"supported by the torch optimizer of --backend torch/megatron; use "
                          f"one of AdamW, Adam, SGD (or --backend deepspeed)")
    p.pop("torch_adam", None)
    p.pop("adam_w_mode", None)
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


class TorchOptimized(Backend):
    """A backend that steps a torch optimizer (``_opt``, schedule ``sched``) itself
    (``--backend torch`` and ``megatron``): batch sizes and clipping from the DeepSpeed JSON,
    each micro-batch's loss scaled by ``1 / gas``."""

    _opt: Any

    def _from_json(self, ds_config: dict, name: str) -> None:
        """The JSON's clipping, micro-batch and accumulation; a note naming its ignored keys."""
        self.clip = float(ds_config.get("gradient_clipping", 0.0))
        self.micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
        self.gas = int(ds_config.get("gradient_accumulation_steps", 1))
        ignored = sorted(set(ds_config) - set(USED_DS_KEYS) - {"steps_per_print"})
        if ignored:
            logger.info("--backend %s ignores these DeepSpeed keys: %s (used: micro-batch "
                        "size, gradient accumulation, clipping, optimizer, scheduler)",
                        name, ignored)

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

