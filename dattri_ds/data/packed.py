"""The training dataset over prepared corpora: ``seq_len``-token examples, memory-mapped, each
with its provenance.

:class:`PackedDataset` reads one or several prefixes (:func:`open_prepared`; Megatron's blend
form ``["0.7", "A", "0.3", "B"]`` weights them) and presents the interface the training loop
uses (``len``, ``seq_len``, ``batch(idx)`` like ``TokenizedDocuments.batch``) without loading
the data: the tokens stay in the ``.bin`` memory map, the indices below are ``.npy`` files
opened with ``mmap_mode="r"``.

**Examples** (``packing``):

* ``"windows"`` (default), as megatron-core's ``GPTDataset``: the *document index* is the
  documents in a seeded order (``numpy.random.RandomState(seed).shuffle`` of ``arange(N)``,
  int32), the *sample index* ``[S + 1, 2]`` holds where each window starts and ends
  (position in the document index, token offset), the *shuffle index* ``[S]`` is a seeded
  permutation of the windows (the same RandomState, next). Windows are ``seq_len`` tokens of
  the concatenated documents, not overlapping, ``S = ceil(tokens / seq_len)``; the last one
  is padded, so no token is dropped. Up to 2**24 tokens the three arrays equal those of
  ``GPTDataset(..., Split.valid)`` with ``add_extra_token_to_sequence=False`` and
  ``drop_last_partial_validation_sequence=False`` (tested). ``GPTDataset`` itself is not
  used: its train split drops the last partial window, its samples are Megatron's (shifted
  labels, ``loss_mask``; pads replaced by id 0), and its compiled ``build_sample_idx`` counts
  the samples with a float32 ``ceil`` when it keeps the last window, which drops the
  corpus's last tokens above 2**24 tokens (600,000,001 tokens at ``seq_len`` 512 give
  1,171,875 windows instead of 1,171,876). The sample index is built with numpy instead.
* ``"documents"``: each document cut into ``seq_len`` chunks (no packing across documents,
  the last chunk of each padded); the sample index ``[S, 2]`` holds (document, start).

The indices are built once (by rank 0 when ``torch.distributed`` is initialized; the other
ranks wait at a barrier) and cached in ``PREFIX.indices/`` (or ``cache_dir``) as
``<key>-{document,sample,shuffle}_index.npy`` and ``<key>-description.json`` (written last),
``key`` a hash of the corpus fingerprint, ``seq_len``, ``packing``, ``seed`` and the index
version. Several prefixes are blended with megatron-core's compiled blending helpers:
without weights every example of every corpus once (``build_exhaustive_blending_indices``),
with weights ``build_blending_indices`` over just enough examples that each corpus gives all
of its examples at least once (the more heavily weighted ones repeat: nothing is dropped).

**Provenance**: example ``i`` covers the spans :meth:`PackedDataset.spans` ``(corpus,
document, start, end)`` (token offsets inside the document, in window order);
:meth:`~PackedDataset.doc_ids` names their documents and :meth:`~PackedDataset.example_id`
names the example: ``<first document id>+<first token offset>``, prefixed by
``<corpus name>/`` when several corpora are read (the prefix's path when two share a name),
suffixed ``~<k>`` for the k-th repeat of an up-weighted corpus's example.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from dattri_ds.data.prepared import PreparedCorpus, fingerprint_of, open_prepared
from dattri_ds.errors import ConfigError, InputFileError

__all__ = ["PackedDataset", "Span", "Example", "PACKINGS", "INDEX_VERSION", "parse_blend",
           "window_indices", "document_indices", "dataset_fingerprint"]

PACKINGS = ("windows", "documents")
#: Bump when the indices' construction changes (the cache key includes it).
INDEX_VERSION = 1
_IGNORE = -100


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of document ``document`` of corpus ``corpus``."""

    corpus: int
    document: int
    start: int
    end: int


@dataclass(frozen=True)
class Example:
    """What ``PackedDataset.docs[i]`` tells about example ``i``: its id, the source and title
    of its first document, and its spans."""

    id: str
    source: str
    title: str
    spans: tuple[Span, ...]


# ---- indices (pure numpy) ------------------------------------------------------------------

def window_indices(lengths: np.ndarray, seq_len: int, seed: int) -> dict[str, np.ndarray]:
    """``{"document_index" [N] int32, "sample_index" [S + 1, 2], "shuffle_index" [S]}`` of
    non-overlapping ``seq_len`` windows over the documents in a seeded order (module
    docstring)."""
    rs = np.random.RandomState(seed)
    n = len(lengths)
    document_index = np.arange(n, dtype=np.int32)
    rs.shuffle(document_index)
    cum = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64)[document_index], out=cum[1:])
    total = int(cum[-1])
    s = -(-total // seq_len)
    bounds = np.minimum(np.arange(s + 1, dtype=np.int64) * seq_len, total)
    pos = np.maximum(np.searchsorted(cum, bounds, side="left") - 1, 0)
    dtype = np.int32 if max(n, int(np.max(lengths, initial=0))) <= np.iinfo(np.int32).max \
        else np.int64
    sample_index = np.stack([pos, bounds - cum[pos]], axis=1).astype(dtype)
    shuffle_index = np.arange(s, dtype=np.uint32 if s < np.iinfo(np.uint32).max - 1
                              else np.int64)
    rs.shuffle(shuffle_index)
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index}


def document_indices(lengths: np.ndarray, seq_len: int, seed: int) -> dict[str, np.ndarray]:
    """``{"sample_index" [S, 2] (document, start), "shuffle_index" [S]}``: each document cut
    into ``seq_len`` chunks (corpus order, then a seeded permutation)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    chunks = -(-lengths // seq_len)
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), chunks)
    first = np.repeat(np.cumsum(chunks) - chunks, chunks)
    start = (np.arange(len(doc), dtype=np.int64) - first) * seq_len
    shuffle_index = np.arange(len(doc), dtype=np.int64)
    np.random.RandomState(seed).shuffle(shuffle_index)
    return {"sample_index": np.stack([doc, start], axis=1), "shuffle_index": shuffle_index}


_BUILDERS = {"windows": window_indices, "documents": document_indices}


def dataset_fingerprint(corpora: Sequence[str], weights: Sequence[float] | None, seq_len: int,
                        packing: str, seed: int) -> str:
    """:attr:`PackedDataset.fingerprint` from its parts (known before the indices are built:
    the corpora's fingerprints are in their manifests)."""
    return fingerprint_of({"corpora": list(corpora), "weights": weights, "seq_len": seq_len,
                           "packing": packing, "seed": seed, "index_version": INDEX_VERSION})


def _rank() -> tuple[bool, bool]:
    """``(distributed, rank 0)``."""
    dist = torch.distributed
    on = dist.is_available() and dist.is_initialized()
    return on, (not on or dist.get_rank() == 0)


def _cached(folder: Path, key: str, description: dict, build) -> dict[str, np.ndarray]:
    """The arrays ``build()`` returns, saved once as ``folder/<key>-<name>.npy`` (rank 0,
    temporary name then rename; the description last) and memory-mapped."""
    desc = folder / f"{key}-description.json"
    dist_on, rank0 = _rank()
    if rank0 and not desc.exists():
        from dattri_ds.io.outputs import check_dir, write_atomic

        check_dir(folder, flag="the index cache (cache_dir)")
        arrays = build()
        for name, arr in arrays.items():
            tmp = folder / f".{key}-{name}.{os.getpid()}.npy"
            np.save(tmp, arr)
            os.replace(tmp, folder / f"{key}-{name}.npy")
        write_atomic(desc, json.dumps({**description, "arrays": sorted(arrays)}, indent=1))
        del arrays
    if dist_on:
        torch.distributed.barrier()
    try:
        names = json.loads(desc.read_text())["arrays"]
        return {n: np.load(folder / f"{key}-{n}.npy", mmap_mode="r", allow_pickle=False)
                for n in names}
    except (OSError, ValueError, KeyError) as e:
        raise InputFileError(f"index cache '{folder}' ({key}-*) is incomplete or damaged "
                             f"({' '.join(str(e).split())[:80]}). Fix: delete the "
                             f"{key}-* files there (they are rebuilt)") from None


# ---- the blend form --------------------------------------------------------------------------

def blend_weight(item: str) -> float | None:
    """The weight a data path item is (a number), or None for a prefix."""
    try:
        return float(item)
    except ValueError:
        return None


def parse_blend(data_path: Sequence[str | os.PathLike] | str | os.PathLike
                ) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: ``PREFIX [PREFIX ...]`` or ``W1 PREFIX1 W2 PREFIX2 ...``.

    Returns:
        The prefixes and the weights (normalized to sum 1), or None without weights.

    Raises:
        ConfigError: a mixed or odd list, or a weight that is not positive.
    """
    items = [str(data_path)] if isinstance(data_path, (str, os.PathLike)) else \
        [str(x) for x in data_path]
    if not items:
        raise ConfigError("the data path names no prefix. Fix: pass PREFIX [PREFIX ...] or "
                          "W1 PREFIX1 W2 PREFIX2 ...")

    firsts = [blend_weight(x) for x in items[0::2]]
    if all(w is None for w in firsts) and all(blend_weight(x) is None for x in items):
        return items, None
    if len(items) % 2 or any(w is None for w in firsts) or \
            any(blend_weight(x) is not None for x in items[1::2]):
        raise ConfigError(f"the data path {items} mixes weights and prefixes. Fix: pass "
                          f"PREFIX [PREFIX ...] or W1 PREFIX1 W2 PREFIX2 ... (e.g. 0.7 A 0.3 B)")
    if any(not (w > 0 and np.isfinite(w)) for w in firsts):
        raise ConfigError(f"the data path {items} has a weight that is not a positive number. "
                          f"Fix: give every prefix a weight > 0")
    total = sum(firsts)
    return items[1::2], [w / total for w in firsts]


def _blend(sizes: list[int], weights: list[float] | None) -> dict[str, np.ndarray]:
    """``{"dataset_index" [M] int16, "dataset_sample_index" [M] int64}`` (module docstring)."""
    from megatron.core.datasets import helpers

    k = len(sizes)
    if weights is None:
        m = sum(sizes)
        di, dsi = np.zeros(m, dtype=np.int16), np.zeros(m, dtype=np.int64)
        helpers.build_exhaustive_blending_indices(di, dsi, np.asarray(sizes, np.int64), k)
        return {"dataset_index": di, "dataset_sample_index": dsi}
    w = np.asarray(weights, dtype=np.float64)
    m = int(np.ceil(max(n / x for n, x in zip(sizes, weights))))
    while True:
        di, dsi = np.zeros(m, dtype=np.int16), np.zeros(m, dtype=np.int64)
        helpers.build_blending_indices(di, dsi, w, k, m, False)
        counts = np.bincount(di, minlength=k)
        if all(c >= n for c, n in zip(counts, sizes)):
            return {"dataset_index": di, "dataset_sample_index": dsi}
        m += max(1, m // 1000)


# ---- the dataset -----------------------------------------------------------------------------

class PackedDataset:
    """``seq_len``-token examples over prepared corpora, memory-mapped, with provenance.

    Args:
        data_path: one prefix, several, or Megatron's blend form (:func:`parse_blend`).
        seq_len: T, tokens per example (>= 2).
        packing: ``"windows"`` (documents packed, GPTDataset-style) or ``"documents"``
            (each document cut into chunks).
        seed: seed of the document order and of the shuffle index (megatron-core's default
            ``--seed`` 1234).
        cache_dir: where the indices are cached (default ``PREFIX.indices/`` beside each
            corpus; the blend's beside the first).

    Raises:
        InputFileError: a prefix that is missing, unfinished or damaged; corpora prepared
            with different tokenizers.
        ConfigError: a bad ``seq_len``, ``packing`` or data path.
        OutputError: the index cache folder is not writable (pass ``cache_dir``).
    """

    def __init__(self, data_path: Sequence[str | os.PathLike] | str | os.PathLike,
                 seq_len: int, *, packing: Literal["windows", "documents"] = "windows",
                 seed: int = 1234, cache_dir: str | os.PathLike | None = None) -> None:
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ConfigError(f"seq_len must be an integer >= 2, got {seq_len!r}")
        if packing not in PACKINGS:
            raise ConfigError(f"packing must be one of {PACKINGS}, got {packing!r}")
        prefixes, self.weights = parse_blend(data_path)
        self.corpora: tuple[PreparedCorpus, ...] = tuple(open_prepared(p) for p in prefixes)
        self._check_tokenizers()
        self.seq_len, self.packing, self.seed = seq_len, packing, seed
        self._cache = Path(cache_dir) if cache_dir is not None else None
        self._idx = [self._indices(c) for c in self.corpora]
        self._sizes = [len(ix["shuffle_index"]) for ix in self._idx]
        self._blend = None if len(self.corpora) == 1 else self._blend_indices()
        full = [os.path.abspath(c.paths.prefix) for c in self.corpora]
        self.data_path: list[str] = full if self.weights is None else \
            [x for w, p in zip(self.weights, full) for x in (repr(w), p)]
        """The prefixes as absolute paths (with the normalized weights, in the blend form):
        ``PackedDataset(data_path, seq_len, ...)`` opens the same examples again."""
        names = [c.name for c in self.corpora]  # the prefix's path where file names repeat
        self._labels = [n if names.count(n) == 1 else str(c.paths.prefix)
                        for n, c in zip(names, self.corpora)]

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> PackedDataset:
        """The examples a data record names (``data_path``, ``seq_len``, ``packing``,
        ``seed``: a run's ``data.json`` ``record``, a store's ``StoreSpec.data``)."""
        return cls(record["data_path"], record["seq_len"], packing=record["packing"],
                   seed=record["seed"])

    # -- construction --

    def _check_tokenizers(self) -> None:
        seen = {c.manifest["tokenizer"]["fingerprint"]: c.paths.prefix for c in self.corpora
                if c.manifest is not None}
        if len(seen) > 1:
            (fa, pa), (fb, pb) = list(seen.items())[:2]
            raise InputFileError(f"the blended corpora were prepared with different tokenizers: "
                                 f"{pa} ({fa}) and {pb} ({fb}). Fix: prepare them with the same "
                                 f"--tokenizer")

    def _indices(self, corpus: PreparedCorpus) -> dict[str, np.ndarray]:
        desc = {"corpus": corpus.fingerprint, "seq_len": self.seq_len, "packing": self.packing,
                "seed": self.seed, "index_version": INDEX_VERSION}
        key = fingerprint_of(desc)[:16]
        folder = self._cache or corpus.paths.indices
        if len(corpus) == 0:
            raise InputFileError(f"corpus '{corpus.paths.prefix}' holds no document. Fix: "
                                 f"prepare a corpus with documents")
        return _cached(folder, key, {**desc, "prefix": str(corpus.paths.prefix)},
                       lambda: _BUILDERS[self.packing](corpus.lengths, self.seq_len, self.seed))

    def _blend_indices(self) -> dict[str, np.ndarray]:
        desc = {"corpora": [c.fingerprint for c in self.corpora], "sizes": self._sizes,
                "weights": self.weights, "seq_len": self.seq_len, "packing": self.packing,
                "seed": self.seed, "index_version": INDEX_VERSION}
        key = "blend-" + fingerprint_of(desc)[:16]
        folder = self._cache or self.corpora[0].paths.indices
        return _cached(folder, key, desc, lambda: _blend(self._sizes, self.weights))

    # -- the loop's interface --

    def __len__(self) -> int:
        return self._sizes[0] if self._blend is None else len(self._blend["dataset_index"])

    def _locate(self, i: int) -> tuple[int, int, int]:
        """``(corpus, sample in its sample index, repeat)`` of example ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} is out of range [0, {len(self)})")
        if self._blend is None:
            c, j = 0, i
        else:
            c = int(self._blend["dataset_index"][i])
            j = int(self._blend["dataset_sample_index"][i])
        rep, j = divmod(j, self._sizes[c])
        return c, int(self._idx[c]["shuffle_index"][j]), rep

    def spans(self, i: int) -> list[Span]:
        """The document spans example ``i`` covers, in order (empty spans left out)."""
        c, s, _ = self._locate(int(i))
        return self._spans(c, s)

    def _spans(self, c: int, s: int) -> list[Span]:
        ix, lengths = self._idx[c], self.corpora[c].lengths
        if self.packing == "documents":
            doc, start = (int(x) for x in ix["sample_index"][s])
            return [Span(c, doc, start, min(start + self.seq_len, int(lengths[doc])))]
        (p0, o0), (p1, o1) = (tuple(int(x) for x in ix["sample_index"][t]) for t in (s, s + 1))
        out = []
        for pos in range(p0, p1 + 1):
            doc = int(ix["document_index"][pos])
            start, end = (o0 if pos == p0 else 0), (o1 if pos == p1 else int(lengths[doc]))
            if end > start:
                out.append(Span(c, doc, start, end))
        return out

    def spans_of(self, example_id: str) -> list[Span]:
        """The spans of the example named ``example_id`` (:meth:`example_id`'s inverse: every
        document a window covers, for reports; a repeat ``~k`` has its original's spans).

        Raises:
            KeyError: no example of this dataset has that id.
        """
        c, name = 0, example_id
        if len(self.corpora) > 1:
            c = next((k for k, lab in enumerate(self._labels)
                      if name.startswith(lab + "/")), -1)
            name = name[len(self._labels[c]) + 1:] if c >= 0 else ""
        head, tilde, rep = name.rpartition("~")
        name = head if tilde and rep.isdigit() else name
        doc_id, plus, start = name.rpartition("+")
        d = self.corpora[c].find(doc_id) if plus and start.isdigit() and c >= 0 else None
        s = None if d is None else self._sample_at(c, d, int(start))
        if s is None:
            raise KeyError(f"no example of {self.describe()['corpora'][max(c, 0)]['prefix']} "
                           f"is named {example_id!r}")
        return self._spans(c, s)

    def _sample_at(self, c: int, d: int, start: int) -> int | None:
        """The sample of corpus ``c`` whose first span starts at token ``start`` of document
        ``d`` (a window starting at a document's first token is recorded at the end of the
        one before it), or None."""
        si = np.asarray(self._idx[c]["sample_index"])
        if self.packing == "documents":
            lo, hi = np.searchsorted(si[:, 0], [d, d + 1])
            hit = lo + np.flatnonzero(si[lo:hi, 1] == start)
        else:
            order = np.asarray(self._idx[c]["document_index"])
            p = int(np.flatnonzero(order == d)[0])
            before = int(self.corpora[c].lengths[order[p - 1]]) if p else -1
            lo, hi = np.searchsorted(si[:-1, 0], [max(p - 1, 0), p + 1])
            rows = si[lo:hi]
            hit = lo + np.flatnonzero(((rows[:, 0] == p) & (rows[:, 1] == start)) | (
                (start == 0) & (rows[:, 0] == p - 1) & (rows[:, 1] == before)))
        return int(hit[0]) if len(hit) else None

    def tokens(self, i: int) -> np.ndarray:
        """The real tokens of example ``i`` (at most ``seq_len``; int64)."""
        parts = [self.corpora[sp.corpus].tokens(sp.document, sp.start, sp.end)
                 for sp in self.spans(i)]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def batch(self, idx: Sequence[int] | torch.Tensor | slice) -> dict[str, torch.Tensor]:
        """Model inputs ``[B, T]``: ``input_ids`` (pads: the corpus's pad id),
        ``attention_mask`` (1 on real tokens) and ``labels`` (``input_ids``, -100 on pads),
        as ``TokenizedDocuments.batch``."""
        if isinstance(idx, slice):
            rows = list(range(*idx.indices(len(self))))
        else:
            rows = torch.as_tensor(idx, dtype=torch.long).reshape(-1).tolist()
        ids = np.zeros((len(rows), self.seq_len), dtype=np.int64)
        mask = np.zeros((len(rows), self.seq_len), dtype=np.int64)
        for b, i in enumerate(rows):
            x = self.tokens(i)
            ids[b, len(x):] = self.corpora[self._locate(i)[0]].pad_id
            ids[b, :len(x)], mask[b, :len(x)] = x, 1
        input_ids, attention = torch.from_numpy(ids), torch.from_numpy(mask)
        return {"input_ids": input_ids, "attention_mask": attention,
                "labels": input_ids.masked_fill(attention == 0, _IGNORE)}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.batch([int(i)]).items()}

    # -- provenance --

    def doc_ids(self, i: int) -> list[str]:
        """The ids of the documents example ``i`` covers, in order."""
        return [self.corpora[sp.corpus].doc_id(sp.document) for sp in self.spans(i)]

    def example_id(self, i: int) -> str:
        """Example ``i``'s name (module docstring): ``<doc id>+<start>[~<repeat>]``."""
        c, _, rep = self._locate(int(i))
        first = self.spans(i)[0]
        name = f"{self.corpora[c].doc_id(first.document)}+{first.start}"
        if len(self.corpora) > 1:
            name = f"{self._labels[c]}/{name}"
        return f"{name}~{rep}" if rep else name

    @property
    def docs(self) -> _Examples:
        """``docs[i]``: :class:`Example` ``i`` (id, source, title, spans), computed on
        access (the loop reads ``data.docs[i].id``)."""
        return _Examples(self)

    # -- summary --

    def _sample_tokens(self, c: int) -> np.ndarray:
        """Real tokens of each sample of corpus ``c``, in sample-index order ``[S]``."""
        ix, lengths, t = self._idx[c], self.corpora[c].lengths, self.seq_len
        if self.packing == "documents":
            si = np.asarray(ix["sample_index"])
            return np.minimum(t, np.asarray(lengths, np.int64)[si[:, 0]] - si[:, 1])
        out = np.full(self._sizes[c], t, dtype=np.int64)
        out[-1] = self.corpora[c].n_tokens - t * (self._sizes[c] - 1)
        return out

    @property
    def n_tokens(self) -> int:
        """Real tokens over all examples (a repeated example counted each time)."""
        if self._blend is None:
            return self.corpora[0].n_tokens
        di, dsi = np.asarray(self._blend["dataset_index"]), \
            np.asarray(self._blend["dataset_sample_index"])
        total = 0
        for c in range(len(self.corpora)):
            j = dsi[di == c] % self._sizes[c]
            shuffled = np.asarray(self._idx[c]["shuffle_index"])[j]
            total += int(self._sample_tokens(c)[shuffled].sum())
        return total

    @property
    def padding_share(self) -> float:
        """The share of the ``len * seq_len`` positions that are padding."""
        return 1.0 - self.n_tokens / (len(self) * self.seq_len)

    @property
    def fingerprint(self) -> str:
        """What determines the examples: the corpora, weights, ``seq_len``, packing, seed
        (:func:`dataset_fingerprint`)."""
        return dataset_fingerprint([c.fingerprint for c in self.corpora], self.weights,
                                   self.seq_len, self.packing, self.seed)

    @property
    def tokenizer_fingerprint(self) -> str:
        """The corpora's tokenizer (equal for every corpus: checked at open); "" for
        Megatron-LM prefixes, which record none."""
        return next((c.manifest["tokenizer"]["fingerprint"] for c in self.corpora
                     if c.manifest is not None), "")

    def record(self, tokenizer: str) -> dict[str, Any]:
        """The data record of these examples read with ``tokenizer`` (its fingerprint): what
        checkpoints, stores (``StoreSpec.data``) and a run's ``data.json`` keep.
        ``fingerprint`` and ``tokenizer`` say which examples the ids name; ``data_path``,
        ``seq_len``, ``packing`` and ``seed`` open them again (``of_record``)."""
        return {"fingerprint": self.fingerprint, "tokenizer": tokenizer,
                "data_path": self.data_path, "seq_len": self.seq_len, "packing": self.packing,
                "seed": self.seed}

    def describe(self) -> dict[str, Any]:
        """A summary for logs and run records."""
        return {"data_path": self.data_path, "examples": len(self), "seq_len": self.seq_len,
                "packing": self.packing, "seed": self.seed, "tokens": self.n_tokens,
                "padding_share": round(self.padding_share, 6), "fingerprint": self.fingerprint,
                "corpora": [{"prefix": str(c.paths.prefix), "documents": len(c),
                             "tokens": c.n_tokens, "fingerprint": c.fingerprint}
                            for c in self.corpora], "weights": self.weights}


class _Examples(Sequence):
    """``PackedDataset.docs``: a lazy sequence of :class:`Example`."""

    def __init__(self, data: PackedDataset) -> None:
        self._data = data

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        spans = tuple(self._data.spans(int(i)))
        first = self._data.corpora[spans[0].corpus].document(spans[0].document)
        return Example(self._data.example_id(int(i)), first["source"], first["title"], spans)
