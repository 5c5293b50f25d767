"""curate: score a pool store against a target, keep a budget under diversity caps, write it.

Stages: ``resolve_budget`` (checked before any work), ``score_pool`` (each rank streams its
slice through the method's ``block``; columns all-gathered), the method's ``finalize``,
``choose`` (rank, skip capped rows, stop at the budget), ``writer.write_outputs`` (rank 0)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dattri_ds.selection.curate.budget import Budget, choose, resolve_budget
from dattri_ds.selection.curate.config import CurateConfig
from dattri_ds.selection.curate.methods import get_method
from dattri_ds.selection.curate.pool import Pool
from dattri_ds.selection.curate.scoring import Scored, score_pool
from dattri_ds.store.reader import GradientStore

__all__ = ["CurateResult", "curate"]


@dataclass(frozen=True)
class CurateResult:
    """What a curation kept: ``chosen`` rows in rank order, every row's ``scores``."""

    chosen: np.ndarray
    scores: np.ndarray
    budget: Budget
    scored: Scored
    summary: dict | None = None

    def sample_ids(self, pool: Pool) -> list[str]:
        return [pool.ids[r] for r in self.chosen.tolist()]


def curate(config: CurateConfig, stores: Mapping[str, GradientStore], pool: Pool, *,
           targets: Mapping[str, torch.Tensor] | None = None,
           weights: Mapping[str, float] | None = None,
           target_counts: torch.Tensor | None = None, out: str | Path | None = None,
           with_text: bool = False, resolved: dict | None = None, rank: int = 0,
           world: int = 1) -> CurateResult:
    """Select a subset of the pool (module docstring: the stages).

    Args:
        config: method, budget, diversity.
        stores: checkpoint tag -> the pool's store, oldest first (every store holds the
            same rows; the first one's order is the pool's).
        pool: the rows' documents (``Pool.build``; their tokens feed the content prior and
            the near-duplicate clusters).
        targets: tag -> ``[Q, P]`` target rows in that store's space (gradient methods;
            Adam-preconditioned for ``adam`` methods: ``targets.adam_target``).
        weights: tag -> learning rate (``trajectory``).
        target_counts: the target documents' n-gram counts (content prior).
        out: the folder rank 0 writes (None: nothing written).
        with_text: subset.jsonl carries the documents (trainable by launch/).
        resolved: extra provenance recorded in config.json (inputs, checkpoints).
        rank, world: this process among the scoring ranks (``torch.distributed`` when > 1).

    Raises:
        ConfigError: an empty pool, a budget the pool or the caps cannot meet.
    """
    budget = resolve_budget(config, len(pool), pool.tokens)
    method = get_method(config.method)(config)
    scored = score_pool(method, stores, pool, targets=targets, weights=weights,
                        target_counts=target_counts,
                        clusters=config.max_per_cluster is not None, rank=rank, world=world)
    chosen = choose(scored.scores, budget, tokens=pool.tokens, sources=pool.sources,
                    clusters=scored.clusters, hashes=pool.hashes if config.dedupe else None,
                    config=config)
    summary = None
    if out is not None and rank == 0:
        from dattri_ds.selection.curate.writer import write_outputs

        info = {"config": config.to_dict(), "budget": {"kind": budget.kind,
                                                       "amount": budget.amount},
                "checkpoints": method.checkpoints(list(stores)), **(resolved or {})}
        summary = write_outputs(Path(out), pool=pool, scores=scored.scores, chosen=chosen,
                                resolved=info, with_text=with_text)
    return CurateResult(chosen, scored.scores, budget, scored, summary)
