"""DeepSpeed engine adapter: ZeRO-0/1/2/3, gradient accumulation, fp32/bf16/fp16 loss scaling.

Hooks go on ``engine.module`` (under ZeRO-3 activations and output-grads are full-size, so
no partitioned weight is read); ``backward_scale()`` is the engine's ``loss_scale /
gradient_accumulation_steps``; ``engine.step()`` is wrapped on the instance (restored on
detach) to mark the step boundary. Why each is safe: docs/integrations.md."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dattri_ds.distributed import ParallelContext
from dattri_ds.capture.engine import EngineAdapter

__all__ = ["DeepSpeedAdapter", "is_deepspeed_engine"]


def is_deepspeed_engine(obj: object) -> bool:
    """True for a ``deepspeed.DeepSpeedEngine`` (checked by MRO name, no import)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(obj).__mro__)


class DeepSpeedAdapter(EngineAdapter, engine="deepspeed"):
    """Adapter for a ``deepspeed.initialize`` engine."""

    @classmethod
    def matches(cls, engine: object) -> bool:
        return is_deepspeed_engine(engine)

    def __init__(self, engine) -> None:
        self.engine = engine

    def unwrap(self) -> nn.Module:
        return self.engine.module

    def parallel_context(self) -> ParallelContext:
        import deepspeed.comm as ds_dist

        eng = self.engine
        group = getattr(eng, "data_parallel_group", None)
        rank = ds_dist.get_rank(group=group) if ds_dist.is_initialized() else 0
        world = ds_dist.get_world_size(group=group) if ds_dist.is_initialized() else 1
        return ParallelContext(dp_rank=rank, dp_world=world, dp_group=group)

    def loss_scale(self) -> float:
        """Current (possibly dynamic) loss scale; 1 for fp32/bf16 optimizers."""
        opt = self.engine.optimizer
        if getattr(opt, "external_loss_scale", None) is not None:
            return float(opt.external_loss_scale)
        scaler = getattr(opt, "loss_scaler", None)
        if scaler is not None:
            return float(getattr(scaler, "cur_scale", getattr(scaler, "loss_scale", 1.0)))
        return 1.0

    def backward_scale(self) -> float:
        return self.loss_scale() / self.engine.gradient_accumulation_steps()

    def global_step(self) -> int:
        return int(self.engine.global_steps)

    def on_step(self, fn: Callable[[], None]) -> Callable[[], None]:
        eng = self.engine
        original = eng.step  # bound method of the class

        def step(*args, **kwargs):
            boundary = eng.is_gradient_accumulation_boundary()
            out = original(*args, **kwargs)
            if boundary:
                fn()
            return out

        eng.step = step

        def remove() -> None:
            if eng.__dict__.get("step") is step:
                del eng.step
        return remove
