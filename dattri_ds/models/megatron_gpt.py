"""A Megatron-core GPTModel that runs on CPU and GPU and is called like a Hugging Face causal LM.

Used by ``launch/train.py --backend megatron`` and by the offline tools (a TP=1 model rebuilt
from a consolidated checkpoint, integrations/megatron_checkpoint.py). Megatron is imported
inside the functions only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dattri_ds.errors import ConfigError

__all__ = ["MegatronLM", "LMOutput", "TorchNorm", "gpt_block_spec", "build_gpt",
           "cpu_workarounds"]


@dataclass(frozen=True)
class LMOutput:
    """What ``MegatronLM`` returns: the loss a Hugging Face causal LM would return, and its
    per-token terms."""

    loss: torch.Tensor
    """Scalar: mean token loss over the positions whose next label is not -100."""

    token_losses: torch.Tensor
    """``[B, T-1]``: the loss of predicting token t+1 at position t (0 where masked)."""


class MegatronLM(nn.Module):
    """A GPTModel called like a Hugging Face causal LM.

    ``forward(input_ids [B, T], labels [B, T], attention_mask=None)`` returns ``.loss``, the
    mean of Megatron's per-token loss ``[B, T]`` at positions t < T-1 whose next label
    ``labels[:, t+1]`` is not -100 (the HF shift), and ``.token_losses`` ``[B, T-1]``
    (0 where masked). Padding is on the right, so the causal mask alone keeps real tokens
    from seeing pads and ``attention_mask`` is not needed.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None):
        b, t = input_ids.shape
        labels = input_ids if labels is None else labels
        nxt = torch.cat([labels[:, 1:], labels.new_full((b, 1), -100)], dim=1)
        keep = nxt != -100
        pos = torch.arange(t, device=input_ids.device).expand(b, t)
        mask = torch.triu(torch.ones(1, 1, t, t, dtype=torch.bool, device=input_ids.device), 1)
        per_tok = self.model(input_ids, pos, mask, labels=nxt.clamp_min(0))  # [B, T]
        per_tok = per_tok * keep
        loss = per_tok.sum() / keep.sum().clamp_min(1)
        return LMOutput(loss=loss, token_losses=per_tok[:, :-1])


def cpu_workarounds() -> None:
    """docs/cpu_setup.md: a no-op RNG tracker and a CPU attention scratch buffer (after init).

    Without CUDA, ``torch.cuda.current_device`` also answers ``"cpu"``: Megatron's
    sequence-parallel gathers allocate their buffers on it. Call only in a CPU-only process.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUBuf(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(math.prod(tensor_shape), dtype=dtype).view(*tensor_shape)

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    ps._GLOBAL_MEMORY_BUFFER = CPUBuf()
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"


class TorchNorm:
    """A torch ``LayerNorm``/``RMSNorm`` for Megatron layer specs that allows sequence parallelism
    (why: docs/cpu_setup.md, "Norms"). Its parameters are marked ``sequence_parallel``, so
    Megatron sums their partial gradients over the tensor-parallel group.

    Called like Megatron's norm modules: ``TorchNorm(config, hidden_size, eps, ...)``.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm=False,
                zero_centered_gamma: bool = False, normalization: str | None = None):
        kind = normalization or getattr(config, "normalization", "LayerNorm")
        if getattr(config, "layernorm_zero_centered_gamma", False) or zero_centered_gamma:
            raise ConfigError("layernorm_zero_centered_gamma is not supported by dattri-ds' "
                              "torch norm spec; set it to False")
        classes = {"LayerNorm": nn.LayerNorm, "RMSNorm": nn.RMSNorm}
        if kind not in classes:
            raise ConfigError(f"normalization='{kind}' is not supported; use LayerNorm or "
                              f"RMSNorm")
        norm = classes[kind](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        return norm


def gpt_block_spec(config) -> Any:
    """Megatron's local GPT layer spec, every norm a ``TorchNorm``: a ``TransformerBlock`` spec.

    Runs on CPU and GPU without Apex or Transformer Engine, with or without sequence
    parallelism; pass it to ``GPTModel(transformer_layer_spec=...)``.
    """
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock, TransformerBlockSubmodules,
    )

    layer = get_gpt_layer_local_spec(normalization=config.normalization)
    layer = replace(layer, submodules=replace(layer.submodules, input_layernorm=TorchNorm,
                                              pre_mlp_layernorm=TorchNorm))
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * config.num_layers, layer_norm=TorchNorm))


def build_gpt(kw: dict, vocab: int, context: int, seed: int) -> nn.Module:
    """A GPTModel from TransformerConfig kwargs (``gpt_block_spec``, untied output), seeded.

    Raises:
        ConfigError: sequence parallelism without tensor parallelism.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    if kw.get("sequence_parallel") and kw.get("tensor_model_parallel_size", 1) == 1:
        raise ConfigError("sequence_parallel needs tensor_model_parallel_size > 1")
    config = TransformerConfig(**kw)
    torch.manual_seed(seed)
    return GPTModel(config, gpt_block_spec(config), vocab_size=vocab,
                    max_sequence_length=context, share_embeddings_and_output_weights=False)
