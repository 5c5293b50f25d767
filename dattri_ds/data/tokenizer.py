"""SentencePiece tokenizer trained on the training texts, cached on disk, and fixed-length examples.

``train_tokenizer`` trains once per (texts, vocab size, model type, trainer options) and then
loads the cached ``.model``; ``Tokenizer`` has fixed special ids (pad 0, unk 1, bos 2, eos 3)
and a ``fingerprint`` of its bytes; ``tokenize_documents`` makes one padded example of ``T``
tokens per document. The trainer sees whole documents (newlines included; ``"\\n"`` is a
user-defined piece) with the identity normalization and no whitespace folding, so
``decode(encode(s)) == s`` for every text made of characters seen in training (code
indentation included). ``sentencepiece`` is imported inside the functions that need it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dattri_ds.data.corpus import Document
from dattri_ds.errors import ConfigError, InputFileError
from dattri_ds.io.outputs import write_atomic

__all__ = ["Tokenizer", "TokenizedDocuments", "train_tokenizer", "tokenize_documents",
           "default_cache_dir", "PAD_ID", "UNK_ID", "BOS_ID", "EOS_ID", "IGNORE_INDEX"]

logger = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
#: Label of positions without loss (the Hugging Face / PyTorch cross-entropy default).
IGNORE_INDEX = -100
MODEL_TYPES = ("bpe", "unigram", "char")
#: Bump when the trainer options below change: old cache entries are then not reused.
_CACHE_VERSION = "dattri-ds-spm-1"
#: Longest training "sentence" in bytes; longer documents are cut at line ends.
_MAX_SENTENCE_BYTES = 1 << 15

_TRAINER_OPTIONS = dict(
    pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
    user_defined_symbols=["\n"], normalization_rule_name="identity",
    remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
    character_coverage=1.0, max_sentence_length=_MAX_SENTENCE_BYTES,
)


def default_cache_dir() -> Path:
    """``$DATTRI_DS_CACHE`` or ``~/.cache/dattri_ds``."""
    env = os.environ.get("DATTRI_DS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dattri_ds"


class Tokenizer:
    """A trained SentencePiece model with fixed special ids.

    Args:
        model_proto: the serialized ``.model`` bytes.
        path: where the model is stored, if it is (informational).

    Picklable (it pickles the model bytes), so it can go to DataLoader workers.
    """

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(self, model_proto: bytes, path: str | os.PathLike | None = None) -> None:
        import sentencepiece as spm

        self._proto = bytes(model_proto)
        self.path = Path(path) if path is not None else None
        self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
        ids = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ConfigError(
                f"SentencePiece model {self.path or '(bytes)'} has special ids (pad, unk, bos, "
                f"eos) = {ids}; dattri-ds needs {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}. Train it "
                f"with dattri_ds.data.train_tokenizer")
        self.fingerprint = "spm-" + hashlib.blake2b(self._proto, digest_size=8).hexdigest()
        """Hash of the ``.model`` bytes: equal fingerprints = identical tokenizers."""

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a ``.model`` file written by ``train_tokenizer`` or ``save``.

        Raises:
            InputFileError: the file is missing, a folder, or not a SentencePiece model.
        """
        from dattri_ds.io.files import check_file

        p = check_file(path, "tokenizer", "pass the tokenizer.model a dattri-ds run wrote")
        try:
            return cls(p.read_bytes(), p)
        except RuntimeError as e:  # SentencePiece's parse error: the bytes are not a model
            raise InputFileError(f"tokenizer '{p}' is not a SentencePiece model (damaged or "
                                 f"another format: {' '.join(str(e).split())[:80]}). Fix: pass "
                                 f"the tokenizer.model a dattri-ds run wrote") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the ``.model`` bytes (atomically) and return the path."""
        path = Path(path)
        write_atomic(path, self._proto)
        return path

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, without bos/eos."""
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of many texts (one call into SentencePiece)."""
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of token ids; pad, bos and eos decode to nothing."""
        if torch.is_tensor(ids):
            ids = ids.tolist()
        return self._sp.decode(list(ids))

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(i)

    def __len__(self) -> int:
        return self.vocab_size

    def __getstate__(self) -> dict:
        return {"model_proto": self._proto, "path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_proto"], state["path"])

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, fingerprint='{self.fingerprint}')"


def _cache_key(texts: Sequence[str], vocab_size: int, model_type: str) -> str:
    h = hashlib.blake2b(digest_size=8)
    header = {"v": _CACHE_VERSION, "vocab_size": vocab_size, "model_type": model_type,
              "options": _TRAINER_OPTIONS}
    h.update(json.dumps(header, sort_keys=True).encode())
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    """Whole documents, cut at line ends only when longer than the trainer's limit."""
    for t in texts:
        if len(t.encode("utf-8")) < _MAX_SENTENCE_BYTES:
            yield t
            continue
        part: list[str] = []
        size = 0
        for line in t.splitlines(keepends=True):
            line = line[: _MAX_SENTENCE_BYTES // 8]  # at most half the limit in UTF-8 bytes
            n = len(line.encode("utf-8"))
            if part and size + n >= _MAX_SENTENCE_BYTES:
                yield "".join(part)
                part, size = [], 0
            part.append(line)
            size += n
        if part:
            yield "".join(part)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 1024, model_type: str = "bpe",
                    cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Train a SentencePiece model on ``texts``, or load it from the cache.

    Args:
        texts: training texts (e.g. ``[d.text for d in docs]``); order is part of the key.
        vocab_size: number of pieces, special ids included (default 1024).
        model_type: ``"bpe"`` (fast: about 0.5 s on 4.7 MB), ``"unigram"`` (about 20x
            slower) or ``"char"`` (one piece per character seen: the vocabulary is the
            character set plus the 4 special ids, at most ``vocab_size``).
        cache_dir: where trained models live (default ``default_cache_dir()``); the file is
            ``<cache_dir>/tokenizers/spm-<model_type>-<vocab_size>-<key>.model`` with ``key``
            a hash of (texts, vocab size, model type, trainer options).

    Returns:
        The tokenizer; ``tok.path`` is the cached file.

    Raises:
        ConfigError: an unknown model type, a vocabulary size below 8 or too large for the
            texts, or no non-empty text.
    """
    import sentencepiece as spm

    if model_type not in MODEL_TYPES:
        raise ConfigError(f"tokenizer model_type must be one of {MODEL_TYPES}, got '{model_type}'")
    if vocab_size < 8:
        raise ConfigError(f"tokenizer vocab_size must be >= 8, got {vocab_size}")
    texts = [t for t in texts if t]
    if not texts:
        raise ConfigError("train_tokenizer got no non-empty text")
    key = _cache_key(texts, vocab_size, model_type)
    path = Path(cache_dir or default_cache_dir()) / "tokenizers" / (
        f"spm-{model_type}-{vocab_size}-{key}.model")
    if path.is_file():
        logger.info("Reusing cached tokenizer %s", path)
        return Tokenizer.load(path)
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(texts), model_writer=buf, vocab_size=vocab_size,
            model_type=model_type, num_threads=2, minloglevel=2, **_TRAINER_OPTIONS)
    except RuntimeError as e:
        raise ConfigError(f"SentencePiece training failed for vocab_size={vocab_size} on "
                          f"{len(texts)} texts: {e}. Lower tokenizer vocab_size or give more "
                          f"text") from None
    write_atomic(path, buf.getvalue())
    logger.info("Trained %s tokenizer (vocab %d) on %d texts -> %s", model_type, vocab_size,
                len(texts), path)
    return Tokenizer.load(path)


@dataclass(frozen=True, eq=False)
class TokenizedDocuments:
    """Fixed-length causal-LM examples, one per document, with the documents kept alongside.

    Map-style dataset: ``ds[i]`` is ``{"input_ids", "attention_mask", "labels"}`` of ``[T]``
    tensors, so a plain ``DataLoader`` collates it into ``[B, T]`` model inputs.

    Attributes:
        input_ids: ``[N, T]`` int64, ``pad_id`` after the document's tokens.
        attention_mask: ``[N, T]`` int64, 1 on real tokens, 0 on pads.
        labels: ``[N, T]`` int64, ``input_ids`` on real tokens and -100 on pads (the model
            shifts them: position t predicts token t + 1).
        docs: the N documents, in row order.
        truncated: ``[N]`` bool, whether the document did not fit in T tokens.
        tokenizer_fingerprint: ``Tokenizer.fingerprint`` of the tokenizer used.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    docs: tuple[Document, ...]
    truncated: torch.Tensor
    tokenizer_fingerprint: str = field(default="")

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2 or shape[0] != len(self.docs):
            raise ConfigError(f"TokenizedDocuments: input_ids must be [N={len(self.docs)}, T], "
                              f"got {list(shape)}")
        for name in ("attention_mask", "labels"):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ConfigError(f"TokenizedDocuments: {name} must be {list(shape)} like "
                                  f"input_ids, got {list(got)}")

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def ids(self) -> list[str]:
        """Document ids, in row order."""
        return [d.id for d in self.docs]

    def __len__(self) -> int:
        return len(self.docs)

    def texts(self, tokenizer) -> list[str]:
        """The text each row holds (what the model reads): its real tokens decoded, padding
        dropped, by ``tokenizer.decode``."""
        return [tokenizer.decode(ids[mask.bool()].tolist())
                for ids, mask in zip(self.input_ids, self.attention_mask)]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i],
                "labels": self.labels[i]}

    def batch(self, idx: Sequence[int] | torch.Tensor | slice) -> dict[str, torch.Tensor]:
        """Model inputs ``[B, T]`` of the given rows."""
        rows = idx if isinstance(idx, slice) else torch.as_tensor(idx, dtype=torch.long)
        return {"input_ids": self.input_ids[rows], "attention_mask": self.attention_mask[rows],
                "labels": self.labels[rows]}

    def subset(self, idx: Sequence[int] | torch.Tensor) -> TokenizedDocuments:
        """The given rows as a new TokenizedDocuments (documents follow)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        b = self.batch(idx_t)
        return TokenizedDocuments(b["input_ids"], b["attention_mask"], b["labels"],
                                  tuple(self.docs[i] for i in idx_t.tolist()),
                                  self.truncated[idx_t], self.tokenizer_fingerprint)


def tokenize_documents(docs: Sequence[Document | str], tokenizer: Tokenizer, seq_len: int, *,
                       add_bos: bool = True, add_eos: bool = True) -> TokenizedDocuments:
    """One example of ``seq_len`` tokens per document (truncate, then pad).

    Row ``n`` is ``x = ([bos] + encode(text_n) + [eos])[:T]`` followed by ``T - len(x)``
    pads; ``attention_mask = 1`` and ``labels = x`` on the first ``len(x)`` positions,
    ``0`` and ``-100`` after. A prepared corpus's tokenizer (``CorpusTokenizer``, which has
    ``encode_documents``) gives ``x = encode_documents([text_n])[0][:T]`` instead: a
    document as the corpus stores it (``add_bos`` / ``add_eos`` do not apply).
    Deterministic: it depends only on the texts and the tokenizer.

    Args:
        docs: documents (plain strings become ``Document("text-<n>", "", "", s)``).
        tokenizer: the tokenizer.
        seq_len: T, at least 2 (one predicted token).
        add_bos: start each example with ``bos_id``.
        add_eos: end each example with ``eos_id`` (dropped when truncated).

    Returns:
        TokenizedDocuments with ``[N, T]`` tensors.

    Raises:
        ConfigError: ``seq_len < 2`` or an empty document list.
    """
    if seq_len < 2:
        raise ConfigError(f"seq_len must be >= 2 (one input and one predicted token), got {seq_len}")
    if not docs:
        raise ConfigError("tokenize_documents got no documents")
    doc_list = tuple(d if isinstance(d, Document) else Document(f"text-{i}", "", "", d)
                     for i, d in enumerate(docs))
    texts = [d.text for d in doc_list]
    head, tail = [tokenizer.bos_id] * add_bos, [tokenizer.eos_id] * add_eos
    encoded = tokenizer.encode_documents(texts) if hasattr(tokenizer, "encode_documents") \
        else [head + ids + tail for ids in tokenizer.encode_batch(texts)]
    n = len(doc_list)
    input_ids = torch.full((n, seq_len), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((n, seq_len), dtype=torch.long)
    truncated = torch.zeros(n, dtype=torch.bool)
    for i, x in enumerate(encoded):
        truncated[i] = len(x) > seq_len
        x = x[:seq_len]
        input_ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, : len(x)] = 1
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    return TokenizedDocuments(input_ids, mask, labels, doc_list, truncated, tokenizer.fingerprint)
