"""Pool: the documents behind a store's rows (``<doc id>#<content hash>`` sample ids), streamed:
per-row metadata only (source, content hash, token count); texts are read in chunks through
the pool's ``PoolTexts`` (jsonl documents here, prepared data in the tools).

Near-duplicate clusters: a row's signature is a 2-function MinHash of its hashed token
trigrams; two rows share a cluster iff both minima agree (probability ``J^2`` for trigram
Jaccard similarity ``J``); rows with fewer than 3 tokens get a signature of their own.
The content prior's pool counts are the whole pool's (every rank's summed), so a row's score
does not depend on the order rows are read (formula: selection/content.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from dattri_ds.data.corpus import Document, iter_jsonl
from dattri_ds.errors import ConfigError
from dattri_ds.sample_id import SampleId

__all__ = ["Pool", "PoolTexts", "JsonlTexts", "Tokenize", "minhash_signatures", "ngram_counts",
           "content_log_ratio"]

#: ``texts -> (input_ids [C, T], attention_mask [C, T])``.
Tokenize = Callable[[Sequence[str]], tuple[torch.Tensor, torch.Tensor]]

_M = (1 << 31) - 1
_P = (1_000_003, 998_244_353, 1_000_000_007)
_AB = ((1_103_515_245, 12_345), (214_013, 2_531_011))


class PoolTexts(Protocol):
    """The documents behind a pool's rows (store rows, in store order): each row's source,
    its tokens in chunks (content prior, near-duplicate signatures), its text for the report
    and the subset, and a subset in the pool data's own format. ``JsonlTexts`` reads jsonl
    documents; the tools' ``PreparedData`` reads prepared data (``tools/datasets.py``)."""

    paths: tuple[str, ...]
    """The pool data (jsonl files, or a prepared data path), recorded in config.json."""
    sources: tuple[str, ...]
    """``[N]`` each row's source."""

    def token_chunks(self, rows: Sequence[int]
                     ) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """``(rows [C], input_ids [C, T], attention_mask [C, T])`` chunks covering ``rows``."""

    def documents(self, rows: Sequence[int]) -> dict[int, dict]:
        """``{row: {"id", "source", "title", "text"}}`` of ``rows``."""

    def write_subset(self, out: Path, rows: np.ndarray) -> list[str]:
        """Write ``rows`` (rank order) in the pool data's own format into ``out``; returns the
        names written (none for jsonl: ``subset.jsonl`` is its subset)."""


@dataclass(frozen=True)
class JsonlTexts:
    """The jsonl documents of a pool's rows (the sample id's document part names each),
    streamed from ``paths`` and tokenized by ``tokenize`` in chunks."""

    paths: tuple[str, ...]
    ids: tuple[str, ...]
    sources: tuple[str, ...]
    tokenize: Tokenize

    @staticmethod
    def open(paths: Sequence[str], ids: Sequence[str], tokenize: Tokenize) -> JsonlTexts:
        """Stream ``paths`` once and give every store row its document's source.

        Raises:
            ConfigError: a row's document is in none of ``paths`` (the first ids named).
        """
        row_of = {SampleId.parse(s).doc: i for i, s in enumerate(ids)}
        src: list[str | None] = [None] * len(ids)
        for path in paths:
            for doc in iter_jsonl(path, "pool file"):
                i = row_of.get(doc.id)
                if i is not None and src[i] is None:
                    src[i] = doc.source
        missing = [ids[i] for i, s in enumerate(src) if s is None]
        if missing:
            raise ConfigError(f"{len(missing)} store row(s) have no document in --pool "
                              f"{list(paths)} (e.g. {missing[:3]}): pass the jsonl the store "
                              f"was collected from (tools/collect.py --data)")
        return JsonlTexts(tuple(map(str, paths)), tuple(ids), tuple(src), tokenize)

    def _docs(self, rows: Sequence[int], chunk: int = 256
              ) -> Iterator[list[tuple[int, Document]]]:
        """Chunks of ``(row, Document)`` for ``rows`` (any order), in file order."""
        want = {SampleId.parse(self.ids[r]).doc: int(r) for r in rows}
        out: list[tuple[int, Document]] = []
        for path in self.paths:
            for doc in iter_jsonl(path, "pool file"):
                r = want.pop(doc.id, None)
                if r is None:
                    continue
                out.append((r, doc))
                if len(out) >= chunk:
                    yield out
                    out = []
        if out:
            yield out

    def token_chunks(self, rows: Sequence[int]
                     ) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        for chunk in self._docs(rows):
            ids, mask = self.tokenize([d.text for _, d in chunk])
            yield np.asarray([r for r, _ in chunk]), ids, mask

    def documents(self, rows: Sequence[int]) -> dict[int, dict]:
        return {r: d.to_dict() for chunk in self._docs(rows) for r, d in chunk}

    def write_subset(self, out: Path, rows: np.ndarray) -> list[str]:
        return []


@dataclass(frozen=True)
class Pool:
    """Per-row metadata of the pool, aligned with the store's rows.

    Attributes:
        ids: ``[N]`` sample ids (store order).
        sources: ``[N]`` int32 index into ``source_names``.
        source_names: the sources, sorted.
        tokens: ``[N]`` int64 loss-bearing tokens per row (the store's counts).
        texts: the rows' documents (``PoolTexts``).
    """

    ids: tuple[str, ...]
    sources: np.ndarray
    source_names: tuple[str, ...]
    tokens: np.ndarray
    texts: PoolTexts

    @staticmethod
    def build(ids: Sequence[str], tokens: np.ndarray, texts: PoolTexts) -> Pool:
        """The pool of the store rows ``ids`` whose documents ``texts`` reads."""
        order = sorted(set(texts.sources))
        code = {n: i for i, n in enumerate(order)}
        sources = np.fromiter((code[s] for s in texts.sources), dtype=np.int32,
                              count=len(ids))
        return Pool(tuple(ids), sources, tuple(order), np.asarray(tokens, dtype=np.int64),
                    texts)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def paths(self) -> tuple[str, ...]:
        return self.texts.paths

    @property
    def hashes(self) -> list[str]:
        return [SampleId.parse(s).digest for s in self.ids]


def minhash_signatures(input_ids: torch.Tensor, valid: torch.Tensor) -> np.ndarray:
    """``[C]`` int64 near-duplicate signatures (2-function MinHash of token trigrams);
    ``-1`` marks a row too short to have one (it clusters with nothing)."""
    ids = input_ids.long().cpu()
    ok = valid.bool().cpu()
    if ids.shape[1] < 3:
        return np.full(ids.shape[0], -1, dtype=np.int64)
    g = (ids[:, :-2] * _P[0] + ids[:, 1:-1] * _P[1] + ids[:, 2:] * _P[2]) % _M
    ok3 = ok[:, :-2] & ok[:, 1:-1] & ok[:, 2:]
    mins = []
    for a, b in _AB:
        h = (g * a + b) % _M
        mins.append(torch.where(ok3, h, torch.full_like(h, _M)).min(1).values)
    sig = (mins[0] << 31) | mins[1]
    sig = torch.where(ok3.any(1), sig, torch.full_like(sig, -1))
    return sig.numpy().astype(np.int64)


def ngram_counts(input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[C, dim]`` raw hashed unigram + bigram counts (the content prior's features)."""
    from dattri_ds.selection.smoothing import NGRAM_DIM, ngram_features

    return ngram_features(input_ids, valid, NGRAM_DIM, normalize=False)


def content_log_ratio(counts: torch.Tensor, target_counts: torch.Tensor,
                      pool_counts: torch.Tensor) -> torch.Tensor:
    """``[C]`` mean log-ratio ``log p_t - log p_s`` of each row's n-grams."""
    dim = target_counts.numel()
    log_t = torch.log((target_counts.double() + 1) / (target_counts.double().sum() + dim))
    log_s = torch.log((pool_counts.double() + 1) / (pool_counts.double().sum() + dim))
    c = counts.double()
    return (c @ (log_t - log_s)) / c.sum(1).clamp_min(1)
