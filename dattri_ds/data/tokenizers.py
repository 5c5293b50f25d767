"""The tokenizers a corpus is prepared with: one small protocol, one class per kind.

* ``hf``: a Hugging Face tokenizer folder (``AutoTokenizer.from_pretrained(folder,
  local_files_only=True)``); ids equal ``AutoTokenizer(...)(text)["input_ids"]``.
* ``spm``: a SentencePiece ``.model`` file (any special ids).
* ``spm-trained``: a SentencePiece model trained once on a bounded sample of the corpus
  (:func:`dattri_ds.data.tokenizer.train_tokenizer`: pad 0, unk 1, bos 2, eos 3) and saved
  with the prepared dataset.

**The document rule** (:meth:`CorpusTokenizer.encode_documents`): a document's tokens are
the tokenizer's own ids for its text, with the special tokens the tokenizer itself adds
(:meth:`~CorpusTokenizer.encode_batch`: a Hugging Face tokenizer's post-processor, e.g.
Llama's BOS and none for GPT-2; a SentencePiece model's BOS when it has one, as
``tokenize_documents`` did), then one EOS appended unless the tokenizer already put one last.
So windows packed across documents see one EOS between two documents, as Megatron-LM's
``preprocess_data.py --append-eod`` writes them.

``transformers`` and ``sentencepiece`` are imported by the classes that use them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dattri_ds.io import files
from dattri_ds.errors import InputFileError
from dattri_ds.registry import Registry

__all__ = ["CorpusTokenizer", "HFTokenizerFolder", "SentencePieceFile", "TrainedSentencePiece",
           "TOKENIZERS", "open_tokenizer", "load_saved", "HF_TOKENIZER_FILES"]

#: The files of a Hugging Face tokenizer folder that are hashed into its fingerprint and
#: copied with a prepared dataset (the same set as ``tools/sources.py``'s ``HFTokenizer``).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                      "vocab.json", "special_tokens_map.json", "merges.txt")
_HF_FIX = "pass a folder written by tokenizer.save_pretrained(folder)"
_SPM_FIX = "pass a SentencePiece .model file"


class CorpusTokenizer:
    """What prepare needs of a tokenizer.

    Attributes:
        kind: its ``TOKENIZERS`` name.
        vocab_size: ids are in ``[0, vocab_size)``.
        bos_id: the BOS id, or None.
        eos_id: the id appended after each document.
        pad_id: the id of padding positions (masked: any id in the vocabulary).
        fingerprint: equal fingerprints = identical tokenizers.
        source: where it was loaded from.
    """

    kind: str
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    fingerprint: str
    source: Path

    def __init_subclass__(cls, name: str | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        TOKENIZERS.register_class(cls, name)
        if name is not None:
            cls.kind = name

    @classmethod
    def open(cls, path: str | os.PathLike) -> CorpusTokenizer:
        """Load one from ``path``.

        Raises:
            InputFileError: a missing, damaged or unusable tokenizer (one line, path named).
        """
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The tokenizer's own ids of each text, with the special tokens it adds itself."""
        raise NotImplementedError

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each document's stored tokens: :meth:`encode_batch`, then EOS unless already last
        (the module's document rule)."""
        out = self.encode_batch(texts)
        eos = self.eos_id
        for ids in out:
            if not ids or ids[-1] != eos:
                ids.append(eos)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def set_threads(self, n: int) -> None:
        """Threads one :meth:`encode_batch` call may use (default 1: prepare's workers are
        processes)."""

    def save(self, folder: str | os.PathLike) -> Path:
        """Copy the tokenizer into ``folder`` (created) so :func:`load_saved` reloads it with
        the same fingerprint; returns ``folder``."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The manifest's record of it: kind, fingerprint, vocabulary size, special ids,
        source."""
        return {"kind": self.kind, "fingerprint": self.fingerprint,
                "vocab_size": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "pad_id": self.pad_id, "source": str(self.source)}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(vocab_size={self.vocab_size}, "
                f"fingerprint='{self.fingerprint}')")


TOKENIZERS: Registry[type[CorpusTokenizer]] = Registry(
    "tokenizer kind", hint="register one with class X(CorpusTokenizer, name='x')")


def hash_files(paths: Sequence[Path]) -> str:
    """BLAKE2b (8 bytes) of the files' names and contents, in name order."""
    h = hashlib.blake2b(digest_size=8)
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


class HFTokenizerFolder(CorpusTokenizer, name="hf"):
    """A local Hugging Face tokenizer folder (fast or slow, any model type)."""

    def __init__(self, folder: Path, tok: Any) -> None:
        self.source, self._tok = folder, tok
        self.files = [folder / f for f in HF_TOKENIZER_FILES if (folder / f).is_file()]
        self.fingerprint = "hf-" + hash_files(self.files)
        self.vocab_size = len(tok)
        self.bos_id = tok.bos_token_id
        if tok.eos_token_id is None:
            raise InputFileError(f"tokenizer folder '{folder}' has no EOS token, which prepare "
                                 f"appends between documents. Fix: set eos_token (tokenizer."
                                 f"add_special_tokens({{'eos_token': ...}}) and save_pretrained)")
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id

    @classmethod
    def open(cls, path: str | os.PathLike) -> HFTokenizerFolder:
        folder = files.check_dir(path, "tokenizer folder", _HF_FIX)
        if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise InputFileError(f"tokenizer folder '{folder}' holds neither tokenizer.json nor "
                                 f"tokenizer_config.json. Fix: {_HF_FIX}")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "vocab.json"):  # a damaged JSON file is named by the file door
            if (folder / name).exists() or (folder / name).is_symlink():
                files.read_json(folder / name, "tokenizer file", fix=_HF_FIX)
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises OSError/ValueError/...
            first = " ".join(str(e).split())[:160]
            raise InputFileError(f"tokenizer folder '{folder}' cannot be loaded by transformers "
                                 f"AutoTokenizer ({type(e).__name__}: {first}). Fix: "
                                 f"{_HF_FIX}") from None
        return cls(folder, tok)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), return_attention_mask=False, verbose=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def set_threads(self, n: int) -> None:
        # the Rust tokenizer's own thread pool: off in forked workers (it is not fork-safe)
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if n > 1 else "false"

    def save(self, folder: str | os.PathLike) -> Path:
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        for f in self.files + [self.source / n for n in ("added_tokens.json",)
                               if (self.source / n).is_file()]:
            shutil.copyfile(f, out / f.name)
        return out


class SentencePieceFile(CorpusTokenizer, name="spm"):
    """A SentencePiece ``.model`` file; its ids are the model's own (pad, bos, eos as the
    model defines them; a model without EOS is refused)."""

    def __init__(self, proto: bytes, source: Path) -> None:
        import sentencepiece as spm

        self._proto, self.source, self._threads = bytes(proto), source, 1
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
        except RuntimeError as e:
            raise InputFileError(f"tokenizer '{source}' is not a SentencePiece model (damaged "
                                 f"or another format: {' '.join(str(e).split())[:80]}). Fix: "
                                 f"{_SPM_FIX}") from None
        sp = self._sp
        self.fingerprint = "spm-" + hashlib.blake2b(self._proto, digest_size=8).hexdigest()
        self.vocab_size = sp.get_piece_size()
        self.bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        if sp.eos_id() < 0:
            raise InputFileError(f"tokenizer '{source}' has no EOS piece, which prepare appends "
                                 f"between documents. Fix: train it with eos_id set")
        self.eos_id = sp.eos_id()
        self.pad_id = sp.pad_id() if sp.pad_id() >= 0 else self.eos_id

    @classmethod
    def open(cls, path: str | os.PathLike) -> SentencePieceFile:
        p = files.check_file(path, "tokenizer", _SPM_FIX)
        return cls(p.read_bytes(), p)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), add_bos=self.bos_id is not None,
                               num_threads=self._threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    def set_threads(self, n: int) -> None:
        self._threads = n

    def save(self, folder: str | os.PathLike) -> Path:
        from dattri_ds.io.outputs import write_atomic

        out = Path(folder)
        write_atomic(out / "tokenizer.model", self._proto)
        return out


class TrainedSentencePiece(SentencePieceFile, name="spm-trained"):
    """A SentencePiece model trained once on a sample of the corpus (``train``)."""

    trained: dict[str, Any] = {}

    @classmethod
    def train(cls, texts: Sequence[str], *, vocab_size: int, model_type: str,
              cache_dir: str | os.PathLike, sample: dict[str, Any]) -> TrainedSentencePiece:
        """Train on ``texts`` (cached under ``cache_dir`` by their hash).

        Args:
            sample: how the texts were drawn (recorded in :meth:`describe`).
        """
        from dattri_ds.data.tokenizer import train_tokenizer

        tok = train_tokenizer(texts, vocab_size=vocab_size, model_type=model_type,
                              cache_dir=cache_dir)
        out = cls.open(tok.path)
        out.trained = {"vocab_size": vocab_size, "model_type": model_type, **sample}
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "trained": dict(self.trained)}


def open_tokenizer(path: str | os.PathLike) -> CorpusTokenizer:
    """A tokenizer from a path: a folder is a Hugging Face tokenizer folder (or, holding
    only ``tokenizer.model``, the SentencePiece copy prepare keeps as ``PREFIX.tokenizer``),
    a file a SentencePiece model.

    Raises:
        InputFileError: missing, damaged or unusable (one line naming the path and the fix).
    """
    p = Path(path)
    if p.is_dir():
        spm = p / "tokenizer.model"
        if spm.is_file() and not any((p / f).is_file()
                                     for f in ("tokenizer.json", "tokenizer_config.json")):
            return SentencePieceFile.open(spm)
        return HFTokenizerFolder.open(p)
    return SentencePieceFile.open(p)


def load_saved(folder: str | os.PathLike, described: dict[str, Any]) -> CorpusTokenizer:
    """The tokenizer a prepared dataset saved in ``folder`` (:meth:`CorpusTokenizer.save`),
    of the kind its manifest ``described``.

    Raises:
        InputFileError: the saved copy is missing or damaged, or its fingerprint is not the
            recorded one.
    """
    kind = TOKENIZERS.lookup(str(described.get("kind")))
    target = Path(folder) if kind is HFTokenizerFolder else Path(folder) / "tokenizer.model"
    tok = kind.open(target)
    if isinstance(tok, TrainedSentencePiece):
        tok.trained = dict(described.get("trained") or {})
    if tok.fingerprint != described.get("fingerprint"):
        raise InputFileError(f"tokenizer '{target}' has fingerprint {tok.fingerprint}, but the "
                             f"dataset was prepared with {described.get('fingerprint')}. Fix: "
                             f"rerun prepare")
    return tok
