"""Models of ``--backend megatron`` runs for the tools: a TP=1 GPTModel from a consolidated
checkpoint (integrations/megatron_checkpoint.py documents the format)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dattri_ds.errors import ConfigError, InputFileError
from dattri_ds.io.files import read_by, read_json
from dattri_ds.integrations.megatron import prepare_model
from dattri_ds.integrations.megatron_checkpoint import load_consolidated, read_consolidated
from dattri_ds.models.megatron_gpt import MegatronLM, build_gpt, cpu_workarounds

__all__ = ["megatron_single_process", "megatron_model"]


def megatron_single_process() -> None:
    """Megatron groups with TP=1 (a 1-process gloo group if none exists); CPU workarounds."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() != 1:
            raise ConfigError("Offline tools rebuild Megatron models with TP=1, but this process "
                              "already initialized Megatron with tensor parallelism "
                              f"{ps.get_tensor_model_parallel_world_size()}")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    if not torch.cuda.is_available():  # docs/cpu_setup.md
        cpu_workarounds()


def megatron_model(root: Path, tag: str) -> torch.nn.Module:
    """The TP=1 GPTModel of a Megatron run's consolidated checkpoint, prepared for capture."""
    path = root / "model/config.json"
    fix = "pass the --out folder of a launch/train.py --backend megatron run"
    cfg = read_json(path, "--run model config", fix=fix)
    if not isinstance(cfg, dict) or cfg.get("backend") != "megatron":
        raise ConfigError(f"{root / 'checkpoints' / tag} holds a Megatron checkpoint but "
                          f"{path} is not a Megatron model config")
    bad = [k for k, t in (("transformer_config", dict), ("vocab_size", int),
                          ("max_position_embeddings", int)) if not isinstance(cfg.get(k), t)]
    if bad:
        raise InputFileError(f"--run model config '{path}' lacks {bad[0]} (or it has the wrong "
                             f"type), which a Megatron model is built from. Fix: {fix}")
    megatron_single_process()
    kw = {**cfg["transformer_config"], "tensor_model_parallel_size": 1,
          "sequence_parallel": False}
    with read_by("megatron-core", path, "--run model config", fix):
        gpt = build_gpt(kw, cfg["vocab_size"], cfg["max_position_embeddings"], seed=0)
    try:
        load_consolidated(gpt, read_consolidated(root / "checkpoints" / tag))
    except ConfigError as e:
        raise ConfigError(f"Megatron checkpoint '{tag}' of {root} does not match its model "
                          f"config: {e}") from None
    return prepare_model(MegatronLM(gpt))
