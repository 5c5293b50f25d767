"""The plan of one fixed run: per-rank memory terms and times (docs/planning.md: every
term's formula).

Times come from the cost model's roofline (``dattri_ds.ops.cost``); a layer's projection
terms (kind, width, matrix bytes, cost op) from its ``ProjectionKind``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dattri_ds.layers import LayerDims
from dattri_ds.ops.cost import CostModel
from dattri_ds.ops.kronecker import METHODS, KFACConfig
from dattri_ds.ops.projection import (
    AutoKind, ProjectionKind, choose_projection, kron_dims, projection_kind,
)
from dattri_ds.plan.devices import GB, DeviceSpec
from dattri_ds.plan.shapes import LayerShape, ModelShape
from dattri_ds.plan.spec import RunSpec


_OPT_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "sgd_momentum": 4}
_STORE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: How the report names a selection run's scoring pass (``RunSpec.probes``).
_MODE = {True: " (gradient probe of the candidates)", False: " (content score: no probe)"}
_K_LADDER = (64, 256, 1024, 4096)


@dataclass(frozen=True)
class Plan:
    """The prediction: memory terms (bytes per rank), times, routing and advice.

    Attributes:
        memory: term -> bytes on each rank's device. host: term -> bytes offloaded to the
            host per rank. total: sum of ``memory``. fits: ``total`` (times the ranks
            sharing it) fits the device memory. times: term -> seconds per training step
            (``step``) or per collected example. routing: layer -> ``ghost``/``dense`` for
            the projection. advice: recommendations, one sentence each.
    """

    model: ModelShape
    device: DeviceSpec
    spec: RunSpec
    memory: dict[str, float]
    host: dict[str, float]
    times: dict[str, float]
    routing: dict[str, str]
    store_bytes: float
    advice: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.memory.values())

    #: Peak bytes per rank: the sum of the terms (each is live at the step's peak).
    peak = total

    @property
    def fits(self) -> bool:
        ranks = self.spec.world if self.device.ranks_share_memory else 1
        return self.peak * ranks <= 0.95 * self.device.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"model": asdict(self.model), "params": self.model.num_params,
                "device": asdict(self.device), "spec": asdict(self.spec),
                "memory_bytes": self.memory, "host_bytes": self.host,
                "total_bytes": self.total, "fits": self.fits, "seconds": self.times,
                "routing": self.routing, "store_bytes": self.store_bytes,
                "advice": self.advice}

    def table(self) -> str:
        """A readable report: the memory terms, the times and the advice."""
        m, s = self.model, self.spec
        lines = [f"model: {m.label} {m.layers}x{m.hidden} (i {m.intermediate}, heads "
                 f"{m.heads}/{m.kv_heads}, vocab {m.vocab}), {m.num_params / 1e9:.3f} B params",
                 f"run: {s.world} x {self.device.name}, ZeRO-{s.zero_stage}, offload "
                 f"{s.offload}, {s.dtype}, "
                 f"{s.optimizer if s.train else 'no optimizer (collect)'}, T={s.seq_len}, "
                 f"micro-batch {s.micro_batch}, {s.method}"
                 f"{_MODE[s.probes] if s.method == 'selection' else ''}, "
                 f"{s.projection} k={s.k} per layer",
                 "", f"{'memory per rank':<22}{'GB':>10}"]
        lines += [f"  {k:<20}{v / GB:>10.3f}" for k, v in self.memory.items()]
        lines.append(f"  {'total':<20}{self.total / GB:>10.3f}   (device "
                     f"{self.device.memory_bytes / GB:.0f} GB"
                     f"{', shared by all ranks' if self.device.ranks_share_memory else ''}"
                     f": {'fits' if self.fits else 'DOES NOT FIT'})")
        if self.host:
            lines += [f"  host: {k:<14}{v / GB:>10.3f}" for k, v in self.host.items()]
        lines.append(f"  store on disk: {self.store_bytes / GB:.3f} GB for {s.examples} "
                     f"examples ({s.store_dtype})")
        lines += ["", f"{'time':<22}{'seconds':>12}"]
        lines += [f"  {k:<20}{v:>12.4g}" for k, v in self.times.items()]
        paths = sorted(set(self.routing.values()))
        lines += ["", "projection path per layer: " + ", ".join(
            f"{p}: {sum(v == p for v in self.routing.values())} kinds" for p in paths)]
        lines += [f"  {k}: {v}" for k, v in self.routing.items()]
        lines += ["", "advice:"] + [f"  - {a}" for a in self.advice]
        return "\n".join(lines)


def _states(m: ModelShape, s: RunSpec) -> tuple[dict[str, float], dict[str, float]]:
    """Parameter, master, gradient and optimizer bytes per rank: (on device, offloaded)."""
    P, e, R = m.num_params, s.weight_bytes, s.world
    shard = lambda stage: R if s.zero_stage >= stage else 1  # noqa: E731
    mixed = s.dtype != "float32"
    terms = {"params": P * e / shard(3),
             "master": 4 * P / shard(1) if mixed and s.train else 0.0,
             "grads": P * e / shard(2) if s.train else 0.0,
             "optimizer": _OPT_BYTES[s.optimizer] * P / shard(1) if s.train else 0.0}
    moved = {"optimizer": ("master", "optimizer"),
             "all": ("master", "optimizer", "params")}.get(s.offload, ())
    host = {k: terms.pop(k) for k in moved}
    if s.offload != "none" and mixed and s.train:  # the fp32 gradient copy the CPU optimizer reads
        host["grads_fp32"] = 4 * P / shard(2)
    return terms, host


def _zero_buffers(m: ModelShape, s: RunSpec, dev: DeviceSpec) -> dict[str, float]:
    """DeepSpeed's working memory: gathered parameters, the gradient bucket, the whole
    model each rank builds before partitioning (without ``zero_init``: glibc keeps the
    freed sub-32 MB blocks resident) and the optimizer step's per-sub-group temporaries."""
    P, e = m.num_params, s.weight_bytes
    sharded = s.zero_stage >= 3 and s.world > 1
    out = {"gathered": min(P, s.max_live_params + s.prefetch_bucket) * e if sharded else 0.0,
           "grad_bucket": min(P, s.reduce_bucket) * e if s.train and s.zero_stage >= 2
           else 0.0,
           "init_model": 0.0 if s.zero_init else P * 4.0}
    # The step runs per sub-group of the partition: ZeRO-3 flattens its gradients into a
    # new fp32 tensor, and torch's Adam(W) on CPU tensors (no fused kernel) makes two more.
    group = 4 * min(s.sub_group_size, P / (s.world if s.zero_stage >= 1 else 1))
    copies = (1 if s.zero_stage >= 3 else 0) + (2 if s.optimizer.startswith("adam") and
                                                s.offload == "none" and dev.name == "cpu"
                                                else 0)
    out["optimizer_tmp"] = copies * group if s.train and s.offload == "none" else 0.0
    return out


def _projection(L: LayerShape, s: RunSpec) -> ProjectionKind | None:
    """The projection kind layer ``L`` gets at ``s.k``; None when it is kept exactly
    (``O*I' <= k``, or no projection). ``auto`` resolves per layer (``choose_projection``);
    a kind without factors (``dense_only``) takes the projector's matrix instead of a
    factorized kind (as ``KroneckerKind.project`` does): sparse under ``auto``, else dense."""
    if not s.k or L.O * L.I <= s.k:
        return None
    kind = projection_kind(s.projection)
    auto = isinstance(kind, AutoKind)
    if L.kind.dense_only and (auto or kind.factorized):
        return projection_kind("sparse" if auto else "dense")
    return projection_kind(choose_projection(L.O, L.I, s.k).kind) if auto else kind


def captured_factor_bytes(m: ModelShape, s: RunSpec, rows: int) -> dict[str, float]:
    """Bytes of one captured batch of ``rows`` examples, as ``GradBatch`` holds them
    (``LayerKind.capture_bytes`` of every captured layer): ``inputs``, ``grads`` and
    ``dense``."""
    out = {"inputs": 0.0, "grads": 0.0, "dense": 0.0}
    for L in m.captured_layers():
        tokens = s.seq_len * L.token_factor
        for key, n in L.kind.capture_bytes(rows, tokens, L.shape, s.weight_bytes).items():
            out[key] += n * L.count
    return out


def _fit_space(L: LayerShape, s: RunSpec) -> tuple[tuple[int, int], bool]:
    """``(dims, side_projected)`` of the space a curvature fit holds layer ``L``'s factors in
    (``KFACFactors._layout``): ``(ko, ki)`` when Kronecker projected (LoGra), a dense-only
    kind's projected rows ``(1, width)``, else its shape (a factorized layer under a
    non-Kronecker projection is fitted on its exact factors, as ``tools/fit.py`` does)."""
    kind = _projection(L, s)
    if kind is None:
        return L.shape, False
    if L.kind.dense_only:
        return (1, kind.width(s.k, L.O, L.I)), False
    if kind.factorized:
        return kron_dims(s.k, L.O, L.I), True
    return L.shape, False


def _capture_terms(m: ModelShape, s: RunSpec, rows: int) -> dict[str, float]:
    """Memory capture adds: output-grads and dense rows of ``rows`` examples (the inputs
    ``a`` are the tensors autograd saves anyway, counted in ``activations``), projection
    matrices of every projected layer (``ProjectionKind.matrix_bytes``; the process keeps at
    most ``projection_cache_bytes`` of them plus the one block made for its use,
    ``block_bytes``) and K-FAC factors (``LayerKind.factor_bytes`` in the fit's space)."""
    f = captured_factor_bytes(m, s, rows)
    proj, block, kfac = 0.0, 0.0, 0.0
    curvature = s.method in METHODS  # the K-FAC / EK-FAC eigenvalue methods
    kfac_cfg = KFACConfig()
    for L in m.captured_layers():
        kind = _projection(L, s)
        if kind is not None:
            proj += kind.matrix_bytes(s.k, L.O, L.I) * L.count
            block = max(block, kind.block_bytes(s.k, L.O, L.I))
        if curvature:
            dims, side = _fit_space(L, s)
            kfac += L.kind.factor_bytes(dims, kfac_cfg.full_max, side,
                                        getattr(torch, kfac_cfg.dtype)) * L.count
    if proj > s.projection_cache_bytes:
        proj = min(proj, s.projection_cache_bytes + block)
    return {"factors": f["grads"] + f["dense"], "projections": proj, "kfac": kfac}


def _width(m: ModelShape, s: RunSpec) -> int:
    """Stored elements per example: ``ProjectionKind.width`` of each layer's kind (``ko * ki``
    for Kronecker, k for dense and sparse), ``O*I'`` for a layer kept exactly."""
    total = 0
    for L in m.captured_layers():
        kind = _projection(L, s)
        total += L.count * (L.I * L.O if kind is None else kind.width(s.k, L.O, L.I))
    return total


def _routing(m: ModelShape, s: RunSpec, dev: DeviceSpec, rows: int) -> tuple[dict, float]:
    """Ghost or dense per projected layer (the cost model's choice on
    ``ProjectionKind.cost_op``; a dense-only kind's rows take the dense path), and its
    seconds per batch."""
    cm, routes, secs = CostModel(dev.roofline), {}, 0.0
    for L in m.captured_layers():
        kind = _projection(L, s)
        if kind is None:
            continue
        # a dense-only kind's rows exist already: the op's dense path with one token
        dense = L.kind.dense_only
        dims = LayerDims(rows, 1 if dense else s.seq_len * L.token_factor, L.I, L.O,
                         index_input=L.kind.index_input,
                         itemsize=4 if dense else s.weight_bytes)
        op, sizes = kind.cost_op(s.k, L.O, L.I)
        d = cm.choose(op, L.name, dims, path="dense" if dense else None, **sizes)
        routes[L.name] = d.path
        secs += d.seconds[d.path] * L.count
    return routes, secs


def _times(m: ModelShape, s: RunSpec, dev: DeviceSpec, proj_s: float,
           cand_proj_s: float) -> dict[str, float]:
    """Seconds of each part of a step (docs/planning.md, *The terms*).

    Device time of a forward: ``fwd = (F / peak + P e / bw) / efficiency``; host time:
    ``h = forward_kernels x kernel_latency_s``. A training pass (no host sync) takes
    ``max(3 h + z, 3 fwd)`` with ``z = param_tensors x zero3_tensor_s`` under ZeRO-3; a
    capturing or probing pass syncs per layer, so its host and device times add:
    ``2 h + 2/3 z + n_captured x capture_layer_s + 2 fwd + projection``.
    """
    B, T = s.micro_batch, s.seq_len
    e = s.weight_bytes
    fwd = (m.forward_flops(B, T) / dev.flops_per_s + m.num_params * e / dev.bytes_per_s) \
        / dev.efficiency
    host = m.forward_kernels() * dev.kernel_latency_s
    zero3 = m.param_tensors * dev.zero3_tensor_s if s.zero_stage >= 3 else 0.0
    hooks = sum(L.count for L in m.captured_layers()) * dev.capture_layer_s
    # ZeRO-3: all-gather (fwd, bwd) + reduce-scatter; else an all-reduce
    comm = (3 if s.zero_stage >= 3 else 2) * m.num_params * e * (s.world - 1) / s.world \
        / dev.link_bytes_per_s
    t = {"forward": fwd, "host_forward": host, "zero_comm": comm,
         "capture": proj_s + hooks if s.capture else 0.0}
    probe = 2 * host + zero3 * 2 / 3 + hooks  # host side of a probe pass (serialized)
    t["collect_per_example"] = (probe + 2 * fwd + comm * 2 / 3 + proj_s) / B
    if not s.train:  # probe passes only: forward + input-grad backward, no reduce-scatter
        return t
    shard = m.num_params / (s.world if s.zero_stage >= 3 else 1)
    moved = {"none": 0.0, "optimizer": 2 * shard * e,  # gradients out, new weights back
             "all": 4 * shard * e}  # + the parameter shard fetched for forward and backward
    t["offload"] = moved[s.offload] / dev.host_link_bytes_per_s
    t["train_step"] = max(3 * fwd, 3 * host + zero3) + comm + t["offload"]
    if s.probes:  # probe: forward + input-grad backward on the candidates
        c = s.candidate_multiple
        t["selection"] = probe + c * 2 * fwd + cand_proj_s
    t["step"] = t["train_step"] + t["capture"] + t.get("selection", 0.0)
    t["per_trained_example"] = t["step"] / B
    return t


def _plan_fixed(model: ModelShape, dev: DeviceSpec, spec: RunSpec) -> Plan:
    B = spec.micro_batch
    states, host = _states(model, spec)
    rows = int(math.ceil(B * (spec.candidate_multiple if spec.probes else 1)))
    memory = dict(states)
    memory.update(_zero_buffers(model, spec, dev))
    memory["activations"] = model.activation_elems(rows, spec.seq_len) * spec.weight_bytes
    cap = _capture_terms(model, spec, rows) if (spec.capture or spec.probes) \
        else {"factors": 0.0, "projections": 0.0, "kfac": 0.0}
    memory.update(cap)
    memory["runtime"] = dev.runtime_bytes
    routes, proj_s = _routing(model, spec, dev, B)
    _, cand_s = _routing(model, spec, dev, rows) if spec.probes else ({}, 0.0)
    times = _times(model, spec, dev, proj_s, cand_s)
    store = spec.examples * _width(model, spec) * _STORE_BYTES[spec.store_dtype] \
        if spec.k else 0.0
    return Plan(model, dev, spec, memory, host, times, routes, store)
