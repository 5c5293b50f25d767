"""The model as the planner sees it: captured layer shapes and transformer sizes.

A captured layer's own terms (captured bytes, forward multiply-adds, K-FAC factor bytes)
come from its ``LayerKind``: a new kind plans without a change here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from dattri_ds.errors import ConfigError
from dattri_ds.layers import LayerKind, get_kind

_LINEAR, _CONV1D, _EMBEDDING = get_kind("linear"), get_kind("conv1d"), get_kind("embedding")


@dataclass(frozen=True)
class LayerShape:
    """``count`` captured layers of one ``LayerKind`` whose gradient is ``[O, I']`` (the
    kind's canonical ``layer_shape``: ``I`` counts a bias column; a norm's ``O`` is its
    ``1 + bias`` rows). ``token_factor`` 2 marks a tied head: capture merges the
    embedding's use into the output projection's factors as ``2 T`` tokens
    (``dattri_ds.capture.tied``), and no separate embedding layer is captured. ``bias``: the layer
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
        from dattri_ds.io.files import read_json
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
