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
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dattri_ds.io import files
from dattri_ds.errors import ConfigError, InputFileError
from dattri_ds.io.files import HF_WEIGHTS

__all__ = ["HFModelDir", "HFTokenizer", "is_hf_model_dir", "hf_tokenizer_dir", "load_token_ids",
           "is_token_file", "model_context", "required_context", "vocab_size_of", "pick_tags",
           "load_hf_model", "HF_WEIGHTS", "HF_TOKENIZER_FILES"]

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
    cfg = files.read_json(config_json, "model config")
    if not isinstance(cfg, dict):
        raise InputFileError(f"model config '{config_json}' is a JSON {type(cfg).__name__}, "
                             f"expected an object. Fix: save the model with save_pretrained")
    got = cfg.get("n_positions") or cfg.get("max_position_embeddings") or cfg.get("n_ctx")
    return int(got) if got else None


def required_context(config_json: Path) -> int:
    """``model_context``, or a ConfigError naming the file and ``--seq-len``."""
    ctx = model_context(config_json)
    if ctx is None:
        raise ConfigError(f"{config_json} names no context length "
                          f"(n_positions / max_position_embeddings): pass --seq-len")
    return ctx


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

        self.path = files.check_dir(path, "--tokenizer folder", "pass a folder holding "
                                    "tokenizer.json (or tokenizer_config.json + vocab files)")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "vocab.json"):  # read through the door first: a damaged file is named
            if (self.path / name).exists() or (self.path / name).is_symlink():
                files.read_json(self.path / name, "tokenizer file",
                                fix="save the tokenizer again with save_pretrained(path)")
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
        found = [self.path / f for f in HF_TOKENIZER_FILES + ("special_tokens_map.json",
                                                             "merges.txt")
                 if (self.path / f).exists()]
        self.fingerprint = "hf-" + _hash_files(found)

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

    @property
    def run_id(self) -> None:
        """No training run: stores record no run id."""
        return None

    def fingerprint(self) -> str:
        found = [self.root / "config.json"]
        if self.tokenizer_path is not None:
            found += [self.tokenizer_path / f for f in HF_TOKENIZER_FILES
                      if (self.tokenizer_path / f).exists()]
        return f"model:{_hash_files(found)}"

    def model(self, tag: str, device: torch.device | str = "cpu"):
        """The model in fp32, eval mode (dropout off)."""
        self._check_tag(tag)
        return load_hf_model(self.root, device)


def load_hf_model(folder: Path, device: torch.device | str = "cpu"):
    """The causal LM of a ``save_pretrained`` folder, fp32, eval mode (dropout off)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.to(device).eval()


_TOKEN_EXPECTED = 'one {"id"?, "input_ids": [int, ...]} object per line'
_TOKEN_FIX = 'write one {"id": ..., "input_ids": [token ids]} object per line'


def is_token_file(path: str | os.PathLike) -> bool:
    """Whether a jsonl file holds token ids (its first record has ``input_ids``); read
    through :mod:`dattri_ds.io.files`, so a file that is not JSON lines is an InputFileError
    naming the file and line."""
    first = files.first_json_line(path, "data file", "one JSON object per line (documents "
                                  "with 'text', or token ids with 'input_ids')",
                                  "give a jsonl file of documents or of token ids")
    return isinstance(first, dict) and "input_ids" in first


def vocab_size_of(source) -> int | None:
    """``vocab_size`` in the model config of a Run or HFModelDir (or of its bound
    ``tokenizer`` method, which the tools pass around); None when unknown."""
    owner = getattr(source, "__self__", source)
    if type(getattr(owner, "vocab_size", None)) is int:  # a tokenizer
        return owner.vocab_size
    root = getattr(owner, "root", None)
    if root is None:
        return None
    for cfg_path in (Path(root) / "config.json", Path(root) / "model/config.json"):
        if cfg_path.is_file():
            cfg = files.read_json(cfg_path, "model config")
            got = cfg.get("vocab_size") if isinstance(cfg, dict) else None
            return got if type(got) is int and got > 0 else None
    return None


def _token_row(rec, p: Path, n: int, vocab_size: int | None) -> list[int]:
    ids = rec.get("input_ids") if isinstance(rec, dict) else None
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise InputFileError(f"token-id file {p}:{n}: expected \"input_ids\": a non-empty list "
                             f"of integer token ids, got {str(ids)[:60]}. Fix: {_TOKEN_FIX}")
    high = vocab_size if vocab_size is not None else float("inf")
    bad = next(((j, i) for j, i in enumerate(ids) if i < 0 or i >= high), None)
    if bad is not None:
        rng = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise InputFileError(
            f"token-id file {p}:{n}: token id {bad[1]} at position {bad[0]} is out of range "
            f"(expected {rng}{', the model vocab_size' if vocab_size is not None else ''}). "
            f"Fix: tokenize with the model's own tokenizer")
    return ids


def load_token_ids(path: str | os.PathLike, seq_len: int, max_docs: int | None = None,
                   vocab_size: int | None = None):
    """TokenizedDocuments from token-id jsonl: ``{"id"?, "input_ids": [int, ...]}`` per line.

    Rows longer than ``seq_len`` are truncated (``truncated`` is set); shorter ones are
    right-padded with 0 (masked). Ids default to ``tokens-<line>``.

    Raises:
        InputFileError: the file is unreadable or not JSON lines, a line without an
            ``input_ids`` list of ints, an id outside ``[0, vocab_size)`` (``>= 0`` when the
            vocabulary size is unknown), or no rows.
    """
    from dattri_ds.data import Document, TokenizedDocuments

    p = Path(path)
    rows, docs = [], []
    for n, rec in files.iter_json_lines(p, "token-id file", _TOKEN_EXPECTED, _TOKEN_FIX):
        rows.append(_token_row(rec, p, n, vocab_size))
        docs.append(Document(str(rec.get("id", f"tokens-{n - 1}")), str(rec.get("source", "")),
                             str(rec.get("title", "")), str(rec.get("text", ""))))
        if max_docs and len(rows) >= max_docs:
            break
    if not rows:
        raise InputFileError(f"token-id file '{p}' holds no token rows (it is empty or blank). "
                             f"Fix: {_TOKEN_FIX}")
    input_ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    truncated = torch.tensor([len(r) > seq_len for r in rows])
    for i, r in enumerate(rows):
        x = torch.tensor(r[:seq_len])
        input_ids[i, :len(x)], mask[i, :len(x)] = x, 1
    return TokenizedDocuments(input_ids, mask, input_ids.masked_fill(mask == 0, -100),
                              tuple(docs), truncated, "token-ids")
