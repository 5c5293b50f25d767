"""Megatron-core adapter: ``prepare_model`` (marks the modules a batch-first kind would
misread), ``MegatronAdapter`` (data- and tensor-parallel groups from parallel_state) and
``megatron_capture``. The loop owns backward and the optimizer: call ``adapter.step_done()``
after every optimizer step; use ``CaptureConfig(label_shift=0)`` (Megatron's labels are
shifted). Details and what is refused: docs/integrations.md. Megatron is imported inside
functions only."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from dattri_ds.capture.callbacks import TrainingCallback
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import ConfigError
from dattri_ds.capture.engine import SteppedAdapter
from dattri_ds.layers import kind_for
from dattri_ds.layers.megatron import SEQUENCE_FIRST_ATTR, UNSUPPORTED_ATTR

__all__ = ["MegatronAdapter", "prepare_model", "megatron_capture", "megatron_parallel_context"]

_SEQUENCE_FIRST_SCOPES = ("TransformerBlock", "TransformerLayer", "MultiTokenPredictionBlock")
_BATCH_FIRST_KINDS = ("linear", "conv1d", "embedding")


def _unwrap(model: nn.Module) -> nn.Module:
    """Strip Megatron DDP / Float16Module wrappers (their ``module`` attribute)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _in_scope(module: nn.Module) -> bool:
    return any(c.__name__ in _SEQUENCE_FIRST_SCOPES and c.__module__.startswith("megatron.")
               for c in type(module).__mro__)


def _check_pipeline() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        raise ConfigError(
            f"Pipeline parallelism (pipeline_model_parallel_size="
            f"{ps.get_pipeline_model_parallel_world_size()}) is not supported by dattri-ds: "
            f"per-example losses live on the last stage only. Use tensor and data parallelism")


def prepare_model(model: nn.Module) -> nn.Module:
    """Mark a Megatron model's sequence-first norms (and misplaced batch-first layers).

    Idempotent; returns the unwrapped model. Must run before a GradientCapture attaches
    (``megatron_capture`` and ``MegatronAdapter`` call it).

    Raises:
        ConfigError: pipeline parallelism is enabled.
    """
    _check_pipeline()
    model = _unwrap(model)
    for scope in (m for m in model.modules() if _in_scope(m)):
        config = getattr(scope, "config", None)
        sp = bool(getattr(config, "sequence_parallel", False))
        group, world = None, 1
        if sp:
            from megatron.core import parallel_state as ps

            group = ps.get_tensor_model_parallel_group()
            world = group.size()
        for sub in scope.modules():
            kind = kind_for(sub)
            if kind is None:
                continue
            if kind.name in ("layernorm", "rmsnorm", "megatron_norm"):
                setattr(sub, SEQUENCE_FIRST_ATTR, (group, world))
            elif kind.name in _BATCH_FIRST_KINDS:
                setattr(sub, UNSUPPORTED_ATTR,
                        f"a batch-first {type(sub).__name__} inside a sequence-first Megatron "
                        f"decoder ([S, B, H] activations)")
    return model


def megatron_parallel_context() -> ParallelContext:
    """Data- and tensor-parallel groups of this rank from ``megatron.core.parallel_state``."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return ParallelContext.from_default_group()
    dp, tp = ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()
    return ParallelContext(dp_rank=dp.rank(), dp_world=dp.size(), dp_group=dp,
                           tp_rank=tp.rank(), tp_world=tp.size(), tp_group=tp)


class MegatronAdapter(SteppedAdapter):
    """A Megatron-core model driven by the user's own loop (Megatron's own or a torch one).

    Args:
        model: the model (or a Megatron DDP / Float16Module wrapping it); prepared here.
        backward_scale: the factor the loop multiplies its reduced loss by before backward
            (e.g. ``1 / num_microbatches``), or a callable read at backward time.
        start_step: optimizer steps already done (a resumed run).
    """

    def __init__(self, model: nn.Module, backward_scale: float | Callable[[], float] = 1.0,
                 start_step: int = 0) -> None:
        super().__init__(start_step)
        self.model = model
        self._inner = prepare_model(model)
        self._scale = backward_scale

    def unwrap(self) -> nn.Module:
        return self._inner

    def parallel_context(self) -> ParallelContext:
        return megatron_parallel_context()

    def backward_scale(self) -> float:
        return float(self._scale() if callable(self._scale) else self._scale)



def megatron_capture(model: nn.Module, config: CaptureConfig | None = None, *,
                     callbacks: Iterable[TrainingCallback] = (),
                     adapter: MegatronAdapter | None = None, **kwargs):
    """A GradientCapture on a prepared Megatron model, with steps and scale from the adapter.

    ``kwargs`` go to GradientCapture (``cost``, ``probe_only``). Attach it with ``with`` or
    ``attach()``; ``cap.adapter.step_done()`` marks optimizer steps.
    """
    from dattri_ds.capture.hooks import GradientCapture

    adapter = adapter or MegatronAdapter(model)
    cap = GradientCapture(adapter.unwrap(), config, callbacks=callbacks,
                          scale_fn=adapter.backward_scale, step_fn=adapter.global_step, **kwargs)
    cap.adapter = adapter
    return cap
