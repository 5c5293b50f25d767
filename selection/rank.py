"""Rank stages: what the policy ranks, made from the scores by composable ``Ranker`` stages.

Between the score and the policy a step runs, in order, the rankers ``rankers(config, ...)``
builds (each optional):

1. ``NeighborSmoothing`` (``smooth_neighbors``): each score replaced by the mean score of the
   texts nearest in content (selection/smoothing.py);
2. ``ContentRanking`` (``content_weight``): ``z(ranked) + w z(content)`` with the content
   prior's target-vs-stream n-gram log-ratio (selection/content.py).

Both read the candidates' hashed unigram/bigram counts, which ``CandidateText`` computes
once per micro-batch. A new stage is one class with ``__call__(ranked, text) -> ranked``.
"""

from __future__ import annotations

from functools import cached_property
from typing import Protocol

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.content import DEFAULT_CONTENT_WEIGHT, ContentPrior, with_content
from dattri_ds.selection.policy import Policy
from dattri_ds.selection.smoothing import NGRAM_DIM, NeighborSmoother, ngram_features, unit_rows

__all__ = ["CandidateText", "Ranker", "NeighborSmoothing", "ContentRanking", "rankers",
           "content_weight"]

Batch = dict[str, torch.Tensor]


class CandidateText:
    """A micro-batch's candidates as text: hashed n-gram counts, computed once, shared."""

    def __init__(self, batch: Batch) -> None:
        self.ids = batch["input_ids"]
        self.valid = batch.get("attention_mask", torch.ones_like(self.ids))

    @cached_property
    def counts(self) -> torch.Tensor:
        """``[C, NGRAM_DIM]`` raw hashed unigram + bigram counts of the valid tokens."""
        return ngram_features(self.ids, self.valid, NGRAM_DIM, normalize=False)

    @cached_property
    def unit(self) -> torch.Tensor:
        """``counts`` with unit-norm rows (the smoothing's content features)."""
        return unit_rows(self.counts)


class Ranker(Protocol):
    """One rank stage: ``ranked [C] -> ranked [C]`` given the candidates' text."""

    def __call__(self, ranked: torch.Tensor, text: CandidateText) -> torch.Tensor: ...


class NeighborSmoothing:
    """``smooth_neighbors``: the mean score of the ``k`` nearest texts (this rank's memory)."""

    def __init__(self, k: int, memory: int) -> None:
        self.smoother = NeighborSmoother(k, memory)

    def __call__(self, ranked: torch.Tensor, text: CandidateText) -> torch.Tensor:
        return self.smoother.smooth_features(text.unit, ranked)


class ContentRanking:
    """``content_weight``: ``z(ranked) + weight * z(content prior)``."""

    def __init__(self, documents: Batch, weight: float) -> None:
        self.prior, self.weight = ContentPrior(documents), weight

    def __call__(self, ranked: torch.Tensor, text: CandidateText) -> torch.Tensor:
        return with_content(ranked, self.prior.scores_of_counts(text.counts), self.weight)


def content_weight(config: SelectionConfig, policy: Policy, documents: Batch | None) -> float:
    """``content_weight``, or when unset 1.0 if the target documents are known and the
    policy ranks (it is not ``Policy.scaled``), else 0.

    Raises:
        ConfigError: a weight > 0 with a scaled policy, or without target documents.
    """
    weight = config.content_weight
    if weight is None:
        weight = DEFAULT_CONTENT_WEIGHT if documents is not None and not policy.scaled else 0.0
    if weight == 0:
        return 0.0
    if policy.scaled:
        raise ConfigError(
            f"selection.content_weight={weight} ranks standardized scores, which "
            f"policy='{config.policy}' cannot use (it reads the scores' own scale: a "
            f"threshold, GREATS' learning-rate gain); use policy topk, fraction or soft, "
            f"or set content_weight to 0")
    if documents is None:
        raise ConfigError(
            f"selection.content_weight={weight} needs the target documents' tokens "
            f"(target_data), which a target_store does not have; set content_weight "
            f"to 0 (or leave it unset) or give target_data")
    return weight


def rankers(config: SelectionConfig, policy: Policy, documents: Batch | None
            ) -> list[Ranker]:
    """The rank stages of ``config``, in order (empty: the policy ranks the raw scores)."""
    stages: list[Ranker] = []
    if config.smooth_neighbors:
        stages.append(NeighborSmoothing(config.smooth_neighbors, config.smooth_memory))
    weight = content_weight(config, policy, documents)
    if weight:
        stages.append(ContentRanking(documents, weight))
    return stages
