"""A curated subset of prepared data, written as prepared data: ``launch/train.py --data-path
OUT/subset`` trains on it as it is.

The chosen examples' spans (``PackedDataset.spans``) are grouped by document and merged where
they touch or overlap, in (corpus, document, start) order; each merged span is one document
of the subset. Its tokens are copied from the pool's ``.bin`` (megatron-core's
``IndexedDatasetBuilder``), its row of the document table (``dattri_ds.data.doctable``: id,
source, title, hashes) from the pool's table: a whole document keeps its id and text hash, a
part of one is ``<id>+<start>`` (its first token's offset) with the hash of its tokens, which
no text equals. With several pool corpora an id is prefixed ``<corpus name>/``. The
tokenizer folder is copied and the manifest (``dattri_ds.data.prepared.MANIFEST_KEYS``, plus
``subset_of``: the pool data) is written last, so a reader never takes a half-written subset
as complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np

from dattri_ds.data.doctable import hash64, merge_parts
from dattri_ds.data.packed import PackedDataset
from dattri_ds.data.prepared import FORMAT, FORMAT_VERSION, PreparedPaths, fingerprint_of
from dattri_ds.io.outputs import fsync_dir, write_json_atomic

__all__ = ["write_subset", "merged_spans", "SUBSET_FILES"]

#: The files of the subset prefix ``subset`` in a curation's output folder.
SUBSET_FILES = ("subset.bin", "subset.idx", "subset.docs", "subset.tokenizer",
                "subset.manifest.json")
#: Documents per table part (one part is held in memory at a time).
_PART_DOCS = 4096
#: The tokenizer record of a subset of Megatron-LM prefixes (none was saved with them).
_NO_TOKENIZER = {"kind": None, "fingerprint": None, "vocab_size": None, "bos_id": None,
                 "eos_id": None, "pad_id": 0, "source": None}


def merged_spans(dataset: PackedDataset, examples: np.ndarray) -> np.ndarray:
    """``[K, 4]`` int64 rows ``(corpus, document, start, end)``: the examples' spans sorted
    and merged per document where they touch or overlap."""
    spans = np.array([(s.corpus, s.document, s.start, s.end) for i in examples.tolist()
                      for s in dataset.spans(int(i))], dtype=np.int64).reshape(-1, 4)
    spans = spans[np.lexsort((spans[:, 2], spans[:, 1], spans[:, 0]))]
    out: list[list[int]] = []
    for c, d, a, b in spans.tolist():
        if out and out[-1][0] == c and out[-1][1] == d and a <= out[-1][3]:
            out[-1][3] = max(out[-1][3], b)
        else:
            out.append([c, d, a, b])
    return np.array(out, dtype=np.int64).reshape(-1, 4)


def _strings(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets [n + 1], blob)`` of UTF-8 strings, as the table stores them."""
    raw = [v.encode("utf-8") for v in values]
    off = np.zeros(len(raw) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in raw], out=off[1:])
    return off, np.frombuffer(b"".join(raw), dtype=np.uint8)


def _row(dataset: PackedDataset, span) -> tuple[np.ndarray, dict, int]:
    """One subset document: its tokens, ``{id, source, title}`` and text hash."""
    c, d, a, b = (int(x) for x in span)
    corpus = dataset.corpora[c]
    tokens = corpus.tokens(d, a, b)
    doc = corpus.document(d)
    whole = a == 0 and b == int(corpus.lengths[d])
    name = doc["id"] if whole else f"{doc['id']}+{a}"
    if len(dataset.corpora) > 1:
        name = f"{corpus.name}/{name}"
    text_hash = int(corpus.table.text_hash[d]) if whole and corpus.table is not None else \
        hash64(b"tokens:" + np.asarray(tokens, dtype=np.int64).tobytes())
    return tokens, {"id": name, "source": doc["source"], "title": doc["title"]}, text_hash


def _write_part(path: Path, rows: list[tuple[np.ndarray, dict, int]]) -> None:
    """A document table part (``doctable.write_part``'s arrays) of these rows."""
    arrays: dict[str, np.ndarray] = {"lengths": np.array([len(t) for t, _, _ in rows],
                                                         dtype=np.int64)}
    for f in ("id", "source", "title"):
        arrays[f"{f}_offsets"], arrays[f"{f}_bytes"] = _strings([m[f] for _, m, _ in rows])
    arrays["id_hash"] = np.array([hash64(m["id"].encode("utf-8")) for _, m, _ in rows],
                                 dtype=np.uint64)
    arrays["text_hash"] = np.array([h for _, _, h in rows], dtype=np.uint64)
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def _build(dataset: PackedDataset, spans: np.ndarray, tmp: dict[str, Path]) -> int:
    """The ``.bin``/``.idx`` and the table under temporary names; returns the tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = dataset.corpora[0].dataset.index.dtype
    builder = IndexedDatasetBuilder(str(tmp["bin"]), dtype=dtype)
    tmp["work"].mkdir(parents=True, exist_ok=True)
    parts, tokens = [], 0
    for a in range(0, len(spans), _PART_DOCS):
        rows = [_row(dataset, s) for s in spans[a:a + _PART_DOCS]]
        for t, _, _ in rows:
            builder.add_document(np.asarray(t, dtype=dtype), [len(t)])
            tokens += len(t)
        parts.append(tmp["work"] / f"part-{len(parts):06d}.npz")
        _write_part(parts[-1], rows)
    builder.finalize(str(tmp["idx"]))
    merge_parts(parts, len(spans), tmp["docs"])
    for k in ("bin", "idx"):
        with open(tmp[k], "rb") as fh:
            os.fsync(fh.fileno())
    return tokens


def _manifest(dataset: PackedDataset, spans: np.ndarray, tokens: int, examples: int,
              paths: PreparedPaths) -> dict:
    first = dataset.corpora[0].manifest or {}
    corpora = [c.fingerprint for c in dataset.corpora]
    fp = fingerprint_of({"subset_of": corpora, "spans": hashlib.blake2b(
        spans.tobytes(), digest_size=16).hexdigest(), "format_version": FORMAT_VERSION})
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "fingerprint": fp, "request": fp,
        "inputs": [{"name": c.name, "path": str(c.paths.prefix), "format": "prepared",
                    "fingerprint": c.fingerprint} for c in dataset.corpora],
        "fields": first.get("fields", {}),
        "ids": "the pool's document ids; <id>+<start> for a part of a document",
        "tokenizer": first.get("tokenizer", _NO_TOKENIZER),
        "document_rule": first.get("document_rule", "megatron-core indexed dataset"),
        "dtype": np.dtype(dataset.corpora[0].dataset.index.dtype).name,
        "documents": int(len(spans)), "tokens": int(tokens),
        "chunks": -(-len(spans) // _PART_DOCS), "chunk_docs": _PART_DOCS,
        "files": {k: getattr(paths, k).name for k in ("bin", "idx", "docs", "tokenizer")},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "subset_of": {"fingerprint": dataset.fingerprint, "seq_len": dataset.seq_len,
                      "packing": dataset.packing, "examples": examples,
                      "corpora": [str(c.paths.prefix) for c in dataset.corpora]},
    }


def write_subset(dataset: PackedDataset, examples: np.ndarray, prefix: str | os.PathLike
                 ) -> list[str]:
    """Write the documents (and parts of documents) the ``examples`` of ``dataset`` cover as
    the prepared prefix ``prefix`` (module docstring); an earlier subset there is replaced
    (its manifest removed first, so its files never read as complete with the new ones).
    Returns the names written."""
    paths = PreparedPaths.of(prefix)
    spans = merged_spans(dataset, np.asarray(examples, dtype=np.int64))
    tmp = {k: paths.prefix.with_name(f".{paths.name}.{k}.{os.getpid()}.tmp")
           for k in ("bin", "idx", "docs", "tokenizer", "work")}
    try:
        tokens = _build(dataset, spans, tmp)
        source_tok = dataset.corpora[0].paths.tokenizer
        if source_tok.is_dir():
            shutil.copytree(source_tok, tmp["tokenizer"])
        paths.manifest.unlink(missing_ok=True)
        fsync_dir(paths.prefix.parent)
        for k in ("bin", "idx", "docs", "tokenizer"):
            final = getattr(paths, k)
            if final.is_dir():
                shutil.rmtree(final)
            if tmp[k].exists():
                os.replace(tmp[k], final)
        fsync_dir(paths.prefix.parent)
        write_json_atomic(paths.manifest, _manifest(dataset, spans, tokens, len(examples),
                                                    paths))
    finally:
        for left in tmp.values():  # whatever a failure left behind
            if left.is_dir():
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink(missing_ok=True)
    return [p.name for p in (paths.bin, paths.idx, paths.docs, paths.tokenizer,
                             paths.manifest) if p.exists()]
