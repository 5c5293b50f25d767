"""Small randomly initialized causal LMs (GPT-2, Llama) from a JSON config; never downloads.

A model config is a JSON object of Hugging Face config fields plus ``model_type``
(``"gpt2"`` or ``"llama"``), e.g. ``configs/model_gpt2_tiny.json``. ``build_model`` takes the
vocabulary size and the special ids from the tokenizer, so the config files leave them out.
Unknown keys are an error (Hugging Face would silently keep a misspelt ``n_layers``).

``transformers`` is imported inside ``build_model``.
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

from dattri_ds.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from dattri_ds.errors import ConfigError
from dattri_ds.files import read_json

__all__ = ["ARCHITECTURES", "load_model_config", "build_model"]

logger = logging.getLogger(__name__)

#: model_type -> (transformers config class, model class).
ARCHITECTURES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}
#: Keys accepted besides the config class's own fields (folded into other fields by HF).
_EXTRA_KEYS = {"gpt2": set(), "llama": {"rope_theta", "rope_scaling"}}
_COMMON_KEYS = {"model_type", "attn_implementation"}


def load_model_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """Read a model config (JSON file or mapping) and check ``model_type``.

    Raises:
        InputFileError: the file is missing or not UTF-8 JSON (file and line named).
        ConfigError: not a JSON object, or ``model_type`` missing or unsupported.
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
    arch = d.get("model_type")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{where}: model_type must be one of {sorted(ARCHITECTURES)}, "
                          f"got {arch!r}")
    return d


def _check_keys(d: Mapping[str, Any], cfg_cls: type, arch: str) -> None:
    allowed = (set(cfg_cls().to_dict()) | set(getattr(cfg_cls, "attribute_map", {}))
               | _EXTRA_KEYS[arch] | _COMMON_KEYS)
    unknown = sorted(set(d) - allowed)
    if unknown:
        hints = {k: difflib.get_close_matches(k, allowed, n=1) for k in unknown}
        hint = "; ".join(f"'{k}' -> did you mean '{m[0]}'?" for k, m in hints.items() if m)
        raise ConfigError(f"Unknown key(s) {unknown} in the {arch} model config"
                          f"{' (' + hint + ')' if hint else ''}; allowed keys are the fields of "
                          f"transformers.{cfg_cls.__name__}")


def build_model(config: str | os.PathLike | Mapping[str, Any], *,
                tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
                seed: int | None = 0) -> torch.nn.Module:
    """A randomly initialized ``GPT2LMHeadModel`` or ``LlamaForCausalLM``.

    The vocabulary size is, in order of precedence, ``tokenizer.vocab_size``, ``vocab_size``
    or the config's own; ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` are set to
    the tokenizer's (2, 3, 0) and must lie inside the vocabulary. With a tokenizer, its
    fingerprint is stored as ``model.config.tokenizer_fingerprint`` (saved with the model).

    Args:
        config: path of a JSON model config, or the mapping itself.
        tokenizer: the tokenizer the model will read.
        vocab_size: vocabulary size when no tokenizer is given.
        seed: seed of the weight initialization (global RNG state is left untouched);
            None uses the global RNG.

    Returns:
        The model, in training mode, on the CPU, in float32.

    Raises:
        ConfigError: unsupported ``model_type``, unknown keys, or no usable vocabulary size.
    """
    import transformers

    d = load_model_config(config)
    arch = d["model_type"]
    cfg_cls = getattr(transformers, ARCHITECTURES[arch][0])
    model_cls = getattr(transformers, ARCHITECTURES[arch][1])
    _check_keys(d, cfg_cls, arch)
    kwargs = {k: v for k, v in d.items() if k != "model_type"}
    size = tokenizer.vocab_size if tokenizer is not None else vocab_size
    if size is not None and "vocab_size" in kwargs and kwargs["vocab_size"] != size:
        warnings.warn(f"Model config vocab_size={kwargs['vocab_size']} is replaced by the "
                      f"tokenizer's {size}", stacklevel=2)
    size = size if size is not None else kwargs.get("vocab_size")
    if size is None or size <= max(BOS_ID, EOS_ID, PAD_ID):
        raise ConfigError(f"build_model needs a vocabulary size above {max(BOS_ID, EOS_ID)} "
                          f"(got {size}); pass tokenizer= or vocab_size=")
    kwargs.update(vocab_size=size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    cfg = cfg_cls(**kwargs)
    if tokenizer is not None:
        cfg.tokenizer_fingerprint = tokenizer.fingerprint
    if seed is None:
        model = model_cls(cfg)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(cfg)
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"  # HF infers it from the class name, not for GPT-2
    logger.info("Built %s with %.2fM parameters (vocab %d)", model_cls.__name__,
                sum(p.numel() for p in model.parameters()) / 1e6, size)
    return model
