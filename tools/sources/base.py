"""The ``Source`` protocol: what the offline tools ask of a trained model, whatever holds it.

Three sources implement it: ``Run`` (a launch/train.py output folder), ``HFModelDir`` (one
Hugging Face ``save_pretrained`` folder) and ``HFCheckpoints`` (Hugging Face checkpoint
folders of one run). A tool reads a source only through these members: where two sources
differ (a recorded learning rate, the training data, which checkpoints a tool reads by
default) the difference is a member's answer, never a test of the source's type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from dattri_ds.errors import ConfigError, InputFileError
from dattri_ds.io.files import check_checkpoint, read_json
from dattri_ds.tools.provenance import DataOrigin

__all__ = ["Source", "pick_tags", "model_context", "required_context", "config_vocab_size",
           "check_checkpoints", "CHECKPOINT_FILES"]

#: The files of a checkpoint folder the tools load: weights (safetensors, ``pytorch_model``
#: bins and shards), DeepSpeed's model and optimizer states, Megatron's consolidated weights
#: and optimizer states, ``--backend torch``'s training state.
CHECKPOINT_FILES = ("*.safetensors", "pytorch_model*.bin", "*_model_states.pt",
                    "*_optim_states.pt", "megatron_*.pt", "training_state.pt")


class Source(Protocol):
    """A trained model the tools read: its checkpoints, their models, its tokenizer.

    Every checkpoint has a tag (a run's ``step<N>``, a folder's name); ``trajectory()``
    lists them oldest first with their step and learning rate.
    """

    root: Path
    """The folder whose ``config.json`` (a run: ``model/config.json``) describes the model."""
    tokenizer_path: Path | None
    """A Hugging Face tokenizer folder (None: a run's ``tokenizer.model``, or none)."""
    context: int
    """The model's context length (``n_positions`` / ``max_position_embeddings``)."""
    seq_len: int
    """Tokens per example when no ``--seq-len`` is given (a run's, else the context)."""
    vocab_size: int | None
    """The model config's ``vocab_size`` (token-id data is checked against it)."""
    run_id: str | None
    """The id launch/train.py gave the run (stores record it); None without one."""

    def tokenizer(self):
        """The tokenizer texts are tokenized with (``tokenize_documents`` interface)."""

    def trajectory(self) -> list[dict]:
        """``[{"tag", "step", "lr"}]``, oldest first (None where a value is unknown)."""

    def checkpoint(self, tag: str) -> dict:
        """The entry of ``tag`` with a known learning rate (lr-weighted scores read it).

        Raises:
            ConfigError: ``tag`` is not a checkpoint, or its learning rate is unknown
                (naming the flags that supply it).
        """

    def tags(self, wanted: str | None) -> list[str]:
        """``all``/None -> every checkpoint, ``last`` -> the newest, else a comma list."""

    def default_tags(self, tool_default: str) -> str:
        """The checkpoint choice when no flag makes one: ``tool_default`` (``all`` or
        ``last``), or ``all`` when the user listed the checkpoints themselves."""

    def folder(self, tag: str) -> Path:
        """The folder holding checkpoint ``tag`` (its weights, optimizer state)."""

    def fingerprint(self) -> str:
        """The model family's identity (config + tokenizer): stores record it."""

    def model(self, tag: str, device: torch.device | str = "cpu") -> torch.nn.Module:
        """The model at checkpoint ``tag``, fp32, eval mode (dropout off)."""

    def training_record(self) -> DataOrigin | None:
        """The training documents the source records (a run's ``train.train_data``), None
        when it records none (``tools.provenance.training_data`` reads it)."""


def pick_tags(tags: list[str], wanted: str | None, check) -> list[str]:
    """The checkpoint tags ``wanted`` names among ``tags`` (oldest first): ``all``/None ->
    every one, ``last`` -> the newest, else a comma list, each passed to ``check`` (which
    raises ConfigError for a tag that is not there)."""
    if wanted in (None, "all"):
        return tags
    if wanted == "last":
        return tags[-1:]
    chosen = [t.strip() for t in wanted.split(",") if t.strip()]
    for t in chosen:
        check(t)
    return chosen


def _model_config(config_json: Path) -> dict:
    cfg = read_json(config_json, "model config")
    if not isinstance(cfg, dict):
        raise InputFileError(f"model config '{config_json}' is a JSON {type(cfg).__name__}, "
                             f"expected an object. Fix: save the model with save_pretrained")
    return cfg


def model_context(config_json: Path) -> int | None:
    """The context length in a model config (``n_positions`` / ``max_position_embeddings``)."""
    cfg = _model_config(config_json)
    got = cfg.get("n_positions") or cfg.get("max_position_embeddings") or cfg.get("n_ctx")
    return int(got) if got else None


def required_context(config_json: Path) -> int:
    """``model_context``, or a ConfigError naming the file and ``--seq-len``."""
    ctx = model_context(config_json)
    if ctx is None:
        raise ConfigError(f"{config_json} names no context length "
                          f"(n_positions / max_position_embeddings): pass --seq-len")
    return ctx


def config_vocab_size(config_json: Path) -> int | None:
    """``vocab_size`` of a model config (None when absent or not a positive integer)."""
    if not config_json.is_file():
        return None
    cfg = read_json(config_json, "model config")
    got = cfg.get("vocab_size") if isinstance(cfg, dict) else None
    return got if type(got) is int and got > 0 else None


def check_checkpoints(source: Source, tags: list[str]) -> None:
    """Every file the tools load from checkpoints ``tags`` (:data:`CHECKPOINT_FILES`) is
    whole, read without loading a tensor: a tool calls this before it writes anything, so a
    cut weights or optimizer file is one line naming it, not a loader's error later.

    Raises:
        InputFileError: a checkpoint folder is missing, or one of its files is empty, cut
            or damaged (named).
    """
    for tag in tags:
        check_checkpoint(source.folder(tag), f"checkpoint '{tag}'",
                         "copy the checkpoint again, or choose other checkpoints with "
                         "--checkpoints", only=CHECKPOINT_FILES)
