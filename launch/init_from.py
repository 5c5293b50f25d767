"""Start from an earlier run: its tokenizer (``--init-from``), its weights (``--init-checkpoint``).

    python launch/train.py ... --init-from runs/warm                         # tokenizer only
    python launch/train.py ... --init-from runs/warm --init-checkpoint latest  # and weights

``--init-from`` tokenizes with the run's copy of its tokenizer (``tokenizer.model``, or the
Hugging Face files in ``model/``: launch/data.py); ``--init-checkpoint TAG`` (``latest``: the
newest complete one) also loads that checkpoint's weights (DeepSpeed and ``--backend torch``
checkpoints into a ``deepspeed`` or ``torch`` run, Megatron ones into a ``megatron`` run of
any tensor-parallel size) into a model of the same config. Every check runs in
``check_init_from`` before any process group starts; ``--out`` may not be the run itself
(``checks.check_outputs``). What is refused, and the curation recipe it serves:
docs/training.md ("Starting from another run").
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dattri_ds.errors import ConfigError
from dattri_ds.launch.config import RunConfig
from dattri_ds.launch.resume import Checkpoints

__all__ = ["check_init_from", "init_hf_weights", "init_megatron_weights"]

logger = logging.getLogger("dattri_ds.launch")

_FIX = "pass --init-from the --out folder of a launch/train.py run"
#: Keys of a Hugging Face config.json that do not change the model's weights or maths.
_NOT_ARCHITECTURE = {"transformers_version", "_name_or_path", "architectures", "torch_dtype",
                     "dtype", "tokenizer_fingerprint", "use_cache", "return_dict",
                     "output_attentions", "output_hidden_states", "_attn_implementation",
                     "_attn_implementation_autoset"}
#: Keys of a Megatron run's model/config.json that only record how it was trained.
_MEGATRON_RECORD = {"trained_sequence_parallel", "trained_tensor_model_parallel_size",
                    "tokenizer_fingerprint", "backend"}


def _root(cfg: RunConfig) -> Path:
    return Path(cfg.train.init_from)


def _is_megatron_run(root: Path) -> bool:
    from dattri_ds.io.files import read_json

    saved = read_json(root / "model" / "config.json", "--init-from model config", fix=_FIX)
    return isinstance(saved, dict) and saved.get("backend") == "megatron"


def check_init_from(cfg: RunConfig) -> str | None:
    """Check ``--init-from`` / ``--init-checkpoint`` at start; the checkpoint tag to load
    (None: tokenizer only).

    Raises:
        InputFileError: the folder is missing.
        ConfigError: the folder is not a launch run, has no tokenizer, no such complete
            checkpoint, or a checkpoint another backend wrote.
    """
    from dattri_ds.io.files import check_dir
    from dattri_ds.launch.data import run_tokenizer_path

    tc = cfg.train
    if tc.init_from is None:
        return None
    root = check_dir(tc.init_from, "--init-from run folder", _FIX)
    tok = run_tokenizer_path(root)
    if not tok.exists():
        what = "a run folder" if (root / "model" / "config.json").exists() else \
            "not a launch/train.py run folder"
        raise ConfigError(f"--init-from {root}: it has no tokenizer (tokenizer.model or "
                          f"tokenizer files in model/; {what}). Fix: {_FIX} (each keeps its "
                          f"tokenizer), or drop --init-from")
    if tc.init_checkpoint is None:
        return None
    if not (root / "model" / "config.json").exists():
        raise ConfigError(f"--init-checkpoint {tc.init_checkpoint}: {root} has no "
                          f"model/config.json, so its checkpoints cannot be read. Fix: {_FIX}")
    megatron = _is_megatron_run(root)
    if megatron != (cfg.engine.backend == "megatron"):
        wrote = "--backend megatron" if megatron else "--backend deepspeed or torch"
        raise ConfigError(f"--init-checkpoint {tc.init_checkpoint}: the checkpoints of {root} "
                          f"were written by {wrote}, this run trains with --backend "
                          f"{cfg.engine.backend}; their weights do not load into each other. "
                          f"Fix: train with the backend of that run, or drop --init-checkpoint "
                          f"(the tokenizer is still shared)")
    return _tag(cfg)


def _tag(cfg: RunConfig) -> str | None:
    """The complete checkpoint ``--init-checkpoint`` names (``latest``: the newest), its
    files whole (``files.check_checkpoint``)."""
    from dattri_ds.io.files import check_checkpoint

    if cfg.train.init_checkpoint is None:
        return None
    root = _root(cfg)
    tag = Checkpoints.of(root, flag="--init-checkpoint").choose(
        root, cfg.train.init_checkpoint, flag="--init-checkpoint", fresh_ok=False)
    check_checkpoint(root / "checkpoints" / tag, f"--init-checkpoint {tag} checkpoint",
                     f"pass another checkpoint of {root} (--init-checkpoint <tag>)")
    return tag


def _differences(saved: dict[str, Any], built: dict[str, Any],
                 ignore: set[str]) -> list[str]:
    keys = sorted((set(saved) | set(built)) - ignore)
    return [f"{k}={saved.get(k)!r} there, {built.get(k)!r} here" for k in keys
            if saved.get(k) != built.get(k)]


def _refuse(cfg: RunConfig, diffs: list[str], hint: str = "") -> None:
    raise ConfigError(f"--init-checkpoint {cfg.train.init_checkpoint}: the model config of "
                      f"this run differs from {_root(cfg) / 'model' / 'config.json'}: "
                      f"{'; '.join(diffs[:4])}"
                      f"{f' (and {len(diffs) - 4} more)' if len(diffs) > 4 else ''}. Fix: pass "
                      f"the --model-config that run used{hint}, or drop --init-checkpoint "
                      f"(random init, the tokenizer still shared)")


def _tied(model: nn.Module, loaded: set[str]) -> set[str]:
    """Parameter names that share their tensor with a loaded one (GPT-2's lm_head)."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return {n for names in by_tensor.values() if any(m in loaded for m in names) for n in names}


def init_hf_weights(model: nn.Module, cfg: RunConfig) -> None:
    """Load the ``--init-checkpoint`` of the ``--init-from`` run into a Hugging Face
    ``model`` (before any engine wraps it); nothing without ``--init-checkpoint``.

    Raises:
        ConfigError: the model config differs from the run's, or the weights do not match.
    """
    tag = _tag(cfg)
    if tag is None:
        return
    from transformers import AutoConfig

    from dattri_ds.integrations.checkpoints import load_state_dict

    root = _root(cfg)
    saved = AutoConfig.from_pretrained(str(root / "model")).to_dict()
    diffs = _differences(saved, model.config.to_dict(), _NOT_ARCHITECTURE)
    if diffs:
        _refuse(cfg, diffs)
    noise = io.StringIO()
    with contextlib.redirect_stdout(noise):  # zero_to_fp32 prints every shard it reads
        state = load_state_dict(root / "checkpoints" / tag)
    logger.debug("%s", noise.getvalue())
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [m for m in missing if not m.endswith((".attn.bias", ".masked_bias"))
           and m not in _tied(model, set(state))]
    if bad or unexpected:
        raise ConfigError(f"--init-checkpoint {tag}: the weights in {root / 'checkpoints' / tag} "
                          f"do not match the model: missing {bad[:5]}, unexpected "
                          f"{unexpected[:5]}. Fix: {_FIX} whose model config this run uses")
    logger.info("--init-checkpoint %s: weights of %s", tag, root / "checkpoints" / tag)


def init_megatron_weights(gpt: nn.Module, model_cfg: dict, cfg: RunConfig) -> None:
    """Load the consolidated ``--init-checkpoint`` of the ``--init-from`` Megatron run into
    this rank's GPTModel shards (any tensor-parallel size); nothing without one.

    Raises:
        ConfigError: the model config (padded vocabulary included) differs from the run's.
    """
    tag = _tag(cfg)
    if tag is None:
        return
    from dattri_ds.io.files import read_json
    from dattri_ds.integrations import megatron_checkpoint as ckpt

    root = _root(cfg)
    saved = read_json(root / "model" / "config.json", "--init-from model config", fix=_FIX)
    diffs = _differences(saved, model_cfg, _MEGATRON_RECORD | {"tokenizer_vocab_size"})
    if diffs:
        tp = saved.get("trained_tensor_model_parallel_size")
        _refuse(cfg, diffs, f" and its --tensor-model-parallel-size {tp} (the padded "
                            f"vocabulary depends on it)" if any(
                                d.startswith("vocab_size") for d in diffs) else "")
    with torch.no_grad():
        ckpt.load_consolidated(gpt, ckpt.read_consolidated(root / "checkpoints" / tag))
    logger.info("--init-checkpoint %s: weights of %s", tag, root / "checkpoints" / tag)
