"""Engine adapters; heavy frameworks are imported lazily by each adapter."""

from __future__ import annotations

from torch import nn

from dattri_ds.errors import UnsupportedEngineError
from dattri_ds.integrations.base import EngineAdapter, PlainAdapter

__all__ = ["EngineAdapter", "PlainAdapter", "adapter_for"]


def adapter_for(engine: object, optimizer=None) -> EngineAdapter:
    """The adapter for a DeepSpeed engine, or a PlainAdapter for any nn.Module (whose
    ``optimizer``, if given, marks the optimizer steps)."""
    from dattri_ds.integrations.deepspeed import DeepSpeedAdapter, is_deepspeed_engine

    if is_deepspeed_engine(engine):
        return DeepSpeedAdapter(engine)
    if isinstance(engine, nn.Module):
        return PlainAdapter(engine, optimizer)
    raise UnsupportedEngineError(f"No dattri-ds adapter for {type(engine).__name__}: pass an "
                                 f"nn.Module or a DeepSpeedEngine")
