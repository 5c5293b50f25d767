"""Hugging Face model folders as a tool source: ``HFModelDir`` and its tokenizer.

* ``HFModelDir``: a ``save_pretrained`` folder (``config.json`` + ``model.safetensors`` or
  ``pytorch_model.bin``), loaded with ``AutoModelForCausalLM.from_pretrained`` (tied
  weights such as GPT-2's ``lm_head`` are restored by transformers). It is one checkpoint,
  tagged with the folder's name; ``seq_len`` is the model's context.
* ``HFTokenizer``: an ``AutoTokenizer`` from a local folder behind the interface
  ``tokenize_documents`` needs (``encode_batch``, special ids, ``fingerprint``).

Errors name the folder, the file that is missing and the flag that fixes it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dattri_ds.data.tokenizers import hash_files
from dattri_ds.io import files
from dattri_ds.errors import ConfigError
from dattri_ds.io.files import HF_WEIGHTS
from dattri_ds.io.tokenizer_files import load_hf_tokenizer
from dattri_ds.tools.provenance import DataOrigin
from dattri_ds.tools.sources.base import config_vocab_size, pick_tags, required_context

__all__ = ["HFModelDir", "HFTokenizer", "NoRunRecords", "is_hf_model_dir", "hf_tokenizer_dir",
           "load_hf_model", "HF_TOKENIZER_FILES"]

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                      "vocab.json")


def is_hf_model_dir(path: Path) -> bool:
    """A ``save_pretrained`` folder: ``config.json`` and weights."""
    return (path / "config.json").exists() and any((path / w).exists() for w in HF_WEIGHTS)


def hf_tokenizer_dir(*candidates: Path | None) -> Path | None:
    """The first folder holding Hugging Face tokenizer files, or None."""
    for c in candidates:
        if c is not None and any((c / f).exists() for f in HF_TOKENIZER_FILES[:2]):
            return c
    return None


class HFTokenizer:
    """A local ``AutoTokenizer`` as the tools' tokenizer (``tokenize_documents`` interface).

    ``bos_id`` is None for tokenizers without a BOS token (nothing is prepended); pads use
    ``pad_token_id``, else ``eos_token_id``, else 0 (pads are masked in any case).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self._tok = load_hf_tokenizer(path, "tokenizer folder", "pass a folder holding "
                                      "tokenizer.json (or tokenizer_config.json + vocab "
                                      "files), e.g. saved with tokenizer.save_pretrained(path)")
        self.path = Path(path)
        tok = self._tok
        self.bos_id = tok.bos_token_id
        self.eos_id = tok.eos_token_id
        self.pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
        self.vocab_size = len(tok)
        found = [self.path / f for f in HF_TOKENIZER_FILES + ("special_tokens_map.json",
                                                             "merges.txt")
                 if (self.path / f).exists()]
        self.fingerprint = "hf-" + hash_files(found)

    def encode_batch(self, texts) -> list[list[int]]:
        return [self._tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


class NoRunRecords:
    """What Hugging Face folders do not record (no launch/train.py run): a run id for the
    stores, the training documents (``Source.training_record``)."""

    @property
    def run_id(self) -> None:
        return None

    def training_record(self) -> DataOrigin | None:
        return None


@dataclass(frozen=True)
class HFModelDir(NoRunRecords):
    """A Hugging Face causal LM folder used as a one-checkpoint "run" by the tools.

    Attributes:
        root: the ``save_pretrained`` folder.
        tokenizer_path: where the tokenizer lives (default: ``root`` if it holds one).
    """

    root: Path
    tokenizer_path: Path | None = None

    @staticmethod
    def open(path: str | os.PathLike,
             tokenizer: str | os.PathLike | None = None) -> HFModelDir:
        root = files.model_dir(path, "--model", "pass a folder written by "
                               "model.save_pretrained(path), or --run with a launch/train.py run")
        tok = Path(tokenizer) if tokenizer else hf_tokenizer_dir(root)
        return HFModelDir(root, tok)

    @property
    def tag(self) -> str:
        return self.root.resolve().name

    @property
    def context(self) -> int:
        return required_context(self.root / "config.json")

    @property
    def seq_len(self) -> int:
        """The model's context (``--seq-len`` overrides it in the tools)."""
        return self.context

    @property
    def vocab_size(self) -> int | None:
        return config_vocab_size(self.root / "config.json")

    def tokenizer(self) -> HFTokenizer:
        if self.tokenizer_path is None:
            raise ConfigError(
                f"'{self.root}' holds no tokenizer ({' / '.join(HF_TOKENIZER_FILES[:2])}): pass "
                f"--tokenizer FOLDER, or give token-id jsonl data ({{\"input_ids\": [...]}} "
                f"per line)")
        return HFTokenizer(self.tokenizer_path)

    def trajectory(self) -> list[dict]:
        """One entry; its step and learning rate are unknown (None): a model folder records
        neither, and no stand-in is assumed."""
        return [{"tag": self.tag, "step": None, "lr": None}]

    def checkpoint(self, tag: str) -> dict:
        """The entry of ``tag``, read by lr-weighted scores: its learning rate is unknown.

        Raises:
            ConfigError: ``tag`` is not this model, or (always) its learning rate is unknown,
                naming the flags that supply it or score without it.
        """
        self._check_tag(tag)
        raise ConfigError(
            f"The learning rate of '{self.root}' is unknown (a model folder records neither "
            f"its step nor its learning rate), and lr-weighted scores need it. Fix: pass the "
            f"folder as --checkpoints {self.root} --lrs LR (and --steps STEP), or score "
            f"without lr weighting (attribute --weighting uniform or normalized)")

    def _check_tag(self, tag: str) -> None:
        if tag != self.tag:
            raise ConfigError(f"'{self.root}' is a single model (tag '{self.tag}'), not "
                              f"checkpoint '{tag}'")

    def tags(self, wanted: str | None) -> list[str]:
        return pick_tags([self.tag], wanted, self._check_tag)

    def default_tags(self, tool_default: str) -> str:
        return tool_default

    def folder(self, tag: str) -> Path:
        """The model folder itself (it is its one checkpoint)."""
        self._check_tag(tag)
        return self.root

    def fingerprint(self) -> str:
        found = [self.root / "config.json"]
        if self.tokenizer_path is not None:
            found += [self.tokenizer_path / f for f in HF_TOKENIZER_FILES
                      if (self.tokenizer_path / f).exists()]
        return f"model:{hash_files(found)}"

    def model(self, tag: str, device: torch.device | str = "cpu"):
        """The model in fp32, eval mode (dropout off)."""
        self._check_tag(tag)
        return load_hf_model(self.root, device)


def load_hf_model(folder: Path, device: torch.device | str = "cpu"):
    """The causal LM of a ``save_pretrained`` folder (checked by ``files.model_dir`` when
    its source was opened), fp32, eval mode (dropout off); what transformers raises on whole
    files it cannot use (e.g. weights of other shapes than the config's) names the folder.
    """
    from transformers import AutoModelForCausalLM

    with files.read_by("transformers' AutoModelForCausalLM", folder, "model folder",
                       "pass a folder written by model.save_pretrained(path)"):
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.to(device).eval()
