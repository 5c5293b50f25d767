"""Megatron-core adapter: TP/DP groups from parallel_state, and model preparation for capture.

What capture needs from a Megatron model, and what this module provides:

* ``prepare_model(model)``: marks the modules of every ``TransformerBlock``/``TransformerLayer``
  that a batch-first kind would misread. LayerNorm/RMSNorm there see sequence-first
  ``[S, B, H]`` activations (sequence-sharded with sequence parallelism) and are captured by
  ``SequenceFirstNormKind``; a plain ``nn.Linear``/``nn.Embedding`` there is marked
  unsupported (capture refuses it by name at start unless excluded). Column/Row-parallel
  linears and the vocabulary-parallel embedding know their own layout (layers/megatron.py).
* ``MegatronAdapter``: an ``EngineAdapter`` whose ``parallel_context()`` holds Megatron's data-
  and tensor-parallel groups. Sharded layers reduce their partial inner products over the
  tensor-parallel group (``ShardInfo.group``, set by the kinds); consumers reduce over
  examples over the *data*-parallel group only: tensor-parallel ranks hold the same examples.
* ``megatron_capture(model, config)``: a GradientCapture on a prepared model with the adapter.

The loop owns backward and the optimizer: call ``adapter.step_done()`` after every optimizer
step. Megatron's GPT loss is per token and its labels are already shifted, so use
``CaptureConfig(label_shift=0)`` with ``loss_reduction`` matching the loop's reduction.

Not supported (clear errors at start): pipeline parallelism, MoE experts, Transformer Engine
modules, an output layer tied to the embedding. ``import dattri_ds`` does not import megatron;
this module imports it inside functions only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dattri_ds.callbacks import TrainingCallback
from dattri_ds.config import CaptureConfig
from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import ConfigError
from dattri_ds.integrations.base import EngineAdapter
from dattri_ds.layers import kind_for
from dattri_ds.layers.megatron import SEQUENCE_FIRST_ATTR, UNSUPPORTED_ATTR

__all__ = ["MegatronAdapter", "prepare_model", "megatron_capture", "megatron_parallel_context",
           "MegatronLM", "cpu_workarounds", "build_gpt", "TorchNorm", "gpt_block_spec"]

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


class MegatronAdapter(EngineAdapter):
    """A Megatron-core model driven by the user's own loop (Megatron's own or a torch one).

    Args:
        model: the model (or a Megatron DDP / Float16Module wrapping it); prepared here.
        backward_scale: the factor the loop multiplies its reduced loss by before backward
            (e.g. ``1 / num_microbatches``), or a callable read at backward time.
    """

    def __init__(self, model: nn.Module, backward_scale: float | Callable[[], float] = 1.0) -> None:
        self.model = model
        self._inner = prepare_model(model)
        self._scale = backward_scale
        self._step = 0
        self._hooks: list[Callable[[], None]] = []

    def unwrap(self) -> nn.Module:
        return self._inner

    def parallel_context(self) -> ParallelContext:
        return megatron_parallel_context()

    def backward_scale(self) -> float:
        return float(self._scale() if callable(self._scale) else self._scale)

    def global_step(self) -> int:
        return self._step

    def on_step(self, fn: Callable[[], None]) -> Callable[[], None]:
        self._hooks.append(fn)
        return lambda: self._hooks.remove(fn) if fn in self._hooks else None

    def step_done(self) -> None:
        """Call after every optimizer step: advances the step and notifies captures."""
        self._step += 1
        for fn in list(self._hooks):
            fn()


def megatron_capture(model: nn.Module, config: CaptureConfig | None = None, *,
                     callbacks: Iterable[TrainingCallback] = (),
                     adapter: MegatronAdapter | None = None, **kwargs):
    """A GradientCapture on a prepared Megatron model, with steps and scale from the adapter.

    ``kwargs`` go to GradientCapture (``cost``, ``probe_only``). Attach it with ``with`` or
    ``attach()``; ``cap.adapter.step_done()`` marks optimizer steps.
    """
    from dattri_ds.capture import GradientCapture

    adapter = adapter or MegatronAdapter(model)
    cap = GradientCapture(adapter.unwrap(), config, callbacks=callbacks,
                          scale_fn=adapter.backward_scale, step_fn=adapter.global_step, **kwargs)
    cap.adapter = adapter
    return cap


# ---- shared by launch (--backend megatron) and the offline tools ------------------------
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
        return SimpleNamespace(loss=loss, token_losses=per_tok[:, :-1])


def cpu_workarounds() -> None:
    """SETUP.md s.5: a no-op RNG tracker and a CPU attention scratch buffer (after init).

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
    """A torch ``LayerNorm``/``RMSNorm`` for Megatron layer specs that allows sequence parallelism.

    Megatron's ``WrappedTorchNorm`` (its local spec's norm without Apex) refuses
    ``sequence_parallel``; Apex's ``FusedLayerNorm`` and TE's norms need CUDA builds. The
    maths of a norm does not change under sequence parallelism, only the reduction of its
    replicated weight: every rank sees ``S/R`` tokens, so its weight gradient is a partial sum.
    The parameters are marked ``sequence_parallel`` (as Megatron's own norms do), so
    Megatron's ``finalize_model_grads`` (or ``allreduce_sequence_parallel_grads``) sums them
    over the tensor-parallel group.

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
