"""Plain PyTorch backend of launch/train.py: one process, a Hugging Face causal LM, a torch optimizer.

    python launch/train.py --backend torch --deepspeed_config configs/zero3_cpu.json --capture

No DeepSpeed engine and no process launcher: it trains in the calling process (a one-rank
gloo group, so the loop's collectives are no-ops). Of the DeepSpeed JSON it reads the
``"dattri_ds"`` block, batch sizes, clipping (global norm), the optimizer (``AdamW``/``Adam``/
``SGD``) and the scheduler (the DeepSpeed ``lr_schedules`` class, the only import from
DeepSpeed); other keys are ignored, with a logged note. The demo and the selection
benchmarks train through ``train_in_process`` (launch/train.py). Checkpoints:
``checkpoints/<tag>/`` is a ``save_pretrained`` folder plus ``training_state.pt``
(optimizer, lr schedule and meta) for ``--resume``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import ConfigError
from dattri_ds.capture.engine import SteppedAdapter
from dattri_ds.launch.config import RunConfig
from dattri_ds.launch.loop import Backend

__all__ = ["TorchBackend", "TorchOptimized", "make_optimizer", "make_schedule", "optimizer_spec",
           "OPTIMIZERS"]

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


class _LoopAdapter(SteppedAdapter):
    """Capture's view of this backend: loss scaled by ``1 / gas``, steps marked by the
    backend (``step_done`` after each optimizer step)."""

    def __init__(self, model: nn.Module, gas: int, start_step: int) -> None:
        super().__init__(start_step)
        self.model, self.gas = model, gas

    def unwrap(self) -> nn.Module:
        return self.model

    def parallel_context(self) -> ParallelContext:
        return ParallelContext()

    def backward_scale(self) -> float:
        return 1.0 / self.gas



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


def local_device() -> torch.device:
    """This process's CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchBackend(TorchOptimized):
    """``--backend torch``: one process, no DeepSpeed engine."""

    reuses_selection_forward = True

    @classmethod
    def setup(cls, ds_config: dict, cfg: RunConfig) -> tuple[int, int]:
        """A one-rank gloo group (in-process store) unless one exists already.

        Raises:
            ConfigError: started by a multi-process launcher.
        """
        import torch.distributed as dist

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != 1:
            raise ConfigError(f"--backend torch trains in one process, but WORLD_SIZE={world}: "
                              f"run `python launch/train.py --backend torch ...` (no torchrun "
                              f"or deepspeed launcher), or use --backend deepspeed")
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        elif dist.get_world_size() != 1:
            raise ConfigError(f"--backend torch trains in one process, but the process group "
                              f"has {dist.get_world_size()} ranks; use --backend deepspeed")
        return 0, 1

    def __init__(self, ds_config: dict, cfg: RunConfig, tok, data) -> None:
        from dattri_ds.launch.deepspeed_backend import build
        from dattri_ds.launch.init_from import init_hf_weights

        self.device = local_device()
        self.model = build(cfg, tok).to(self.device)
        init_hf_weights(self.model, cfg)  # --init-checkpoint: an earlier run's weights
        self.ctx = ParallelContext()
        self._opt, self.sched = make_optimizer(
            ds_config, [p for p in self.model.parameters() if p.requires_grad])
        self._from_json(ds_config, "torch")
        #: Global gradient norm before clipping, one per optimizer step.
        self.grad_norms: list[float] = []
        self.adapter: _LoopAdapter | None = None

    def optimizer_step(self) -> None:
        """Clip by the global norm (``gradient_clipping``; 0 = never), step, advance the
        schedule, zero the gradients; then tell the capture a step ended."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.clip if self.clip > 0
                                              else float("inf"))
        self.grad_norms.append(float(norm))
        self._opt.step()
        if self.sched is not None:
            self.sched.step()
        self._opt.zero_grad(set_to_none=True)
        if self.adapter is not None:
            self.adapter.step_done()

    def attach_capture(self, cfg: RunConfig, callbacks: list, start_step: int):
        from dattri_ds import GradientCapture

        self.adapter = _LoopAdapter(self.model, self.gas, start_step)
        cap = GradientCapture(self.model, cfg.capture, callbacks=callbacks,
                              scale_fn=self.adapter.backward_scale,
                              step_fn=self.adapter.global_step)
        cap.adapter = self.adapter
        return cap.attach()

    def save(self, ckpt_dir: Path, tag: str, meta: dict, data) -> None:
        from transformers.utils import logging as hf_logging

        folder = ckpt_dir / tag
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one "Writing model shards" bar per checkpoint
        try:
            self.model.save_pretrained(str(folder))
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        state = {"optimizer": self._opt.state_dict(), "meta": dict(meta),
                 "scheduler": None if self.sched is None else self.sched.state_dict()}
        torch.save(state, folder / "training_state.pt.tmp")
        os.replace(folder / "training_state.pt.tmp", folder / "training_state.pt")

    def load(self, ckpt_dir: Path, tag: str) -> None:
        from transformers import AutoModelForCausalLM

        folder = ckpt_dir / tag
        if not (folder / "training_state.pt").exists():
            raise ConfigError(f"--resume {tag}: {folder} has no training_state.pt (not written "
                              f"by --backend torch); resume with the backend that wrote it")
        saved = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        self.model.load_state_dict(saved.state_dict())
        state = torch.load(folder / "training_state.pt", map_location=self.device,
                           weights_only=False)
        self._opt.load_state_dict(state["optimizer"])
        if self.sched is not None and state["scheduler"] is not None:
            self.sched.load_state_dict(state["scheduler"])

    def summary(self) -> dict:
        return {"backend": "torch"}
