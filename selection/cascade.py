"""The cascade: the content prior ranks all ``C`` candidates (no model) and only the top
``S = min(C, ceil(shortlist * n))`` are probed and scored (ties: lower index first),
``n = k - round(uniform_mix * k)``; the uniform share is drawn from all ``C``
(docs/selection_stages.md, "The cascade"; cost: docs/selection_cost.md)."""

from __future__ import annotations

import math

import torch

from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.content import ContentPrior, ContentRanking
from dattri_ds.selection.policy import top_k
from dattri_ds.selection.rank import Ranker
from dattri_ds.selection.smoothing import CandidateText

__all__ = ["needed", "shortlist_size", "Cascade", "cascade_for"]

Batch = dict[str, torch.Tensor]


def needed(k: int, candidates: int, uniform_mix: float) -> int:
    """``n``: examples the policy chooses of ``k`` (capped at ``C``), the rest uniform:
    ``min(k, C) - round(uniform_mix * min(k, C))`` (as ``policy.mixed``)."""
    k = min(k, candidates)
    return k - round(uniform_mix * k)


def shortlist_size(multiple: float, k: int, candidates: int, uniform_mix: float) -> int:
    """``S = min(C, ceil(multiple * n))`` candidates probed, ``n = needed(k, C, mix)``."""
    return min(candidates, math.ceil(multiple * needed(k, candidates, uniform_mix) - 1e-9))


class Cascade:
    """The shortlist stage: content prior over all candidates, top ``S`` go to the probe.

    Args:
        multiple: ``selection.shortlist`` (>= 1).
        uniform_mix: ``selection.uniform_mix``.
        prior: the content prior (shared with the ``ContentRanking`` rank stage when there
            is one, so the stream counts each candidate once).
    """

    def __init__(self, multiple: float, uniform_mix: float, prior: ContentPrior) -> None:
        self.multiple, self.uniform_mix, self.prior = multiple, uniform_mix, prior
        self.stats = {"steps": 0, "candidates": 0, "probed": 0}

    def size(self, k: int, candidates: int) -> int:
        """``S`` for ``k`` trained of ``candidates``."""
        return shortlist_size(self.multiple, k, candidates, self.uniform_mix)

    def __call__(self, text: CandidateText, k: int) -> tuple[torch.Tensor, CandidateText]:
        """``(positions [S], the shortlist's text with its content scores)`` for a
        micro-batch's ``text`` (all ``C`` candidates; they join the prior's stream counts)
        and ``k`` examples trained from it."""
        content = self.prior.scores_of_counts(text.counts)
        c = content.numel()
        positions = top_k(content, self.size(k, c))  # ties: the lower index
        self.stats["steps"] += 1
        self.stats["candidates"] += c
        self.stats["probed"] += positions.numel()
        return positions, text.subset(positions, content)

    def summary(self, ctx: ParallelContext | None = None,
                device: torch.device | str = "cpu") -> dict:
        """The shortlist statistics summed over the data-parallel ranks (collective when
        ``ctx`` has several; ``probed_share``: probed / candidates)."""
        ctx = ctx or ParallelContext()
        keys = ("steps", "candidates", "probed")
        t = torch.tensor([float(self.stats[k]) for k in keys], dtype=torch.float64,
                         device=device)
        steps, cands, probed = (int(round(v)) for v in
                                all_reduce_sum(t, ctx.dp_group, ctx.dp_world).tolist())
        return {"shortlist": self.multiple, "micro_batches": steps, "candidates": cands,
                "probed": probed, "probed_share": probed / max(1, cands)}


def cascade_for(config: SelectionConfig, stages: list[Ranker],
                documents: Batch | None) -> Cascade | None:
    """The cascade of ``config`` (None when ``shortlist`` is unset); its prior is the
    ``ContentRanking`` stage's among ``stages`` when there is one.

    Raises:
        ConfigError: ``shortlist`` without target documents (a ``target_store``).
    """
    if config.shortlist is None:
        return None
    if documents is None:
        raise ConfigError(f"selection.shortlist={config.shortlist} ranks the candidates by the "
                          f"target documents' n-grams, which a target_store does not have: "
                          f"give selection.target_data or unset shortlist")
    # one prior per selector, so its stream counts every candidate once
    prior = next((s.prior for s in stages if isinstance(s, ContentRanking)), None)
    return Cascade(config.shortlist, config.uniform_mix, prior or ContentPrior(documents))
