"""Rank stages: what the policy ranks, made from the scores by the optional ``Ranker`` stages
``rankers`` builds, in order: ``NeighborSmoother`` (``smooth_neighbors``), then
``ContentRanking`` (``content_weight``: ``z(ranked) + w z(c)``). A new stage is one class with
``__call__(ranked, text) -> ranked`` and one line in ``rankers``."""

from __future__ import annotations

from typing import Protocol

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.selection.content import DEFAULT_CONTENT_WEIGHT, ContentRanking
from dattri_ds.selection.smoothing import CandidateText, NeighborSmoother

from dattri_ds.selection.config import SelectionConfig

__all__ = ["Ranker", "CandidateText", "rankers", "content_weight"]

Batch = dict[str, torch.Tensor]


class Ranker(Protocol):
    """One rank stage: ``ranked [C] -> ranked [C]`` given the candidates' text (stateful
    stages, such as the smoother's memory, update themselves on the call)."""

    def __call__(self, ranked: torch.Tensor, text: CandidateText) -> torch.Tensor: ...


def content_weight(config: SelectionConfig, documents: Batch | None) -> float:
    """``content_weight``, or when unset 1.0 if the target documents are known, else 0.

    Raises:
        ConfigError: a weight > 0 without target documents (a target store).
    """
    weight = config.content_weight
    if weight is None:
        weight = DEFAULT_CONTENT_WEIGHT if documents is not None else 0.0
    if weight and documents is None:
        raise ConfigError(
            f"selection.content_weight={weight} needs the target documents' tokens "
            f"(target_data), which a target_store does not have; set content_weight "
            f"to 0 (or leave it unset) or give target_data")
    return weight or 0.0


def rankers(config: SelectionConfig, weight: float, documents: Batch | None) -> list[Ranker]:
    """The rank stages of ``config`` in order, ``weight`` the resolved ``content_weight``
    (empty: the policy ranks the scores themselves)."""
    stages: list[Ranker] = []
    if config.smooth_neighbors:
        stages.append(NeighborSmoother(config.smooth_neighbors, config.smooth_memory))
    if weight:
        stages.append(ContentRanking(documents, weight))
    return stages
