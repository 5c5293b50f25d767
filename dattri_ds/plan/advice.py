"""``plan``: a run's plan with recommendations (projection size, path per layer, what fits)."""

from __future__ import annotations

from dataclasses import replace

from dattri_ds.plan.devices import GB, DeviceSpec, device
from dattri_ds.plan.estimate import (
    _K_LADDER, _STORE_BYTES, Plan, _plan_fixed, _projection, _routing, _times, _width,
)
from dattri_ds.plan.shapes import ModelShape
from dattri_ds.plan.spec import RunSpec


def plan(model: ModelShape, dev: DeviceSpec | str, spec: RunSpec) -> Plan:
    """Predict memory and time of ``spec`` on ``model`` and ``dev``; recommend settings.

    ``spec.k = 0`` picks the largest k in (64, 256, 1024, 4096) whose projection costs at
    most 10% of a training step (of a collect pass when not training) and whose store of
    ``spec.examples`` rows fits ``spec.store_budget_gb``. When the total does not fit,
    more offload (optimizer, then all) and then halved micro-batches are tried, and the
    first that fits is recommended.
    """
    dev = device(dev) if isinstance(dev, str) else dev
    advice: list[str] = []
    if spec.k == 0:
        k = _K_LADDER[0]
        for cand in _K_LADDER:
            trial = replace(spec, k=cand)
            _, ps = _routing(model, trial, dev, spec.micro_batch)
            base = _times(model, trial, dev, 0.0, 0.0)
            work = base["train_step"] if spec.train else base["collect_per_example"] * \
                spec.micro_batch
            store = spec.examples * _width(model, trial) * _STORE_BYTES[spec.store_dtype]
            if ps <= 0.1 * work and store <= spec.store_budget_gb * GB:
                k = cand
        spec = replace(spec, k=k)
        advice.append(f"projection k={k} per layer: the largest of {_K_LADDER} whose "
                      f"projection costs <= 10% of the pass and whose store of "
                      f"{spec.examples} examples fits {spec.store_budget_gb:g} GB")
    result = _plan_fixed(model, dev, spec)
    if not result.fits:
        advice.append(_fit_advice(model, dev, spec, result))
    ghost = [n for n, p in result.routing.items() if p == "ghost"]
    dense = [n for n, p in result.routing.items() if p == "dense"]
    advice.append(f"projection path: ghost (factorized) for {ghost or 'no layer'}; dense "
                  f"(materialized) for {dense or 'no layer'}")
    if spec.k:
        advice.append(_kind_advice(model, spec))
    if spec.dtype == "bfloat16" and dev.name == "cpu":
        advice.append("bf16 matmuls run ~100x slower than fp32 on CPUs without AVX-512 BF16:"
                      " prefer float32 weights on CPU")
    return replace(result, advice=advice + result.advice)


def _kind_advice(model: ModelShape, spec: RunSpec) -> str:
    """Which projection kind each layer gets at ``spec.k`` and its expected relative error
    of an inner product (``ProjectionKind.error``; 0 for layers kept exactly)."""
    parts = []
    for L in model.captured_layers():
        kind = _projection(L, spec)
        err = 0.0 if kind is None else kind.error(spec.k, L.O, L.I)
        parts.append(f"{L.name} {kind.name if kind else 'identity'} (error ~{err:.2f})")
    return f"projection kind per layer ({spec.projection}, k={spec.k}): " + ", ".join(parts)


def _fit_advice(model: ModelShape, dev: DeviceSpec, spec: RunSpec, result: Plan) -> str:
    """The first change that fits: more offload, then a smaller micro-batch (with offload)."""
    order = ("none", "optimizer", "all")
    offloads = [o for o in order[order.index(spec.offload):]
                if spec.train and (o != "all" or spec.zero_stage == 3)] or [spec.offload]
    batches = [spec.micro_batch]
    while batches[-1] > 1:
        batches.append(batches[-1] // 2)
    for mb in batches:
        for off in offloads:
            trial = _plan_fixed(model, dev, replace(spec, offload=off, micro_batch=mb))
            if trial.fits and (off, mb) != (spec.offload, spec.micro_batch):
                return (f"does not fit ({result.peak / GB:.1f} GB per rank): offload '{off}' "
                        f"with micro-batch {mb} needs {trial.peak / GB:.1f} GB")
    return (f"does not fit ({result.peak / GB:.1f} GB per rank) even with full offload and "
            f"micro-batch 1: add ranks, shorten sequences or checkpoint activations")
