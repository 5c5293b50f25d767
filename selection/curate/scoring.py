"""Streamed scoring of a pool: rank ``r`` of ``R`` reads rows ``[r N / R, (r + 1) N / R)`` of
the store block by block (one read per checkpoint the method uses), scores them with the
method's ``block`` and, for content methods or a cluster cap, reads their documents' tokens.
Only per-row numbers are kept and all-gathered; the content prior's pool-wide counts are
all-reduced between its two passes. Memory per rank: ``memory_bound`` (docs/curation.md,
"Streaming and memory")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from dattri_ds.selection.curate.methods import CurationMethod
from dattri_ds.selection.curate.pool import (
    Pool, content_log_ratio, minhash_signatures, ngram_counts,
)
from dattri_ds.errors import ConfigError
from dattri_ds.store.reader import GradientStore

__all__ = ["Scored", "score_pool", "rank_slice", "memory_bound", "align_rows"]

#: Bytes kept per pool row on a rank (ids, 3 float64 columns, codes).
ROW_BYTES = 250
#: Bytes per row of each open checkpoint store (its id tuple and id -> row dict).
STORE_ROW_BYTES = 200


def memory_bound(rows: int, width: int, *, block_rows: int = 1024, checkpoints: int = 1,
                 targets: int = 64) -> int:
    """Bytes a curate run holds per rank (formula: docs/curation.md, "Streaming and memory")."""
    return (checkpoints * block_rows * width * 4 + block_rows * width * 8
            + checkpoints * targets * width * 8 + rows * (ROW_BYTES + STORE_ROW_BYTES * checkpoints))


@dataclass(frozen=True)
class Scored:
    """Whole-pool columns (``[N]``): the ranked score and what it was made of."""

    scores: np.ndarray
    gradient: np.ndarray | None
    content: np.ndarray | None
    clusters: np.ndarray | None


def rank_slice(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of rank ``rank``: contiguous, sizes differing by at most one."""
    return n * rank // world, n * (rank + 1) // world


def align_rows(stores: Mapping[str, GradientStore]) -> dict[str, np.ndarray | None]:
    """Per checkpoint, the rows matching the first store's ids (None: same order).

    Raises:
        ConfigError: two checkpoints' stores hold different examples.
    """
    tags = list(stores)
    base = stores[tags[0]].ids
    out: dict[str, np.ndarray | None] = {}
    for t in tags:
        ids = stores[t].ids
        if ids == base:
            out[t] = None
            continue
        if len(ids) != len(base) or set(ids) != set(base):
            extra = sorted(set(base) ^ set(ids))[:3]
            raise ConfigError(f"The stores of checkpoints '{tags[0]}' and '{t}' hold different "
                              f"examples (e.g. {extra}): collect the same --data at every "
                              f"checkpoint (tools/collect.py --checkpoints all)")
        out[t] = np.array([stores[t].index_of(i) for i in base], dtype=np.int64)
    return out


def _gradient_column(method: CurationMethod, stores, targets, weights, lo: int, hi: int,
                     block_rows: int) -> np.ndarray:
    tags = method.checkpoints(list(stores))
    use = {t: stores[t] for t in tags}
    perm = align_rows(use)
    out = np.empty(hi - lo, dtype=np.float64)
    for a in range(lo, hi, block_rows):
        b = min(hi, a + block_rows)
        blocks = {t: s.read(slice(a, b) if perm[t] is None else perm[t][a:b], torch.float32,
                            copy=False) for t, s in use.items()}
        out[a - lo:b - lo] = method.block(blocks, targets, weights).numpy()
    return out


def _text_columns(pool: Pool, lo: int, hi: int) -> tuple[np.ndarray, torch.Tensor | None]:
    """Pass 1 over the slice's documents: signatures ``[hi - lo]`` and summed n-gram counts."""
    sig = np.full(hi - lo, -1, dtype=np.int64)
    total = None
    for rows, ids, mask in pool.texts.token_chunks(range(lo, hi)):
        rows = rows - lo
        sig[rows] = minhash_signatures(ids, mask)
        c = ngram_counts(ids, mask).sum(0)
        total = c if total is None else total + c
    return sig, total


def _content_column(pool: Pool, lo: int, hi: int, target_counts: torch.Tensor,
                    pool_counts: torch.Tensor) -> np.ndarray:
    """Pass 2: each row's log-ratio against the pool-wide counts (texts read again: no
    per-row counts are kept)."""
    out = np.zeros(hi - lo, dtype=np.float64)
    for rows, ids, mask in pool.texts.token_chunks(range(lo, hi)):
        out[rows - lo] = content_log_ratio(ngram_counts(ids, mask), target_counts,
                                           pool_counts).numpy()
    return out


def score_pool(method: CurationMethod, stores: Mapping[str, GradientStore], pool: Pool, *,
               targets: Mapping[str, torch.Tensor] | None = None,
               weights: Mapping[str, float] | None = None,
               target_counts: torch.Tensor | None = None, clusters: bool = False,
               rank: int = 0, world: int = 1) -> Scored:
    """Score every row of the pool (this rank its slice), gathered on every rank.

    Args:
        method: the curation method (its config gives ``block_rows`` and ``aggregate``).
        stores: checkpoint tag -> the pool's store (oldest first).
        pool: the rows' documents (their tokens: content methods and cluster caps).
        targets: tag -> target rows ``[Q, P]`` in that store's space (gradient methods).
        weights: tag -> learning rate (trajectory).
        target_counts: ``[dim]`` the target documents' n-gram counts (content methods).
        clusters: compute near-duplicate signatures.
        rank, world: this process's place among the scoring ranks.
    """
    n = len(pool)
    lo, hi = rank_slice(n, rank, world)
    grad = None
    if method.gradient:
        grad = _gradient_column(method, stores, targets or {}, weights or {}, lo, hi,
                                method.config.block_rows)
    sig = content = None
    if method.content or clusters:
        sig, total = _text_columns(pool, lo, hi)
        if method.content:
            if target_counts is None:
                raise ConfigError(f"--method {method.name} needs target documents (--target) "
                                  f"for the content prior's target counts")
            zero = torch.zeros(target_counts.numel(), dtype=torch.float64)
            total = _all_reduce(zero if total is None else total.double(), world)
            content = _content_column(pool, lo, hi, target_counts, total)
    grad, content, sig = (_gather(x, world) for x in (grad, content, sig))
    return Scored(method.finalize(grad, content), grad, content, sig if clusters else None)


def _all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    if world == 1:
        return t
    import torch.distributed as dist

    t = t.double().clone()
    dist.all_reduce(t)
    return t


def _gather(x: np.ndarray | None, world: int) -> np.ndarray | None:
    if x is None or world == 1:
        return x
    import torch.distributed as dist

    parts: list = [None] * world
    dist.all_gather_object(parts, x)
    return np.concatenate(parts)
