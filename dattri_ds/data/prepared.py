"""A prepared corpus on disk, opened memory-mapped: the files of a prefix and their reader.

``dattri-ds prepare --output-prefix PREFIX`` writes, next to each other (``PreparedPaths``):

* ``PREFIX.bin`` / ``PREFIX.idx``: megatron-core's indexed dataset (``IndexedDatasetBuilder``),
  one sequence per document, in corpus order;
* ``PREFIX.docs/``: the document table (:mod:`dattri_ds.data.doctable`);
* ``PREFIX.tokenizer/``: a copy of the tokenizer (``tokenizers.load_saved``);
* ``PREFIX.manifest.json``: written last, when everything else is complete (``MANIFEST_KEYS``);
* ``PREFIX.prepare/``: prepare's work folder, present only while a prepare is unfinished;
* ``PREFIX.indices/``: the training dataset's cached indices (``dattri_ds.data.packed``).

:func:`open_prepared` reads a prefix with a manifest, refuses one whose prepare did not
finish, and accepts a Megatron-LM prefix (``.bin`` + ``.idx`` written by megatron-core's own
builder, no manifest) as it is: its document ``d`` is named ``<name>:doc-<d>`` (``<name>``:
the prefix's file name), and ``<name>:doc-<d>/seq-<j>`` for sequence ``j`` of a document
that has several.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dattri_ds.errors import InputFileError

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST_KEYS", "PreparedPaths", "PreparedCorpus",
           "open_prepared", "fingerprint_of"]

FORMAT = "dattri-ds prepared corpus"
#: Bump when the files' layout or the document rule changes (readers refuse other versions).
FORMAT_VERSION = 1
#: The keys every manifest has (see docs/data.md for each).
MANIFEST_KEYS = ("format", "format_version", "fingerprint", "request", "inputs", "fields",
                 "ids", "tokenizer", "document_rule", "dtype", "documents", "tokens", "files")
_RERUN = "rerun dattri-ds prepare with the same --output-prefix (it resumes)"


def fingerprint_of(obj: Any) -> str:
    """The BLAKE2b-128 hex digest of ``obj`` as canonical JSON."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class PreparedPaths:
    """Every path of a prefix (see the module docstring)."""

    prefix: Path

    @classmethod
    def of(cls, prefix: str | os.PathLike) -> PreparedPaths:
        p = str(prefix)
        for ext in (".bin", ".idx", ".manifest.json"):  # a file of the prefix names it too
            if p.endswith(ext):
                p = p[: -len(ext)]
        return cls(Path(p))

    def _with(self, suffix: str) -> Path:
        return self.prefix.with_name(self.prefix.name + suffix)

    @property
    def name(self) -> str:
        return self.prefix.name

    bin = property(lambda self: self._with(".bin"))
    idx = property(lambda self: self._with(".idx"))
    docs = property(lambda self: self._with(".docs"))
    tokenizer = property(lambda self: self._with(".tokenizer"))
    manifest = property(lambda self: self._with(".manifest.json"))
    work = property(lambda self: self._with(".prepare"))
    indices = property(lambda self: self._with(".indices"))


def _megatron_dataset(paths: PreparedPaths):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from dattri_ds.io.files import check_file

    fix = "pass the prefix of a .bin/.idx pair (or rerun dattri-ds prepare)"
    check_file(paths.idx, "indexed dataset index", fix)
    if not paths.bin.exists():
        raise InputFileError(f"indexed dataset index '{paths.idx}' has no data file "
                             f"'{paths.bin}' beside it. Fix: copy the .bin next to the .idx "
                             f"(same prefix), or rerun dattri-ds prepare")
    check_file(paths.bin, "indexed dataset data", fix)
    with open(paths.idx, "rb") as fh:
        head = fh.read(9)
    if head != b"MMIDIDX\x00\x00":
        raise InputFileError(f"indexed dataset index '{paths.idx}' is not a megatron-core .idx "
                             f"file (no MMIDIDX header). Fix: {fix}")
    ds = _open_indexed(IndexedDataset, paths, fix)
    lengths, pointers = ds.sequence_lengths, ds.index.sequence_pointers
    if len(lengths) and int(pointers[-1]) + int(lengths[-1]) * ds.index.dtype_size > \
            paths.bin.stat().st_size:
        raise InputFileError(f"indexed dataset data '{paths.bin}' is shorter than its .idx "
                             f"says (cut off?). Fix: {fix}")
    return ds


def _open_indexed(cls: Any, paths: PreparedPaths, fix: str) -> Any:
    """``cls(prefix, mmap=True)``; a pair it cannot read is one line naming both files (a
    half-built reader's ``__del__`` would print its own AttributeError: silenced)."""
    hook, sys.unraisablehook = sys.unraisablehook, lambda _: None
    try:
        try:
            return cls(str(paths.prefix), mmap=True)
        except (AssertionError, ValueError, OSError) as e:
            why = " ".join(str(e).split())[:80] or type(e).__name__
        gc.collect()  # the half-built reader, unreferenced once the exception is gone
    finally:
        sys.unraisablehook = hook
    raise InputFileError(f"indexed dataset '{paths.idx}' / '{paths.bin}' is damaged ({why}). "
                         f"Fix: {fix}")


class PreparedCorpus:
    """One prefix, memory-mapped: tokens of each document, and its id, source and title.

    Attributes:
        paths: its files.
        manifest: the manifest (None for a Megatron-LM prefix).
        dataset: megatron-core's ``IndexedDataset`` over ``.bin``/``.idx``.
        table: the document table (None for a Megatron-LM prefix).
        lengths: int32 ``[N]`` tokens per document (sequence), memory-mapped.
    """

    def __init__(self, paths: PreparedPaths, manifest: dict | None, dataset, table) -> None:
        self.paths, self.manifest, self.dataset, self.table = paths, manifest, dataset, table
        self.lengths = dataset.sequence_lengths
        self._doc_of_seq: np.ndarray | None = None

    @property
    def name(self) -> str:
        return self.paths.name

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def n_tokens(self) -> int:
        if self.table is not None:
            return int(self.table.tokens[-1])
        return int(np.sum(self.lengths, dtype=np.int64))

    @property
    def fingerprint(self) -> str:
        """The manifest's fingerprint; for a Megatron-LM prefix, a hash of its ``.idx`` bytes
        and ``.bin`` size (``megatron-`` prefixed)."""
        if self.manifest is not None:
            return str(self.manifest["fingerprint"])
        h = hashlib.blake2b(digest_size=16)
        with open(self.paths.idx, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
        h.update(str(self.paths.bin.stat().st_size).encode())
        return "megatron-" + h.hexdigest()

    @property
    def pad_id(self) -> int:
        """The id written at padding positions (masked): the tokenizer's, 0 for Megatron."""
        return int(self.manifest["tokenizer"]["pad_id"]) if self.manifest else 0

    def tokens(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """Tokens ``[start, end)`` of document ``doc`` (a view of the memory map)."""
        end = int(self.lengths[doc]) if end is None else end
        return self.dataset.get(int(doc), offset=int(start), length=int(end - start))

    def doc_id(self, doc: int) -> str:
        if self.table is not None:
            return self.table.id(int(doc))
        seqs = self.dataset.document_indices
        if len(seqs) == len(self) + 1:  # one sequence per document
            return f"{self.name}:doc-{int(doc)}"
        if self._doc_of_seq is None:
            self._doc_of_seq = np.asarray(seqs)
        d = int(np.searchsorted(self._doc_of_seq, doc, side="right")) - 1
        first, end = int(self._doc_of_seq[d]), int(self._doc_of_seq[d + 1])
        return f"{self.name}:doc-{d}" if end - first == 1 else \
            f"{self.name}:doc-{d}/seq-{int(doc) - first}"

    def find(self, doc_id: str) -> int | None:
        """The document (sequence) named ``doc_id`` (:meth:`doc_id`'s inverse), or None."""
        if self.table is not None:
            return self.table.find(doc_id)
        name, _, rest = doc_id.rpartition(":doc-")
        d, _, seq = rest.partition("/seq-")
        if name != self.name or not d.isdigit() or (seq and not seq.isdigit()):
            return None
        seqs, d = self.dataset.document_indices, int(d)  # [D + 1]: first sequence of each
        at = d if len(seqs) == len(self) + 1 else \
            int(seqs[d]) + int(seq or 0) if d < len(seqs) - 1 else len(self)
        return at if at < len(self) and self.doc_id(at) == doc_id else None

    def document(self, doc: int) -> dict[str, Any]:
        """``{"id", "source", "title", "tokens"}`` of document ``doc``."""
        t = self.table
        return {"id": self.doc_id(doc), "source": t.string("source", doc) if t else "",
                "title": t.string("title", doc) if t else "", "tokens": int(self.lengths[doc])}


def _read_manifest(paths: PreparedPaths) -> dict:
    from dattri_ds.io.files import read_json

    m = read_json(paths.manifest, "prepared corpus manifest", fix=_RERUN)
    missing = [k for k in MANIFEST_KEYS if not isinstance(m, dict) or k not in m]
    if missing:
        raise InputFileError(f"prepared corpus manifest '{paths.manifest}' lacks {missing}. "
                             f"Fix: {_RERUN}")
    if m["format"] != FORMAT or m["format_version"] != FORMAT_VERSION:
        raise InputFileError(f"prepared corpus manifest '{paths.manifest}' is format "
                             f"{m['format']!r} version {m['format_version']}; this dattri-ds "
                             f"reads {FORMAT!r} version {FORMAT_VERSION}. Fix: prepare the "
                             f"corpus again with this version")
    return m


def open_prepared(prefix: str | os.PathLike) -> PreparedCorpus:
    """Open a prepared prefix (or a Megatron-LM ``.bin``/``.idx`` prefix) memory-mapped.

    Raises:
        InputFileError: nothing at the prefix; a prepare that did not finish (the fix:
            rerun it); an ``.idx`` without its ``.bin``; a damaged or cut file; a manifest
            whose counts the files do not match.
    """
    from dattri_ds.data.doctable import DocumentTable

    paths = PreparedPaths.of(prefix)
    if os.path.islink(paths.manifest) and not paths.manifest.is_file():
        raise InputFileError(f"prepared corpus manifest '{paths.manifest}' is a link to nothing "
                             f"readable ({os.readlink(paths.manifest)}). Fix: restore the "
                             f"manifest prepare wrote, or {_RERUN}")
    if not paths.manifest.exists():
        if paths.work.exists():
            raise InputFileError(f"prepared corpus '{paths.prefix}' is not complete: prepare "
                                 f"did not finish (its work folder {paths.work} is there, no "
                                 f"manifest). Fix: {_RERUN}")
        if not paths.idx.exists() and not paths.bin.exists():
            raise InputFileError(f"no prepared corpus at '{paths.prefix}' (no "
                                 f"{paths.manifest.name}, {paths.idx.name} or "
                                 f"{paths.bin.name}). Fix: run dattri-ds prepare --output-prefix "
                                 f"{paths.prefix}, or pass the prefix of a Megatron .bin/.idx")
        return PreparedCorpus(paths, None, _megatron_dataset(paths), None)
    manifest = _read_manifest(paths)
    corpus = PreparedCorpus(paths, manifest, _megatron_dataset(paths), DocumentTable(paths.docs))
    n, t = len(corpus), corpus.n_tokens
    if (n, len(corpus.table), t) != (manifest["documents"],) * 2 + (manifest["tokens"],):
        raise InputFileError(f"prepared corpus '{paths.prefix}': its files hold {n} documents "
                             f"({len(corpus.table)} in the table) and {t} tokens, the manifest "
                             f"says {manifest['documents']} and {manifest['tokens']}. Fix: "
                             f"{_RERUN} --overwrite")
    return corpus
