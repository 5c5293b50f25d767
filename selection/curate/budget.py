"""Budget: how many rows (or tokens) a subset holds, and the capped greedy choice that meets it.

Rows are ranked by score (ties: a seeded random order) and taken in order, skipping
duplicates (``dedupe``), full near-duplicate clusters (``max_per_cluster``), full sources
(``max_source_share``) and, for a token budget, rows that no longer fit, until the budget is
met. A cap that leaves fewer rows than an examples budget is an error naming the caps
(docs/curation.md, "Diversity and de-duplication")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dattri_ds.errors import ConfigError

__all__ = ["Budget", "resolve_budget", "rank_order", "choose"]


@dataclass(frozen=True)
class Budget:
    """``kind`` ``examples`` (``amount`` rows) or ``tokens`` (``amount`` tokens)."""

    kind: str
    amount: int


def resolve_budget(config, n_rows: int, tokens: np.ndarray) -> Budget:
    """The budget of ``config`` on a pool of ``n_rows`` rows with per-row ``tokens``.

    Raises:
        ConfigError: an empty pool, more examples than rows, more tokens than the pool
            holds, or a token budget on a store without token counts.
    """
    if n_rows == 0:
        raise ConfigError("The pool store holds no rows: collect the pool first "
                          "(tools/collect.py --data POOL --out STORE)")
    if config.fraction is not None:
        return Budget("examples", max(1, int(round(config.fraction * n_rows))))
    if config.examples is not None:
        if config.examples > n_rows:
            raise ConfigError(f"--examples {config.examples} exceeds the pool's {n_rows} rows: "
                              f"give at most {n_rows} (or --fraction)")
        return Budget("examples", config.examples)
    if (tokens < 0).any():
        raise ConfigError("--tokens needs per-row token counts, which this store does not "
                          "record: use --examples or --fraction, or collect the pool again")
    total = int(tokens.sum())
    if config.tokens > total:
        raise ConfigError(f"--tokens {config.tokens} exceeds the pool's {total} tokens: give at "
                          f"most {total} (or --fraction)")
    return Budget("tokens", int(config.tokens))


#: Scores are compared at this many decimals, so the last-bit differences of another block
#: or rank layout (a matmul's summation order) never reorder rows: closer ones are ties.
DECIMALS = 12


def rank_order(scores: np.ndarray, seed: int) -> np.ndarray:
    """Rows by descending score (rounded to ``DECIMALS``); ties in a seeded random order."""
    tie = np.random.default_rng(seed).permutation(len(scores))
    return np.lexsort((tie, -np.round(np.asarray(scores, dtype=np.float64), DECIMALS)))


def choose(scores: np.ndarray, budget: Budget, *, tokens: np.ndarray, sources: np.ndarray,
           clusters: np.ndarray | None, hashes: list[str] | None, config) -> np.ndarray:
    """Rows of the subset in rank order (module docstring: the rules).

    Raises:
        ConfigError: the caps leave fewer rows than an examples budget asks for.
    """
    cost = np.ones(len(scores), dtype=np.int64) if budget.kind == "examples" else tokens
    share = config.max_source_share
    cap_src = None if share is None else share * budget.amount
    per_src = np.zeros(int(sources.max(initial=0)) + 1, dtype=np.int64)
    per_cluster: dict[int, int] = {}
    seen: set[str] = set()
    left = budget.amount
    kept: list[int] = []
    skipped = {"dedupe": 0, "cluster": 0, "source": 0}
    for r in rank_order(scores, config.seed):
        c = int(cost[r])
        if c > left:
            continue
        if config.dedupe and hashes is not None and hashes[r] in seen:
            skipped["dedupe"] += 1
            continue
        cl = None if clusters is None or clusters[r] < 0 else int(clusters[r])
        if (config.max_per_cluster is not None and cl is not None
                and per_cluster.get(cl, 0) >= config.max_per_cluster):
            skipped["cluster"] += 1
            continue
        s = int(sources[r])
        if cap_src is not None and per_src[s] + c > cap_src:
            skipped["source"] += 1
            continue
        kept.append(int(r))
        left -= c
        per_src[s] += c
        if cl is not None:
            per_cluster[cl] = per_cluster.get(cl, 0) + 1
        if hashes is not None:
            seen.add(hashes[r])
        if left == 0:
            break
    if budget.kind == "examples" and left > 0:
        raise ConfigError(f"The diversity caps leave {len(kept)} of the {budget.amount} "
                          f"examples asked for (skipped: {skipped}): raise --max-source-share "
                          f"/ --max-per-cluster, pass --no-dedupe, or lower the budget")
    return np.asarray(kept, dtype=np.int64)
