"""Randomly initialized causal LMs of any Hugging Face architecture from a JSON config; never
downloads.

A model config is a JSON object of Hugging Face config fields plus ``model_type`` (our
``configs/model_*.json`` or a Hugging Face ``config.json``); every causal LM ``transformers``
builds is accepted. Unknown keys are an error (Hugging Face would silently keep a misspelt
``n_layers``).

``transformers`` is imported inside the functions.
"""

from __future__ import annotations

import difflib
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dattri_ds.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from dattri_ds.errors import ConfigError
from dattri_ds.io.files import read_json

__all__ = ["ARCHITECTURES", "causal_lm_types", "load_model_config", "build_model",
           "check_capturable"]

logger = logging.getLogger(__name__)

#: The model types trained end to end by the tests (tests/e2e/test_launch_archs.py,
#: tests/unit/test_models_arch.py); any other causal LM transformers builds is accepted too.
ARCHITECTURES = ("gpt2", "llama", "olmo2", "qwen2")
#: Keys accepted besides the config class's own fields: older spellings HF folds into other
#: fields, and the metadata a saved ``config.json`` carries.
_EXTRA_KEYS = {"rope_theta", "rope_scaling", "torch_dtype", "architectures",
               "transformers_version", "_name_or_path", "auto_map", "model_type",
               "attn_implementation"}


def causal_lm_types() -> list[str]:
    """Every ``model_type`` the installed transformers builds with ``AutoModelForCausalLM``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _check_model_type(arch: Any, where: str) -> None:
    known = causal_lm_types()
    if isinstance(arch, str) and arch in known:
        return
    near = difflib.get_close_matches(str(arch), known, n=3)
    hint = f" (close: {near})" if near else ""
    raise ConfigError(f"{where}: model_type {arch!r} is not a causal LM the installed "
                      f"transformers builds with AutoModelForCausalLM{hint}; tested: "
                      f"{list(ARCHITECTURES)} (any of the {len(known)} in transformers' "
                      f"MODEL_FOR_CAUSAL_LM_MAPPING_NAMES works); fix model_type in the config")


def load_model_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """Read a model config (JSON file or mapping) and check ``model_type``.

    Raises:
        InputFileError: the file is missing or not UTF-8 JSON (file and line named).
        ConfigError: not a JSON object, or ``model_type`` missing or not a causal LM.
    """
    if isinstance(config, Mapping):
        d, where = dict(config), "model config"
    else:
        path = Path(config)
        d = read_json(path, "model config", fix="pass a JSON model config such as "
                      "configs/model_gpt2_tiny.json")
        where = str(path)
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
    _check_model_type(d.get("model_type"), where)
    return d


def _check_keys(d: Mapping[str, Any], cfg_cls: type, arch: str) -> None:
    allowed = (set(cfg_cls().to_dict()) | set(getattr(cfg_cls, "attribute_map", {}))
               | _EXTRA_KEYS)
    unknown = sorted(set(d) - allowed)
    if unknown:
        hints = {k: difflib.get_close_matches(k, allowed, n=1) for k in unknown}
        hint = "; ".join(f"'{k}' -> did you mean '{m[0]}'?" for k, m in hints.items() if m)
        raise ConfigError(f"Unknown key(s) {unknown} in the {arch} model config"
                          f"{' (' + hint + ')' if hint else ''}; allowed keys are the fields of "
                          f"transformers.{cfg_cls.__name__}")


def build_model(config: str | os.PathLike | Mapping[str, Any], *,
                tokenizer: Any = None, vocab_size: int | None = None,
                seed: int | None = 0) -> torch.nn.Module:
    """A randomly initialized ``AutoModelForCausalLM`` of the config's ``model_type``.

    The vocabulary size is, in order of precedence, ``tokenizer.vocab_size``, ``vocab_size``
    or the config's own; ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` are the
    tokenizer's ``bos_id`` / ``eos_id`` / ``pad_id`` (without a tokenizer: 2, 3, 0, a
    trained SentencePiece model's) and must lie inside the vocabulary. With a tokenizer, its
    fingerprint is stored as ``model.config.tokenizer_fingerprint`` (saved with the model).

    Args:
        config: path of a JSON model config (ours or a Hugging Face ``config.json``), or the
            mapping itself.
        tokenizer: the tokenizer the model will read (a ``CorpusTokenizer`` or ``Tokenizer``).
        vocab_size: vocabulary size when no tokenizer is given.
        seed: seed of the weight initialization (global RNG state is left untouched);
            None uses the global RNG.

    Returns:
        The model, in training mode, on the CPU (or the default device), in float32.

    Raises:
        ConfigError: a ``model_type`` that is not a causal LM, unknown keys, or no usable
            vocabulary size.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = load_model_config(config)
    arch = d["model_type"]
    cfg_cls = CONFIG_MAPPING[arch]
    _check_keys(d, cfg_cls, arch)
    drop = {"model_type", "architectures", "transformers_version", "_name_or_path", "auto_map",
            "torch_dtype", "dtype"}  # the saved weights' dtype: we build fp32, the engine casts
    kwargs = {k: v for k, v in d.items() if k not in drop}
    size = tokenizer.vocab_size if tokenizer is not None else vocab_size
    if size is not None and "vocab_size" in kwargs and kwargs["vocab_size"] != size:
        warnings.warn(f"Model config vocab_size={kwargs['vocab_size']} is replaced by the "
                      f"tokenizer's {size}", stacklevel=2)
    size = size if size is not None else kwargs.get("vocab_size")
    special = {f"{k}_token_id": getattr(tokenizer, f"{k}_id", default) for k, default in
               (("bos", BOS_ID), ("eos", EOS_ID), ("pad", PAD_ID))}
    top = max((i for i in special.values() if i is not None), default=0)
    if size is None or size <= top:
        raise ConfigError(f"build_model needs a vocabulary size above {top} (the tokenizer's "
                          f"special ids {special}; got {size}); pass tokenizer= or vocab_size=")
    kwargs.update(vocab_size=size, **special)
    cfg = AutoConfig.for_model(arch, **kwargs)
    if tokenizer is not None:
        cfg.tokenizer_fingerprint = tokenizer.fingerprint
    if seed is None:
        model = AutoModelForCausalLM.from_config(cfg)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg)
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"  # HF infers it from the class name, not for GPT-2
    logger.info("Built %s with %.2fM parameters (vocab %d)", type(model).__name__,
                sum(p.numel() for p in model.parameters()) / 1e6, size)
    return model


def check_capturable(model: torch.nn.Module) -> None:
    """Refuse a model with a trainable module no ``LayerKind`` captures.

    Raises:
        ConfigError: one line naming the model type, the unsupported module classes (with
            one module name each) and the model types the tests train.
    """
    from dattri_ds.layers.base import kind_for

    missing: dict[str, str] = {}
    for name, module in model.named_modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)) and \
                kind_for(module) is None:
            missing.setdefault(type(module).__name__, name)
    if missing:
        mt = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        shown = ", ".join(f"{cls} ('{n}')" for cls, n in missing.items())
        raise ConfigError(f"model_type {mt!r} has trainable layers capture does not support: "
                          f"{shown}; supported layers are nn.Linear, HF Conv1D, nn.Embedding, "
                          f"LayerNorm and RMSNorm (tested model types: {list(ARCHITECTURES)}); "
                          f"train without --capture / --online-selection, or register a "
                          f"LayerKind for them (dattri_ds/layers)")
