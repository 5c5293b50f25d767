"""The policy stage: pure functions from candidate scores (higher = more useful) to chosen
indices: the top ``n = k - round(uniform_mix * k)``, filled up to ``k`` by a seeded uniform
draw from the others (``mixed``); every function returns a sorted ``LongTensor``."""

from __future__ import annotations

import torch

from dattri_ds.errors import ConfigError

__all__ = ["top_k", "fill_uniform", "mixed"]


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` highest scores (ties broken by the lower index)."""
    if not 1 <= k <= scores.numel():
        raise ConfigError(f"top_k needs 1 <= k <= {scores.numel()} candidates, got k={k}")
    order = torch.argsort(-scores.double(), stable=True)
    return order[:k].sort().values


def fill_uniform(chosen: torch.Tensor, c: int, k: int,
                 generator: torch.Generator) -> torch.Tensor:
    """``chosen`` plus a uniform draw from the other of ``c`` candidates, ``k`` in all.

    The mix with uniform choice: the policy picks ``k - round(ratio * k)``, this fills the
    rest (``chosen`` empty = a uniform choice of ``k``).
    """
    if not chosen.numel() <= k <= c:
        raise ConfigError(f"fill_uniform needs {chosen.numel()} <= k <= {c}, got k={k}")
    rest = torch.ones(c, dtype=torch.bool)
    rest[chosen] = False
    pool = torch.nonzero(rest).flatten()
    fill = pool[torch.randperm(pool.numel(), generator=generator)[:k - chosen.numel()]]
    return torch.cat([chosen, fill]).sort().values


def mixed(scores: torch.Tensor, k: int, *, uniform_mix: float,
          generator: torch.Generator) -> torch.Tensor:
    """The top ``k - round(uniform_mix * k)`` of ``scores [C]`` (``k`` capped at ``C``),
    filled up to ``k`` by a uniform draw from the others (``fill_uniform``)."""
    c = scores.numel()
    k = min(k, c)
    n = k - round(uniform_mix * k)
    chosen = top_k(scores, n) if n > 0 else torch.zeros(0, dtype=torch.long)
    return fill_uniform(chosen, c, k, generator) if chosen.numel() < k else chosen
