"""Pool: the documents behind a store's rows (``<doc id>#<content hash>`` sample ids), streamed:
per-row metadata only (source, content hash, token count); texts are read in chunks.

Near-duplicate clusters: a row's signature is a 2-function MinHash of its hashed token
trigrams; two rows share a cluster iff both minima agree (probability ``J^2`` for trigram
Jaccard similarity ``J``); rows with fewer than 3 tokens get a signature of their own.
The content prior's pool counts are the whole pool's (every rank's summed), so a row's score
does not depend on the order rows are read (formula: selection/content.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dattri_ds.data.corpus import Document, iter_jsonl
from dattri_ds.errors import ConfigError
from dattri_ds.sample_id import SampleId

__all__ = ["Pool", "Tokenize", "minhash_signatures", "ngram_counts", "content_log_ratio",
           "iter_pool_docs"]

#: ``texts -> (input_ids [C, T], attention_mask [C, T])``.
Tokenize = Callable[[Sequence[str]], tuple[torch.Tensor, torch.Tensor]]

_M = (1 << 31) - 1
_P = (1_000_003, 998_244_353, 1_000_000_007)
_AB = ((1_103_515_245, 12_345), (214_013, 2_531_011))


@dataclass(frozen=True)
class Pool:
    """Per-row metadata of the pool, aligned with the store's rows.

    Attributes:
        ids: ``[N]`` sample ids (store order).
        sources: ``[N]`` int32 index into ``source_names``.
        source_names: the sources, sorted.
        tokens: ``[N]`` int64 loss-bearing tokens per row (the store's counts).
        paths: the pool jsonl files.
    """

    ids: tuple[str, ...]
    sources: np.ndarray
    source_names: tuple[str, ...]
    tokens: np.ndarray
    paths: tuple[str, ...]

    @staticmethod
    def build(ids: Sequence[str], tokens: np.ndarray, paths: Sequence[str]) -> Pool:
        """Stream ``paths`` once and give every store row its document's source.

        Raises:
            ConfigError: a row's document is in none of ``paths`` (the first ids named).
        """
        row_of = {SampleId.parse(s).doc: i for i, s in enumerate(ids)}
        src = np.full(len(ids), -1, dtype=np.int64)
        names: dict[str, int] = {}
        for path in paths:
            for doc in iter_jsonl(path, "pool file"):
                i = row_of.get(doc.id)
                if i is not None and src[i] < 0:
                    src[i] = names.setdefault(doc.source, len(names))
        missing = [ids[i] for i in np.flatnonzero(src < 0)[:3]]
        if missing:
            raise ConfigError(f"{int((src < 0).sum())} store row(s) have no document in --pool "
                              f"{list(paths)} (e.g. {missing}): pass the jsonl the store was "
                              f"collected from (tools/collect.py --data)")
        order = sorted(names)
        remap = np.array([order.index(n) for n in names], dtype=np.int32)
        return Pool(tuple(ids), remap[src] if len(ids) else src.astype(np.int32),
                    tuple(order), np.asarray(tokens, dtype=np.int64), tuple(map(str, paths)))

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def hashes(self) -> list[str]:
        return [SampleId.parse(s).digest for s in self.ids]


def iter_pool_docs(paths: Sequence[str], ids: Sequence[str], rows: Sequence[int],
                   chunk: int = 256) -> Iterator[list[tuple[int, Document]]]:
    """Chunks of ``(row, Document)`` for ``rows`` (any order), in file order."""
    want = {SampleId.parse(ids[r]).doc: int(r) for r in rows}
    out: list[tuple[int, Document]] = []
    for path in paths:
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
