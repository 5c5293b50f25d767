"""Full weights from saved checkpoints: DeepSpeed ZeRO-0/1/2/3 directories and HF model dirs.

ZeRO checkpoints written by any number of ranks are consolidated to fp32 on the CPU with
DeepSpeed's own ``zero_to_fp32`` (no GPU, no process group). Files are read through
:mod:`dattri_ds.io.files`; errors name the path and say what was expected.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dattri_ds.io import files
from dattri_ds.errors import ConfigError

__all__ = ["load_state_dict", "checkpoint_tags"]

_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_FIX = "pass the checkpoints/ folder of a launch/train.py run, or copy the checkpoint again"


def checkpoint_tags(root: str | Path) -> list[str]:
    """Tags (sub-folders) of a checkpoint root, oldest step first: DeepSpeed tag folders
    and Hugging Face ``save_pretrained`` folders."""
    root = Path(root)
    tags = [p.name for p in root.iterdir() if p.is_dir() and (
        any(p.glob("*model_states.pt"))
        or ((p / "config.json").exists() and any((p / w).exists() for w in _HF_WEIGHTS)))]
    return sorted(tags, key=lambda t: (len(t), t))


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    st = path / "model.safetensors"
    if st.exists():
        return files.load_safetensors(st, "checkpoint weights")
    return files.load_torch(path / "pytorch_model.bin", "checkpoint weights",
                            fix="pass a folder written by model.save_pretrained(path)")


def load_state_dict(path: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """fp32 state dict of a checkpoint.

    Args:
        path: a DeepSpeed checkpoint root (``save_checkpoint``'s directory, with tag
            sub-folders and usually ``latest``), one tag folder itself, or a Hugging Face
            model directory (``config.json`` + ``model.safetensors`` / ``pytorch_model.bin``).
        tag: DeepSpeed tag (default: ``latest``, else the last tag found).

    Raises:
        ConfigError: the path does not exist or holds no recognizable checkpoint.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"Checkpoint '{p}' does not exist; pass the checkpoints/ folder of a "
                          f"launch/train.py run, one of its tag folders, or a HF model folder")
    if (p / "config.json").exists() and any((p / w).exists() for w in _HF_WEIGHTS):
        return _hf_state(p)
    if any(p.glob("*model_states.pt")):  # a tag folder
        p, tag = p.parent, p.name
    if tag is None:
        latest = p / "latest"
        tags = checkpoint_tags(p) if p.is_dir() else []
        if latest.exists():
            tag = files.read_text(latest, "DeepSpeed 'latest' file",
                                  "pass the checkpoints/ folder of a launch/train.py run").strip()
        elif tags:
            tag = tags[-1]
        else:
            raise ConfigError(
                f"'{p}' holds no checkpoint: expected a DeepSpeed checkpoint folder (tag "
                f"sub-folders with *_model_states.pt files) or a Hugging Face model folder "
                f"(config.json + {' or '.join(_HF_WEIGHTS)})")
    folder = p / tag
    if not folder.is_dir():
        raise ConfigError(f"Checkpoint tag '{tag}' not found in '{p}'; available tags: "
                          f"{checkpoint_tags(p)}")
    files.check_checkpoint(folder, "DeepSpeed checkpoint", _FIX,  # cut files named first
                           only=("*_model_states.pt", "*_optim_states.pt"))
    if any(folder.glob("zero_pp_rank_*_optim_states.pt")):  # ZeRO-1/2/3: partitioned fp32
        state = _zero_to_fp32(p, tag)
    else:  # ZeRO-0: the full module state sits in the model-states file
        states = sorted(folder.glob("mp_rank_*_model_states.pt"))
        if not states:
            raise ConfigError(f"No model states in '{folder}'")
        state = files.load_torch(
            states[0], "DeepSpeed model states", fix="pass the checkpoints/ folder of a "
            "launch/train.py run", trusted="a DeepSpeed checkpoint tag folder")
        if not isinstance(state, dict) or "module" not in state:
            raise ConfigError(f"DeepSpeed model states '{states[0]}' hold no 'module' state "
                              f"dict: not a DeepSpeed checkpoint. Fix: pass the checkpoints/ "
                              f"folder of a launch/train.py run")
        state = state["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def _zero_to_fp32(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's consolidation of a ZeRO-1/2/3 tag folder (its files checked whole
    before); what DeepSpeed's reader raises on files that are whole but not what it expects
    (a missing rank's file, another layout) is one line naming the folder.

    Raises:
        InputFileError: DeepSpeed cannot consolidate the folder.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with files.read_by("DeepSpeed's zero_to_fp32 (a rank's file missing, or not a ZeRO "
                       "state)", root / tag, "DeepSpeed checkpoint", _FIX):
        return get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
