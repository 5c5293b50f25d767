"""Planner: per-rank memory and time of a capture / attribution run, before running it.

From a model's shape (``ModelShape.from_config``: our JSON or a Hugging Face ``config.json``
of the Llama, Qwen2/3, Mistral, OLMo-2 or GPT-2 families), a device (``DEVICES``) and a run
(``RunSpec``), ``plan`` predicts each rank's memory, term by term, and the time of a
training step and of one collected example from the cost model's roofline
(``dattri_ds.ops.cost``), then recommends settings. docs/planning.md gives every term's
formula. A captured layer's own terms (its captured bytes, forward multiply-adds, K-FAC
factor bytes) come from its ``LayerKind``, and its projection's (kind, width, matrix bytes,
cost op, error) from its ``ProjectionKind``: a new kind plans without a change here. The
H200's host terms are fitted to measured steps (``python -m dattri_ds.calibrate``,
docs/gpu.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from dattri_ds import schema
from dattri_ds.errors import ConfigError
from dattri_ds.layers import LayerDims, LayerKind, get_kind
from dattri_ds.ops.cost import CostModel, Roofline
from dattri_ds.ops.kronecker import KFACConfig
from dattri_ds.ops.projection import (
    KINDS, PROJECTION_KINDS, AutoKind, ProjectionConfig, ProjectionKind, choose_projection,
    kron_dims, projection_kind,
)

__all__ = ["DeviceSpec", "DEVICES", "ModelShape", "LayerShape", "RunSpec", "Plan", "plan",
           "device", "captured_factor_bytes"]

GB = 1e9
_LINEAR, _CONV1D, _EMBEDDING = get_kind("linear"), get_kind("conv1d"), get_kind("embedding")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or a CPU host) as the planner sees it.

    Attributes:
        name: registry key.
        memory_bytes: memory of one device (a CPU host's RAM, shared by its ranks).
        flops_per_s: dense matmul rate in the run's compute dtype (bf16 on GPUs; the CPU
            figure is fp32, one core: bf16 matmuls are ~100x slower on CPUs without
            AVX-512 BF16).
        bytes_per_s: memory bandwidth.
        link_bytes_per_s: per-rank bandwidth of the collectives (NVLink; loopback gloo).
        runtime_bytes: resident size of the framework itself (CUDA context / interpreter,
            torch, DeepSpeed, transformers) per rank.
        ranks_share_memory: every rank lives in the same memory (CPU ranks on one host).
        efficiency: the fraction of the roofline a whole step reaches (CPU: measured on
            ``benchmarks/scale.py``'s ladder; H200: fitted by ``dattri_ds.calibrate``).
        host_link_bytes_per_s: device <-> host bandwidth that offloaded state crosses
            every step (PCIe 5 x16: ~50 GB/s sustained; PCIe 4: ~25 GB/s; CPU: none).
        kernel_latency_s: host time to issue one kernel in eager mode; a pass without host
            syncs takes ``max(host, device)`` (CPU: 0, its kernels run on the host).
        capture_layer_s: host time capture adds per captured layer per pass (a capturing
            pass is serialized, ``host + device``).
        zero3_tensor_s: host time ZeRO-3 adds per parameter tensor per step.
    """

    name: str
    memory_bytes: float
    flops_per_s: float
    bytes_per_s: float
    link_bytes_per_s: float
    runtime_bytes: float
    ranks_share_memory: bool = False
    efficiency: float = 0.5
    host_link_bytes_per_s: float = float("inf")
    kernel_latency_s: float = 0.0
    capture_layer_s: float = 0.0
    zero3_tensor_s: float = 0.0

    @property
    def roofline(self) -> Roofline:
        return Roofline(flops_per_s=self.flops_per_s, bytes_per_s=self.bytes_per_s)


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GB


#: The H200's fitted terms (``dattri_ds.calibrate.fit`` on ``calibrate.RECORDED``, the
#: first H200 run at 0eb5305: throughput ladder 0.5B/1.5B/7B and the 1B ZeRO-3 launch step;
#: ``python -m dattri_ds.calibrate`` refits and prints them with each point's error). The
#: H100 and A100 keep the roofline with the H200's host terms (same hosts, not measured).
H200_CALIBRATED = {"efficiency": 0.59, "kernel_latency_s": 20.7e-6,
                   "capture_layer_s": 290e-6, "zero3_tensor_s": 2.24e-3}

_H200 = DeviceSpec(name="h200", memory_bytes=141 * GB, flops_per_s=989e12, bytes_per_s=4.8e12,
                   link_bytes_per_s=450 * GB, runtime_bytes=1.5 * GB,
                   host_link_bytes_per_s=50 * GB, **H200_CALIBRATED)
#: name -> DeviceSpec. GPU figures are the vendors' dense bf16 peaks and HBM bandwidths
#: (H200 SXM: 141 GB, 989 TFLOPS, 4.8 TB/s; H100 SXM: 80 GB, 989 TFLOPS, 3.35 TB/s; A100 SXM
#: 80 GB: 312 TFLOPS, 2.04 TB/s); NVLink per direction 450 / 450 / 300 GB/s.
DEVICES: dict[str, DeviceSpec] = {
    "cpu": DeviceSpec(name="cpu", memory_bytes=_host_memory(), flops_per_s=8e10,
                      bytes_per_s=1e10, link_bytes_per_s=1e9, runtime_bytes=0.45 * GB,
                      ranks_share_memory=True, efficiency=0.4),
    "h200": _H200,
    "h100": replace(_H200, name="h100", memory_bytes=80 * GB, bytes_per_s=3.35e12),
    "a100": replace(_H200, name="a100", memory_bytes=80 * GB, flops_per_s=312e12,
                    bytes_per_s=2.04e12, link_bytes_per_s=300 * GB, host_link_bytes_per_s=25 * GB),
}


def device(name: str) -> DeviceSpec:
    """The registered device ``name`` (case-insensitive)."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ConfigError(f"Unknown device '{name}'; known: {sorted(DEVICES)} (add a "
                          f"DeviceSpec to dattri_ds.plan.DEVICES)") from None


@dataclass(frozen=True)
class LayerShape:
    """``count`` captured layers of one ``LayerKind`` whose gradient is ``[O, I']`` (the
    kind's canonical ``layer_shape``: ``I`` counts a bias column; a norm's ``O`` is its
    ``1 + bias`` rows). ``token_factor`` 2 marks a tied head: capture merges the
    embedding's use into the output projection's factors as ``2 T`` tokens
    (``dattri_ds.tied``), and no separate embedding layer is captured. ``bias``: the layer
    has a bias tensor.
    """

    name: str
    kind: LayerKind
    I: int  # noqa: E741 - the documented shape letter
    O: int  # noqa: E741
    count: int = 1
    token_factor: int = 1
    bias: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LayerKind):
            raise TypeError(f"LayerShape '{self.name}': kind must be a LayerKind, got "
                            f"{self.kind!r} (pass get_kind({self.kind!r}))")

    @property
    def shape(self) -> tuple[int, int]:
        return self.O, self.I

    @property
    def params(self) -> int:
        return self.count * self.I * self.O


#: model_type -> layer layout the planner models (OLMo-2 adds q/k RMSNorms to Llama's).
_FAMILIES = {"llama": "llama", "qwen2": "llama", "qwen3": "llama", "mistral": "llama",
             "olmo2": "llama", "gpt2": "gpt2"}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a decoder-only transformer the planner needs.

    Attributes:
        family: layer layout, ``llama`` (also Qwen2/3, Mistral, OLMo-2) or ``gpt2``.
        model_type: the config's own ``model_type`` (what reports name; ``family`` when
        empty). qk_norm: RMSNorms on the q and k projections (OLMo-2). layers: blocks. hidden: h.
        heads / kv_heads / head_dim: attention shapes. intermediate: MLP width i.
        vocab: V. tied: input and output embeddings share one matrix.
        qkv_bias: q/k/v projections carry a bias (Qwen2). positions: learned position
        embeddings (GPT-2).
    """

    family: Literal["llama", "gpt2"]
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    positions: int = 0
    model_type: str = ""
    qk_norm: bool = False

    @property
    def label(self) -> str:
        """The model type reports name (``qwen2``, not its layout ``llama``)."""
        return self.model_type or self.family

    @staticmethod
    def from_config(config: str | os.PathLike | Mapping[str, Any],
                    vocab_size: int | None = None) -> ModelShape:
        """From our JSON model config or a Hugging Face ``config.json`` (file or mapping).

        Our configs leave the vocabulary to the tokenizer: pass ``vocab_size`` then.
        """
        from dattri_ds.files import read_json
        d = dict(config) if isinstance(config, Mapping) else \
            read_json(config, "model config", flag="--model")
        mt = d.get("model_type")
        if mt not in _FAMILIES:
            raise ConfigError(f"model_type {mt!r} is not planned; supported: "
                              f"{sorted(_FAMILIES)}")
        fam = _FAMILIES[mt]
        vocab = vocab_size or d.get("vocab_size")
        if not vocab:
            raise ConfigError("The model config has no vocab_size (ours take it from the "
                              "tokenizer): pass vocab_size= / --vocab-size")
        if fam == "gpt2":
            h, n = d.get("n_embd", 768), d.get("n_head", 12)
            return ModelShape(family="gpt2", layers=d.get("n_layer", 12), hidden=h, heads=n,
                              kv_heads=n, head_dim=h // n, intermediate=d.get("n_inner") or 4 * h,
                              vocab=int(vocab), tied=d.get("tie_word_embeddings", True),
                              qkv_bias=True, positions=d.get("n_positions", 1024),
                              model_type=mt)
        h, n = d["hidden_size"], d["num_attention_heads"]
        return ModelShape(family="llama", layers=d["num_hidden_layers"], hidden=h, heads=n,
                          kv_heads=d.get("num_key_value_heads") or n,
                          head_dim=d.get("head_dim") or h // n,
                          intermediate=d["intermediate_size"], vocab=int(vocab),
                          tied=bool(d.get("tie_word_embeddings", False)),
                          qkv_bias=mt == "qwen2" or bool(d.get("attention_bias", False)),
                          model_type=mt, qk_norm=mt == "olmo2")

    def block(self) -> list[LayerShape]:
        """The layers of one transformer block (``count`` 1 each)."""
        h, i = self.hidden, self.intermediate
        if self.family == "gpt2":  # Conv1D layers with bias, LayerNorms with bias
            return [LayerShape("attn.c_attn", _CONV1D, h + 1, 3 * h, bias=True),
                    LayerShape("attn.c_proj", _CONV1D, h + 1, h, bias=True),
                    LayerShape("mlp.c_fc", _CONV1D, h + 1, i, bias=True),
                    LayerShape("mlp.c_proj", _CONV1D, i + 1, h, bias=True),
                    self._norm("ln_1", h), self._norm("ln_2", h)]
        q, kv, b = self.heads * self.head_dim, self.kv_heads * self.head_dim, int(self.qkv_bias)
        qk = [self._norm("self_attn.q_norm", q),
              self._norm("self_attn.k_norm", kv)] if self.qk_norm else []
        return qk + [LayerShape("self_attn.q_proj", _LINEAR, h + b, q, bias=bool(b)),
                LayerShape("self_attn.k_proj", _LINEAR, h + b, kv, bias=bool(b)),
                LayerShape("self_attn.v_proj", _LINEAR, h + b, kv, bias=bool(b)),
                LayerShape("self_attn.o_proj", _LINEAR, q, h),
                LayerShape("mlp.gate_proj", _LINEAR, h, i),
                LayerShape("mlp.up_proj", _LINEAR, h, i),
                LayerShape("mlp.down_proj", _LINEAR, i, h),
                self._norm("input_layernorm", h), self._norm("post_attention_layernorm", h)]

    def _norm(self, name: str, width: int) -> LayerShape:
        """GPT-2's LayerNorm (weight and bias rows) or an RMSNorm (weight) of ``width``."""
        gpt2 = self.family == "gpt2"
        return LayerShape(name, get_kind("layernorm" if gpt2 else "rmsnorm"), width,
                          1 + gpt2, bias=gpt2)

    def captured_layers(self) -> list[LayerShape]:
        """Every layer capture sees, blocks folded into ``count`` (a tied input embedding and
        head are one layer of ``2 T`` tokens)."""
        out = [replace(s, count=self.layers) for s in self.block()]
        if not self.tied:
            out.append(LayerShape("embed_tokens", _EMBEDDING, self.vocab, self.hidden))
        if self.positions:
            out.append(LayerShape("wpe", _EMBEDDING, self.positions, self.hidden))
        out.append(self._norm("norm", self.hidden))
        out.append(LayerShape("lm_head", _LINEAR, self.hidden, self.vocab,
                              token_factor=2 if self.tied else 1))
        return out

    @property
    def num_params(self) -> int:
        """Trainable parameters: every layer is captured (a tied head is one matrix)."""
        return sum(L.params for L in self.captured_layers())

    def forward_kernels(self) -> int:
        """Kernels one eager forward launches: ``KERNELS_PER_BLOCK`` per block (a Llama
        block: two RMSNorms of ~8 elementwise kernels, q/k/v/o, rotary ~12, SDPA, the
        gated MLP's 5, residuals; GPT-2's has no rotary) plus embedding, final norm, head
        and loss (~8). A backward launches about twice as many."""
        return KERNELS_PER_BLOCK[self.family] * self.layers + 8

    @property
    def param_tensors(self) -> int:
        """Parameter tensors (weights and biases): what ZeRO-3 gathers one by one."""
        return sum(L.count * (1 + L.bias) for L in self.captured_layers())

    def forward_flops(self, batch: int, seq: int) -> float:
        """``2 x`` multiply-adds of every layer (``LayerKind.forward_macs``) plus attention's
        ``4 B T^2 h`` per block."""
        lin = sum(L.count * L.kind.forward_macs(L.shape) for L in self.captured_layers())
        attn = 4 * batch * seq * seq * self.heads * self.head_dim * self.layers
        return 2.0 * lin * batch * seq + attn

    def activation_elems(self, batch: int, seq: int) -> float:
        """Elements saved for backward per micro-batch (all blocks, plus the logits)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        per_tok = 16 * h if self.family == "gpt2" else 9 * h + 3 * kv + 4 * i
        return batch * seq * (self.layers * per_tok + 3 * self.vocab)


#: Eager kernels per transformer block forward (``ModelShape.forward_kernels``).
KERNELS_PER_BLOCK = {"llama": 40, "gpt2": 30}
_OPT_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "sgd_momentum": 4}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What the run does: one field per ``dattri-ds plan`` flag, its docstring the flag's help."""

    world: int = field(default=1, metadata=schema.bounds(ge=1))
    """data-parallel ranks."""
    seq_len: int = field(default=512, metadata=schema.bounds(ge=1))
    """tokens per example (T)."""
    micro_batch: int = field(default=1, metadata=schema.bounds(ge=1))
    """examples per rank per forward (B)."""
    zero_stage: Literal[0, 1, 2, 3] = 3
    """DeepSpeed ZeRO stage 0-3."""
    offload: Literal["none", "optimizer", "all"] = "none"
    """``none``, ``optimizer`` or ``all`` (optimizer and parameters) to the host."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """weight dtype (``float32`` or ``bfloat16``)."""
    optimizer: Literal["adamw", "adam", "sgd", "sgd_momentum"] = "adamw"
    """``adamw``, ``sgd`` or ``sgd_momentum``."""
    capture: bool = True
    """per-example gradients are captured during training."""
    projection: str = "kronecker"
    """a projection kind (``kronecker``, ``dense``, ``sparse`` or ``auto``: per layer by
    ``ops.cost.choose_projection``)."""
    k: int = field(default=0, metadata=schema.bounds(ge=0))
    """projected size per layer (0 = recommend one)."""
    projection_cache_bytes: int = field(default=ProjectionConfig().cache_bytes,
                                        metadata=schema.bounds(ge=0))
    """the projection matrices kept per process (``ProjectionConfig.cache_bytes``); the rest
    is regenerated on use, one block at a time."""
    method: Literal["graddot", "tracin", "kfac", "ekfac", "selection"] = "graddot"
    """what the gradients feed (``graddot``/``tracin``: inner products; ``kfac``/``ekfac``:
    curvature factors; ``selection``: online selection)."""
    candidate_multiple: float = 2.0
    """candidates scored per trained example by online selection."""
    selection_probe: bool = False
    """the selection's scoring rule reads the candidates' gradients (``alignment``, ``step``: every
    candidate is forwarded and back-propagated, so their activations, capture buffers and that
    pass's time are planned); False (``content``, the default for target documents) scores their
    text only, so a step plans like a plain one."""
    examples: int = 10_000
    """rows written to the store (for its size)."""
    store_dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    """the store's element type."""
    train: bool = True
    """the run trains (optimizer, gradients); False plans a ``collect`` / attribution pass over
    frozen weights (parameters only)."""
    zero_init: bool = False
    """the model is built partitioned (``deepspeed.zero.Init``); False builds it whole in fp32 on
    every rank first (what ``launch/train.py`` does)."""
    store_budget_gb: float = 100.0
    """the store size ``k = 0`` may recommend up to."""
    reduce_bucket: float = 5e8
    """DeepSpeed's ``reduce_bucket_size`` (elements)."""
    max_live_params: float = 1e9
    """DeepSpeed's ``stage3_max_live_parameters`` (elements)."""
    prefetch_bucket: float = 5e7
    """DeepSpeed's ``stage3_prefetch_bucket_size`` (elements)."""
    sub_group_size: float = 1e9
    """DeepSpeed's ``sub_group_size`` (elements)."""

    def __post_init__(self) -> None:
        schema.check(self, "plan")
        if self.offload == "all" and self.zero_stage != 3:
            raise ConfigError("offloading parameters needs zero_stage 3")
        kind = PROJECTION_KINDS.get(self.projection)
        if kind is None or type(kind).matrix_bytes is ProjectionKind.matrix_bytes:
            raise ConfigError(f"projection must be a registered kind that sizes its matrices "
                              f"(ProjectionKind.matrix_bytes), one of "
                              f"{PROJECTION_KINDS.names()}, got '{self.projection}'")

    @property
    def weight_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def probes(self) -> bool:
        """Online selection that forwards and back-propagates every candidate (the probe)."""
        return self.method == "selection" and self.selection_probe


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
    curvature = s.method in ("kfac", "ekfac")
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


# ---- the guard: refuse at start what cannot fit on this machine ------------------------------

#: Which RunSpec fields (and ``model``: the model's size, with its vocabulary) each memory
#: term grows with: the knobs a refusal names.
_TERM_KNOBS = {"activations": ("seq_len", "micro_batch", "candidate_multiple", "vocab"),
               "factors": ("seq_len", "micro_batch", "candidate_multiple"),
               "projections": ("k",), "kfac": ("model", "vocab"),
               "params": ("model", "vocab"), "master": ("model", "vocab"),
               "grads": ("model", "vocab"), "optimizer": ("model", "vocab"),
               "gathered": ("model",), "grad_bucket": ("model",), "init_model": ("model",),
               "optimizer_tmp": ("model",)}


@dataclass(frozen=True)
class Knob:
    """A setting the guard may name: the RunSpec field (or ``model`` / ``vocab``) it sets,
    its JSON key and flag, its value and its default (how far it moved from it ranks it)."""

    field: str
    key: str
    flag: str | None
    value: Any
    default: Any = None

    def text(self) -> str:
        flag = f" ({self.flag})" if self.flag else ""
        return f"{self.key}{flag} = {self.value}"

    def ratio(self) -> float:
        try:
            return float(self.value) / float(self.default)
        except (TypeError, ValueError, ZeroDivisionError):
            return 1.0


def available_memory(device: str = "cpu") -> tuple[float, str]:
    """(bytes this process may still allocate, where that figure comes from): free GPU
    memory on CUDA (``torch.cuda.mem_get_info``), else ``MemAvailable`` of /proc/meminfo,
    else the physical memory (``os.sysconf``)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return float(free), "free GPU memory (torch.cuda.mem_get_info)"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    return _host_memory(), "physical memory (os.sysconf)"


def check_fits(model: ModelShape, spec: RunSpec, knobs: list[Knob], *,
               device: str = "cpu", local_ranks: int = 1,
               override: str = "--skip-memory-check") -> Plan:
    """Refuse a run the planner predicts cannot fit in this machine's memory.

    The need is the plan's per-rank total (on CPU plus what is offloaded, times the
    ``local_ranks`` sharing the host); the limit is :func:`available_memory`. Only a need
    above the limit is refused (the plan's terms are upper estimates).

    Args:
        model, spec: what runs (``spec.k`` must be set: no recommendation here).
        knobs: the settings the user gave, named in the message when their terms dominate.
        device: ``cpu`` or ``cuda[:i]``.
        local_ranks: ranks of this run sharing this host's memory (CPU).
        override: the flag (and key) that skips the check, named in the message.

    Returns:
        The plan (it fits).

    Raises:
        DoesNotFitError: naming the largest term, the knobs it grows with, the need and the
            limit, and ``override``.
    """
    from dattri_ds.errors import DoesNotFitError

    cuda = device.startswith("cuda")
    base = DEVICES["h200" if cuda else "cpu"]
    limit, source = available_memory(device)
    result = _plan_fixed(model, replace(base, memory_bytes=limit), spec)
    ranks = 1 if cuda else max(local_ranks, 1)
    terms = dict(result.memory) if cuda else {**result.memory, **result.host}
    need = sum(terms.values()) * ranks
    if need <= limit:
        return result
    top = max((k for k in terms if k in _TERM_KNOBS), key=terms.get, default="activations")
    named = sorted((k for k in knobs if k.field in _TERM_KNOBS[top]), key=lambda k: -k.ratio())
    grows = ", ".join(k.text() for k in named) or "the model's size"
    per = f" ({ranks} ranks on this host)" if ranks > 1 else ""
    raise DoesNotFitError(
        f"this run needs about {need / GB:.1f} GB{per} but {limit / GB:.1f} GB is available "
        f"({source}); the largest part, {top} ({terms[top] * ranks / GB:.1f} GB), grows with "
        f"{grows}. Fix: lower {named[0].key if named else 'the model size'}, or pass "
        f"{override} to run anyway (dattri-ds plan shows every term)")


def check_tool(root: str | os.PathLike, args: Any, *, seq_len: int, examples: int,
               method: str = "graddot") -> Plan | None:
    """:func:`check_fits` for an offline tool (collect, fit, attribute) on the model in
    ``root`` (a run's ``model/config.json`` or a Hugging Face folder's ``config.json``),
    from the tool's flags: ``--batch-size`` (capped at the examples), ``--seq-len``,
    ``--projection`` / ``--projection-dim``; ``--skip-memory-check`` skips it. A model the
    planner does not know (e.g. a Megatron config) is not checked.

    Raises:
        DoesNotFitError: naming the flag, the need and the limit.
    """
    if getattr(args, "skip_memory_check", False):
        return None
    root = Path(root)
    config = root / "model/config.json" if (root / "model/config.json").is_file() \
        else root / "config.json"
    try:
        model = ModelShape.from_config(config)
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None
    batch = max(1, min(int(getattr(args, "batch_size", None) or 8), max(examples, 1)))
    k = int(getattr(args, "projection_dim", None) or 0)
    kind = getattr(args, "projection", None) or "kronecker"
    try:
        spec = RunSpec(seq_len=seq_len, micro_batch=batch, zero_stage=0, dtype="float32",
                       train=False, capture=True, projection=kind if kind in KINDS
                       else "kronecker", k=k, method=method, zero_init=True)
    except ConfigError:
        return None
    knobs = [Knob("seq_len", "--seq-len", None, seq_len, 512),
             Knob("micro_batch", "--batch-size", None, batch, 8),
             Knob("k", "--projection-dim", None, k or None, 4096)]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return check_fits(model, spec, [kn for kn in knobs if kn.value], local_ranks=local,
                      device="cpu", override="--skip-memory-check")
