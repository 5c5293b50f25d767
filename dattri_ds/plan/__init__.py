"""Planner: per-rank memory and time of a capture / attribution run, before running it.

From a model's shape (``ModelShape.from_config``: our JSON or a Hugging Face ``config.json``
of the Llama, Qwen2/3, Mistral, OLMo-2 or GPT-2 families; shapes.py), a device (``DEVICES``;
devices.py) and a run (``RunSpec``; spec.py), ``plan`` (advice.py) predicts each rank's
memory, term by term, and the time of a training step and of one collected example from the
cost model's roofline (estimate.py), then recommends settings. guard.py refuses at start a
run that cannot fit this machine; traffic.py counts the inter-node bytes capture and
selection add. docs/planning.md gives every term's formula.
"""

from dattri_ds.plan.advice import plan
from dattri_ds.plan.devices import DEVICES, GB, DeviceSpec, available_memory, device
from dattri_ds.plan.estimate import Plan, captured_factor_bytes
from dattri_ds.plan.guard import Knob, check_fits, check_tool
from dattri_ds.plan.shapes import KERNELS_PER_BLOCK, LayerShape, ModelShape
from dattri_ds.plan.spec import RunSpec

__all__ = ["DeviceSpec", "DEVICES", "GB", "ModelShape", "LayerShape", "RunSpec", "Plan", "plan",
           "device", "captured_factor_bytes", "available_memory", "Knob", "check_fits",
           "check_tool", "KERNELS_PER_BLOCK"]
