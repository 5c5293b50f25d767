"""The training data a tool reads: jsonl documents or prepared data, behind one interface.

* ``JsonlData`` (``--data``): jsonl documents (or token ids), one example per document, its
  first ``seq_len`` tokens (``tools.texts.load_texts``), tokenized by the source's tokenizer.
* ``PreparedData`` (``--data-path``): prepared data (``dattri-ds prepare``) read memory-mapped
  through ``PackedDataset``, with the examples and ids a training run on it has
  (``PackedDataset.example_id``: ``<document id>+<token offset>``); its tokenizer is the one
  the data was prepared with.

Both give what ``tools.gradients`` reads (``len``, ``seq_len``, ``batch``, ``docs[i].id``),
the store's ``data`` record (``record``: fingerprint, paths, seq_len, packing), the tokenizer
of queries and targets, each document's text hash (``text_hashes``: overlap checks), and the
one function reports read a store row's text through (``documents_of``: a jsonl document's
text; a window's tokens decoded). ``pool_texts`` is the pool ``curate`` reads
(``selection.curate.pool.PoolTexts``); ``open_data`` opens either kind.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from dattri_ds.data.doctable import hash64
from dattri_ds.data.packed import PackedDataset, parse_blend
from dattri_ds.data.prepared import PreparedPaths, fingerprint_of
from dattri_ds.data.read import hash_file
from dattri_ds.data.tokenizer import tokenize_documents
from dattri_ds.data.tokenizers import load_saved
from dattri_ds.errors import ConfigError, InputFileError
from dattri_ds.io import files
from dattri_ds.sample_id import SampleId
from dattri_ds.selection.curate.pool import JsonlTexts
from dattri_ds.tools.provenance import JSONL, PREPARED, TRUNCATED, DataOrigin
from dattri_ds.tools.sources import Source, source_flags
from dattri_ds.tools.subset import write_subset
from dattri_ds.tools.texts import is_token_file, load_texts, row_texts

__all__ = ["ToolData", "JsonlData", "PreparedData", "DocumentRule", "open_data", "source_data"]


class ToolData(Protocol):
    """What a tool asks of its training data, whatever its kind."""

    origin: DataOrigin
    seq_len: int

    def __len__(self) -> int: ...

    def batch(self, idx) -> dict[str, torch.Tensor]: ...

    @property
    def docs(self) -> Sequence: ...

    def record(self) -> dict:
        """The store's ``data`` record (``PackedDataset.record``'s keys: ``fingerprint``,
        ``tokenizer``, ``data_path``, ``seq_len``, ``packing``, ``seed``)."""

    def tokenizer(self):
        """The tokenizer queries and targets are read with (``tokenize_documents``'s)."""

    def documents_of(self, ids: Sequence[str]) -> dict[str, dict]:
        """``{id: {"id", "source", "title", "text"}}`` of the store ids (sample ids) found."""

    def texts_of(self, ids: Sequence[str]) -> list[str]:
        """The text each store row's example holds as the model read it (decoded)."""

    def text_hashes(self) -> np.ndarray:
        """``[D]`` uint64: each document's text hash (``doctable.hash64``)."""

    def check_texts(self) -> None:
        """Raise ConfigError (naming what lacks text and the fix) unless every row has a
        text (``texts_of``)."""

    def pool_texts(self, ids: Sequence[str]):
        """The ``PoolTexts`` of the store rows ``ids`` (curate's pool)."""


class DocumentRule:
    """A prepared data's tokenizer behind the interface ``tokenize_documents`` reads: a text
    is encoded by the data's document rule (``CorpusTokenizer.encode_documents``: its own
    special tokens, then EOS), as a document of the data is; nothing more is added."""

    bos_id = None
    eos_id = None

    def __init__(self, tok) -> None:
        self.tok, self.pad_id = tok, tok.pad_id
        self.vocab_size, self.fingerprint = tok.vocab_size, tok.fingerprint

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tok.encode_documents(list(texts))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def _missing(ids: Sequence[str], found, origin: DataOrigin) -> None:
    """Refuse store rows whose example is not in the data (the first named)."""
    gone = [i for i, f in zip(ids, found) if f < 0]
    if gone:
        raise ConfigError(f"{len(gone)} store row(s) have no example in {origin.flag} "
                          f"{' '.join(origin.files)} (e.g. '{gone[0]}'). Fix: pass "
                          f"{origin.flag} the data the store was collected from (with its "
                          f"--seq-len and --packing)")


# ---- jsonl ------------------------------------------------------------------------------------

@dataclass
class JsonlData:
    """jsonl documents (or token ids) as the tools read them (module docstring).

    Attributes:
        origin: where the files were named.
        seq_len: T, tokens per example.
        source_tokenizer: returns the source's tokenizer (called only for text files).
        vocab_size: token ids are checked to lie below it (None: unchecked).
    """

    origin: DataOrigin
    seq_len: int | None
    source_tokenizer: Callable[[], object] | None = None
    vocab_size: int | None = None

    @staticmethod
    def open(origin: DataOrigin, seq_len: int | None, *, source_tokenizer=None,
             vocab_size: int | None = None, model: str = "the model") -> JsonlData:
        """The jsonl files of ``origin``, tokenized (on first use) at ``seq_len``."""
        return JsonlData(origin, seq_len, source_tokenizer and cache(source_tokenizer),
                         vocab_size)

    @cached_property
    def data(self):
        """The tokenized rows (``TokenizedDocuments``)."""
        return load_texts(self.origin.data, self.tokenizer, self.seq_len, self.origin.max_docs,
                          vocab_size=self.vocab_size)

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, idx) -> dict[str, torch.Tensor]:
        return self.data.batch(idx)

    @property
    def docs(self):
        return self.data.docs

    def tokenizer(self):
        if self.source_tokenizer is None:
            raise ConfigError(f"--data {self.origin.data}: a tokenizer is needed to read "
                              f"these texts; pass the source (--run-dir / --model)")
        return self.source_tokenizer()

    def _tokens_fingerprint(self) -> str:
        return "token-ids" if is_token_file(self.origin.files[0]) else \
            self.tokenizer().fingerprint

    def record(self) -> dict:
        """Fingerprint: the files' contents (size, BLAKE2b: a moved or renamed file is the
        same data), the tokenizer, ``seq_len``."""
        return self._record

    @cached_property
    def _record(self) -> dict:
        for f in self.origin.files:
            files.check_file(f, "data file", "pass existing jsonl files of documents")
        inputs = [{"size": os.path.getsize(f), "blake2b": hash_file(f)}
                  for f in self.origin.files]
        fp = fingerprint_of({"files": inputs, "tokenizer": self._tokens_fingerprint(),
                             "seq_len": self.seq_len, "packing": TRUNCATED})
        return {"fingerprint": f"jsonl-{fp}", "tokenizer": self._tokens_fingerprint(),
                "data_path": [str(Path(f).resolve()) for f in self.origin.files],
                "seq_len": self.seq_len, "packing": TRUNCATED, "seed": None}

    def documents_of(self, ids: Sequence[str]) -> dict[str, dict]:
        """The documents by id (any JSON object with a string ``id`` per line; no tokenizer
        is needed; token-id rows without ``text`` say so)."""
        want = {SampleId.parse(i).doc for i in ids}
        fix = "pass the jsonl of documents the store was collected from"
        out, seen = {}, 0
        for one in self.origin.files:
            for n, d in files.iter_json_lines(one, "training data file",
                                              "one JSON object with an 'id' per line", fix):
                if not isinstance(d, dict) or not isinstance(d.get("id"), str):
                    raise InputFileError(f"training data file {one}:{n}: expected a JSON "
                                         f"object with a string 'id', got {str(d)[:60]}. "
                                         f"Fix: {fix}")
                seen += 1
                if d["id"] in want:
                    text = d.get("text") or ("(token ids, no text)" if "input_ids" in d
                                             else "(no text)")
                    out[d["id"]] = {"id": d["id"], "source": d.get("source", ""),
                                    "title": d.get("title", ""), "text": text}
        if not seen:
            raise InputFileError(f"training data file '{self.origin.data}' holds no "
                                 f"documents (it is empty or blank). Fix: {fix}")
        return out

    def _rows(self, ids: Sequence[str]) -> list[int]:
        by_id = {d.id: i for i, d in enumerate(self.data.docs)}
        rows = [by_id.get(SampleId.parse(i).doc, -1) for i in ids]
        _missing(ids, rows, self.origin)
        return rows

    def texts_of(self, ids: Sequence[str]) -> list[str]:
        return row_texts(self.data.subset(self._rows(ids)), self.tokenizer)

    def check_texts(self) -> None:
        """The files exist and hold text (token-id rows a ``text`` field too)."""
        for f in self.origin.files:
            files.check_file(f, "training data file", "pass an existing jsonl file of "
                             "documents")
            if not is_token_file(f):
                continue
            first = files.first_json_line(f, "training data file", "JSON lines",
                                          "--train-data")
            if not (isinstance(first, dict) and isinstance(first.get("text"), str)):
                raise ConfigError(f"the training rows of '{f}' are token ids without a "
                                  f"'text' field; pass --train-data a file whose rows carry "
                                  f"their text")

    def text_hashes(self) -> np.ndarray:
        """Hashes of every line's ``text`` (token-id rows: of their ``text`` field, if any);
        read without tokenizing."""
        return np.array([hash64(d["text"].encode("utf-8")) for f in self.origin.files
                         for _, d in files.iter_json_lines(f, "training data file", "JSON "
                                                           "lines", "pass jsonl documents")
                         if isinstance(d, dict) and isinstance(d.get("text"), str)],
                        dtype=np.uint64)

    def pool_texts(self, ids: Sequence[str]) -> JsonlTexts:
        return JsonlTexts.open(self.origin.files, ids, self._tokenize)

    def _tokenize(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self.tokenizer()
        d = tokenize_documents(list(texts), tok, self.seq_len, add_bos=tok.bos_id is not None,
                               add_eos=tok.eos_id is not None)
        b = d.batch(torch.arange(len(d)))
        return b["input_ids"], b["attention_mask"]


# ---- prepared data ----------------------------------------------------------------------------

@dataclass
class PreparedData:
    """Prepared data as the tools read it (module docstring): the first ``max_docs``
    examples of ``PackedDataset(paths, seq_len, packing=packing)``.

    Attributes:
        origin: where the data path was named (prefixes made absolute).
        dataset: the examples, memory-mapped.
        fallback: the source's tokenizer, for a Megatron-LM prefix (no tokenizer saved).
    """

    origin: DataOrigin
    dataset: PackedDataset
    fallback: Callable[[], object] | None = None
    _found: dict[str, int] = field(default_factory=dict, repr=False)
    _scanned: int = 0

    @staticmethod
    def open(origin: DataOrigin, seq_len: int | None, *, source_tokenizer=None,
             vocab_size: int | None = None, model: str = "the model") -> PreparedData:
        """Open the data path of ``origin`` at ``seq_len`` (packing: the origin's, else
        windows); a tokenizer larger than the model's ``vocab_size`` is refused.

        Raises:
            ConfigError: the data's vocabulary does not fit the model's embeddings (both
                sizes named), a bad data path.
            InputFileError: a prefix that is missing, unfinished or damaged.
        """
        if seq_len is None:
            raise ConfigError(f"--seq-len is needed to read --data-path "
                              f"{' '.join(origin.files)}: no record says the tokens per "
                              f"example. Fix: pass --seq-len N (as the store was collected)")
        prefixes, weights = parse_blend(origin.files)
        full = [str(PreparedPaths.of(p).prefix.resolve()) for p in prefixes]
        paths = full if weights is None else [x for w, p in zip(origin.files[0::2], full)
                                              for x in (w, p)]
        origin = DataOrigin(tuple(paths), origin.max_docs, seq_len, origin.where,
                            origin.record, PREPARED, origin.packing or "windows")
        data = PreparedData(origin, PackedDataset(paths, seq_len, packing=origin.packing),
                            source_tokenizer and cache(source_tokenizer))
        tok = data.manifest_tokenizer
        if vocab_size is not None and tok is not None and tok["vocab_size"] > vocab_size:
            raise ConfigError(
                f"--data-path {' '.join(paths)} was prepared with a tokenizer of "
                f"{tok['vocab_size']} ids ({tok['fingerprint']}), but {model} has vocab_size "
                f"{vocab_size}: its embeddings cannot read ids >= {vocab_size}. Fix: prepare "
                f"the corpus with the model's tokenizer (dattri-ds prepare --tokenizer "
                f"<the model's tokenizer>), or pass the model it was prepared for")
        return data

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    def __len__(self) -> int:
        n = len(self.dataset)
        return n if self.origin.max_docs is None else min(n, self.origin.max_docs)

    def batch(self, idx) -> dict[str, torch.Tensor]:
        return self.dataset.batch(idx)

    @property
    def docs(self):
        return self.dataset.docs

    @property
    def manifest_tokenizer(self) -> dict | None:
        """The manifest's tokenizer record of the (first) corpus; None for Megatron-LM."""
        m = self.dataset.corpora[0].manifest
        return m["tokenizer"] if m is not None else None

    @cached_property
    def corpus_tokenizer(self):
        """The tokenizer the data was prepared with (``CorpusTokenizer``), or None."""
        described = self.manifest_tokenizer
        return None if described is None else \
            load_saved(self.dataset.corpora[0].paths.tokenizer, described)

    def tokenizer(self):
        """The data's own tokenizer under its document rule; a Megatron-LM prefix (none
        saved) reads with the source's."""
        if self.corpus_tokenizer is not None:
            return DocumentRule(self.corpus_tokenizer)
        if self.fallback is None:
            raise ConfigError(f"--data-path {' '.join(self.origin.files)} is a Megatron-LM "
                              f"prefix with no tokenizer saved: pass the source "
                              f"(--run-dir / --model) whose tokenizer wrote it")
        return self.fallback()

    def record(self) -> dict:
        """``PackedDataset.record`` with the data's tokenizer (the manifest's; for a
        Megatron-LM prefix, the source's)."""
        tok = self.manifest_tokenizer
        return self.dataset.record(tok["fingerprint"] if tok is not None else
                                   self.tokenizer().fingerprint)

    def examples_of(self, ids: Sequence[str]) -> np.ndarray:
        """``[len(ids)]`` the example of each store id (-1: none), found by scanning the
        examples in order until every id is found (a collected or trained store holds the
        first examples: the scan stops there)."""
        want = {SampleId.parse(i).doc for i in ids} - set(self._found)
        n = len(self.dataset)
        while want and self._scanned < n:
            name = self.dataset.example_id(self._scanned)
            if name in want:
                self._found[name] = self._scanned
                want.discard(name)
            self._scanned += 1
        return np.array([self._found.get(SampleId.parse(i).doc, -1) for i in ids],
                        dtype=np.int64)

    def document(self, i: int) -> dict:
        """Example ``i`` as a report shows it: its id, its first document's source, the
        titles of its documents, and its tokens decoded (ids when no tokenizer is saved)."""
        ex = self.dataset.docs[int(i)]
        titles = {self.dataset.corpora[s.corpus].document(s.document)["title"]
                  for s in ex.spans} - {""}
        tok = self.corpus_tokenizer
        tokens = self.dataset.tokens(int(i)).tolist()
        text = tok.decode(tokens) if tok is not None else " ".join(map(str, tokens))
        return {"id": ex.id, "source": ex.source, "title": " / ".join(sorted(titles)),
                "text": text}

    def documents_of(self, ids: Sequence[str]) -> dict[str, dict]:
        found = self.examples_of(ids)
        return {SampleId.parse(s).doc: self.document(i) for s, i in zip(ids, found) if i >= 0}

    def texts_of(self, ids: Sequence[str]) -> list[str]:
        found = self.examples_of(ids)
        _missing(ids, found, self.origin)
        return [self.document(i)["text"] for i in found]

    def check_texts(self) -> None:
        """Tokens decode to text only with the tokenizer the data was prepared with."""
        if self.corpus_tokenizer is None:
            raise ConfigError(f"--data-path {' '.join(self.origin.files)} is a Megatron-LM "
                              f"prefix (token ids, no tokenizer saved): its rows have no text")

    def text_hashes(self) -> np.ndarray:
        """Every corpus's ``text_hash`` column (a Megatron-LM prefix has none)."""
        cols = [np.asarray(c.table.text_hash) for c in self.dataset.corpora
                if c.table is not None]
        return np.concatenate(cols) if cols else np.zeros(0, np.uint64)

    def pool_texts(self, ids: Sequence[str]) -> PreparedPool:
        found = self.examples_of(ids)
        _missing(ids, found, self.origin)
        return PreparedPool(self, found)


@dataclass(frozen=True)
class PreparedPool:
    """A pool of prepared examples (``PoolTexts``): row ``r`` is example ``examples[r]``.

    Sources are each example's first document's; tokens are read from the memory map (no
    tokenizing); the subset is written as a prepared prefix ``subset`` (``tools.subset``)."""

    data: PreparedData
    examples: np.ndarray

    @property
    def paths(self) -> tuple[str, ...]:
        return self.data.origin.files

    @cached_property
    def sources(self) -> tuple[str, ...]:
        return tuple(self.data.dataset.docs[int(i)].source for i in self.examples)

    def token_chunks(self, rows: Sequence[int], chunk: int = 256
                     ) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        rows = np.asarray(list(rows), dtype=np.int64)
        for a in range(0, len(rows), chunk):
            part = rows[a:a + chunk]
            b = self.data.batch(self.examples[part])
            yield part, b["input_ids"], b["attention_mask"]

    def documents(self, rows: Sequence[int]) -> dict[int, dict]:
        return {int(r): self.data.document(self.examples[int(r)]) for r in rows}

    def write_subset(self, out: Path, rows: np.ndarray) -> list[str]:
        return write_subset(self.data.dataset, self.examples[np.asarray(rows, np.int64)],
                            Path(out) / "subset")


# ---- opening ----------------------------------------------------------------------------------

def open_data(origin: DataOrigin, seq_len: int | None, *, source_tokenizer=None,
              vocab_size: int | None = None, model: str = "the model") -> ToolData:
    """The data ``origin`` names, read at ``seq_len`` (``source_tokenizer``: the source's
    tokenizer, for jsonl texts and Megatron-LM prefixes; ``vocab_size``: the model's)."""
    return KINDS[origin.kind].open(origin, seq_len, source_tokenizer=source_tokenizer,
                                   vocab_size=vocab_size, model=model)


def source_data(origin: DataOrigin, source: Source, args) -> ToolData:
    """``open_data`` for a tool reading ``source``: tokens per example ``--seq-len``, else the
    record's, else the source's; the source's tokenizer and vocabulary size."""
    return open_data(origin, args.seq_len or origin.seq_len or source.seq_len,
                     source_tokenizer=source.tokenizer, vocab_size=source.vocab_size,
                     model=source_flags(args))


#: ``DataOrigin.kind`` -> the class that reads it.
KINDS = {JSONL: JsonlData, PREPARED: PreparedData}
