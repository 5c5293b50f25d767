"""Plain PyTorch backend of launch/train.py: one process, a Hugging Face causal LM, a torch optimizer.

    python launch/train.py --backend torch --deepspeed_config configs/zero3_cpu.json --capture

No DeepSpeed engine and no process launcher: it trains in the calling process (a one-rank
gloo group, so the loop's collectives are no-ops). Of the DeepSpeed JSON it reads the
``"dattri_ds"`` block and, as DeepSpeed reads them, the three batch keys, clipping (global
norm), the optimizer (``AdamW``/``Adam``/``SGD``) and the scheduler (the DeepSpeed
``lr_schedules`` class; launch/optimizer.py); a notice names every other key as ignored.
The demo and the selection benchmarks train through ``train_in_process`` (launch/train.py).
Checkpoints:
``checkpoints/<tag>/`` is a ``save_pretrained`` folder plus ``training_state.pt``
(optimizer, lr schedule and meta) for ``--resume``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import ConfigError
from dattri_ds.io.files import load_torch
from dattri_ds.io.outputs import naming
from dattri_ds.capture.engine import SteppedAdapter
from dattri_ds.launch.backend import local_device
from dattri_ds.launch.config import RunConfig
from dattri_ds.launch.engine import data_parallel_world
from dattri_ds.launch.optimizer import TorchOptimized, make_optimizer

__all__ = ["TorchBackend"]


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

        data_parallel_world(cfg.engine)  # WORLD_SIZE 1: no launcher
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
            with naming(folder / "model.safetensors"):  # safetensors names no file
                self.model.save_pretrained(str(folder))
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        state = {"optimizer": self._opt.state_dict(), "meta": dict(meta),
                 "scheduler": None if self.sched is None else self.sched.state_dict()}
        torch.save(state, folder / "training_state.pt")

    def load(self, ckpt_dir: Path, tag: str) -> None:
        from transformers import AutoModelForCausalLM

        folder = ckpt_dir / tag
        if not (folder / "training_state.pt").exists():
            raise ConfigError(f"--resume {tag}: {folder} has no training_state.pt (not written "
                              f"by --backend torch); resume with the backend that wrote it")
        saved = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        self.model.load_state_dict(saved.state_dict())
        state = load_torch(folder / "training_state.pt", "training state",
                           fix="resume from an earlier checkpoint (--resume <tag>)",
                           map_location=self.device, trusted="a --backend torch checkpoint")
        self._opt.load_state_dict(state["optimizer"])
        if self.sched is not None and state["scheduler"] is not None:
            self.sched.load_state_dict(state["scheduler"])

    def summary(self) -> dict:
        return {"backend": "torch"}
