"""Where the offline tools get a model, its tokenizer and their data: any causal LM folder.

* ``HFModelDir``: a ``save_pretrained`` folder (``config.json`` + ``model.safetensors`` or
  ``pytorch_model.bin``), loaded with ``AutoModelForCausalLM.from_pretrained`` (tied
  weights such as GPT-2's ``lm_head`` are restored by transformers). It is one checkpoint,
  tagged with the folder's name; ``seq_len`` is the model's context.
* ``HFTokenizer``: an ``AutoTokenizer`` from a local folder behind the interface
  ``tokenize_documents`` needs (``encode_batch``, special ids, ``fingerprint``).
* token-id jsonl (``{"id": ..., "input_ids": [...]}`` per line): data that needs no
  tokenizer at all (``load_token_ids``).

Errors name the folder, the file that is missing and the flag that fixes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dattri_ds.errors import ConfigError

__all__ = ["HFModelDir", "HFTokenizer", "is_hf_model_dir", "hf_tokenizer_dir", "load_token_ids",
           "is_token_file", "model_context", "required_context", "HF_WEIGHTS", "HF_TOKENIZER_FILES"]

HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
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


def model_context(config_json: Path) -> int | None:
    """The context length in a model config (``n_positions`` / ``max_position_embeddings``)."""
    cfg = json.loads(config_json.read_text())
    got = cfg.get("n_positions") or cfg.get("max_position_embeddings") or cfg.get("n_ctx")
    return int(got) if got else None


def required_context(config_json: Path) -> int:
    """``model_context``, or a ConfigError naming the file and ``--seq-len``."""
    ctx = model_context(config_json)
    if ctx is None:
        raise ConfigError(f"{config_json} names no context length "
                          f"(n_positions / max_position_embeddings): pass --seq-len")
    return ctx


def _hash_files(files: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for f in sorted(files):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


class HFTokenizer:
    """A local ``AutoTokenizer`` as the tools' tokenizer (``tokenize_documents`` interface).

    ``bos_id`` is None for tokenizers without a BOS token (nothing is prepended); pads use
    ``pad_token_id``, else ``eos_token_id``, else 0 (pads are masked in any case).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from transformers import AutoTokenizer

        self.path = Path(path)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.path))
        except Exception as exc:  # transformers raises OSError/ValueError/... by backend
            raise ConfigError(f"Could not load a Hugging Face tokenizer from '{self.path}': "
                              f"{exc}. Pass --tokenizer with a folder holding tokenizer.json "
                              f"(or tokenizer_config.json + vocab files)") from exc
        tok = self._tok
        self.bos_id = tok.bos_token_id
        self.eos_id = tok.eos_token_id
        self.pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
        self.vocab_size = len(tok)
        files = [self.path / f for f in HF_TOKENIZER_FILES + ("special_tokens_map.json",
                                                             "merges.txt")
                 if (self.path / f).exists()]
        self.fingerprint = "hf-" + _hash_files(files)

    def encode_batch(self, texts) -> list[list[int]]:
        return [self._tok(t, add_special_tokens=False)["input_ids"] for t in texts]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


@dataclass(frozen=True)
class HFModelDir:
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
        root = Path(path)
        if not root.is_dir():
            raise ConfigError(f"Model folder '{root}' does not exist")
        if not is_hf_model_dir(root):
            have = sorted(p.name for p in root.iterdir())[:10]
            raise ConfigError(
                f"'{root}' is not a Hugging Face model folder: it needs config.json and one of "
                f"{list(HF_WEIGHTS)} (it holds {have}); save one with "
                f"model.save_pretrained(path), or pass --run with a launch/train.py run")
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

    def tokenizer(self) -> HFTokenizer:
        if self.tokenizer_path is None:
            raise ConfigError(
                f"'{self.root}' holds no tokenizer ({' / '.join(HF_TOKENIZER_FILES[:2])}): pass "
                f"--tokenizer FOLDER, or give token-id jsonl data ({{\"input_ids\": [...]}} "
                f"per line)")
        return HFTokenizer(self.tokenizer_path)

    def trajectory(self) -> list[dict]:
        return [{"tag": self.tag, "step": 0, "lr": 1.0}]

    def checkpoint(self, tag: str) -> dict:
        if tag != self.tag:
            raise ConfigError(f"'{self.root}' is a single model (tag '{self.tag}'), not "
                              f"checkpoint '{tag}'")
        return self.trajectory()[0]

    def tags(self, wanted: str | None) -> list[str]:
        if wanted in (None, "all", "last"):
            return [self.tag]
        return [self.checkpoint(t.strip())["tag"] for t in wanted.split(",") if t.strip()]

    @property
    def run_id(self) -> None:
        """No training run: stores record no run id."""
        return None

    def fingerprint(self) -> str:
        files = [self.root / "config.json"]
        if self.tokenizer_path is not None:
            files += [self.tokenizer_path / f for f in HF_TOKENIZER_FILES
                      if (self.tokenizer_path / f).exists()]
        return f"model:{_hash_files(files)}"

    def model(self, tag: str, device: torch.device | str = "cpu"):
        """The model in fp32, eval mode (dropout off)."""
        from transformers import AutoModelForCausalLM

        self.checkpoint(tag)
        model = AutoModelForCausalLM.from_pretrained(str(self.root), dtype=torch.float32)
        return model.to(device).eval()


def is_token_file(path: str | os.PathLike) -> bool:
    """Whether a jsonl file holds token ids (its first record has ``input_ids``)."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                return "input_ids" in json.loads(line)
    return False


def load_token_ids(path: str | os.PathLike, seq_len: int, max_docs: int | None = None):
    """TokenizedDocuments from token-id jsonl: ``{"id"?, "input_ids": [int, ...]}`` per line.

    Rows longer than ``seq_len`` are truncated (``truncated`` is set); shorter ones are
    right-padded with 0 (masked). Ids default to ``tokens-<line>``.

    Raises:
        ConfigError: a line without an ``input_ids`` list of ints, or no rows.
    """
    from dattri_ds.data import Document, TokenizedDocuments

    p = Path(path)
    rows, docs = [], []
    with open(p, encoding="utf-8") as fh:
        for n, line in enumerate(fh):
            if not line.strip():
                continue
            rec = json.loads(line)
            ids = rec.get("input_ids")
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                raise ConfigError(f"{p}:{n + 1}: expected \"input_ids\": a non-empty list of "
                                  f"token ids, got {str(ids)[:60]}")
            rows.append(ids)
            docs.append(Document(str(rec.get("id", f"tokens-{n}")), str(rec.get("source", "")),
                                 str(rec.get("title", "")), str(rec.get("text", ""))))
            if max_docs and len(rows) >= max_docs:
                break
    if not rows:
        raise ConfigError(f"'{p}' holds no token rows")
    input_ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    truncated = torch.tensor([len(r) > seq_len for r in rows])
    for i, r in enumerate(rows):
        x = torch.tensor(r[:seq_len])
        input_ids[i, :len(x)], mask[i, :len(x)] = x, 1
    return TokenizedDocuments(input_ids, mask, input_ids.masked_fill(mask == 0, -100),
                              tuple(docs), truncated, "token-ids")
