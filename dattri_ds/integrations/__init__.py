"""Engine adapters, one file per engine; heavy frameworks are imported lazily by each.

Importing this package registers the adapters of wrapping engines (DeepSpeed) with
``dattri_ds.capture.engine.ENGINES``; ``import dattri_ds`` does it.
"""

from dattri_ds.integrations.deepspeed import DeepSpeedAdapter

__all__ = ["DeepSpeedAdapter"]
