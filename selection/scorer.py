"""Scoring: candidates x rows -> ``scores [C]``, one registered ``Score`` class per rule
(``needs_probe``, ``ranked``, ``check(config)``, ``__call__``; a new rule:
docs/selection_stages.md, "Adding a scoring rule").

The shared measure ``score_b = <g_b, g_target>`` is routed ghost vs dense by the cost model:
a factorized candidate against a dense target never builds its weight gradient."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import ConfigError, ShapeError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops import CostModel, cross_gram, norms
from dattri_ds.registry import Registry
from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.content import ContentPrior
from dattri_ds.selection.smoothing import CandidateText

__all__ = ["alignment_scores", "aligned", "Score", "SCORES", "Alignment",
           "ContentScore", "score_for"]

Batch = dict[str, torch.Tensor]

SCORES: Registry[type[Score]] = Registry(
    "selection score", hint="add one with class X(Score, name='x') in selection/scorer.py "
    "style and 'x' in SelectionConfig.score")


def alignment_scores(candidates: GradBatch, target: GradBatch,
                     cost: CostModel | None = None) -> torch.Tensor:
    """``[C]`` inner products of every candidate's gradient with the (one-row) target."""
    if target.batch_size != 1:
        raise ShapeError(f"alignment_scores: the target must hold one (mean) gradient row, got "
                         f"{target.batch_size} rows (sample ids {list(target.sample_ids)[:4]}); "
                         f"pass a one-row GradBatch such as TargetProvider.get(step)")
    return cross_gram(candidates, target, layers=list(target.layers), cost=cost)[:, 0]


def aligned(grads: GradBatch, target: GradBatch, normalize: bool,
            cost: CostModel | None = None) -> torch.Tensor:
    """``[C]`` ``<g_b, target>`` (over ``|g_b|`` when ``normalize``: a cosine up to the target's
    norm), summed over the target's layers."""
    scores = alignment_scores(grads, target, cost)
    if normalize:
        scores = scores / norms(grads, list(target.layers), cost).clamp_min(1e-12)
    return scores


class Score(ABC):
    """One scoring rule: ``needs_probe`` (it reads per-example gradients: the probe pass),
    ``ranked`` (the rank stages apply to its scores), ``check(config)`` (what it refuses).

    Args:
        config: the selection settings.
        cost: cost model for the ops' routing.
        ctx: data-parallel group (for rules that reduce over ranks).
        documents: the target documents' model inputs (None: a target store, no text).
    """

    name: ClassVar[str]
    needs_probe: ClassVar[bool] = True
    ranked: ClassVar[bool] = True

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        SCORES.register_class(cls, name)

    def __init__(self, config: SelectionConfig, *, cost: CostModel | None = None,
                 ctx: ParallelContext | None = None, documents: Batch | None = None) -> None:
        self.config, self.cost, self.ctx = config, cost, ctx or ParallelContext()
        self.documents = documents

    @classmethod
    def check(cls, config: SelectionConfig) -> None:
        """Raise ConfigError for settings this rule cannot be combined with."""

    @abstractmethod
    def __call__(self, grads: GradBatch, rows: GradBatch | None, *,
                 text: CandidateText) -> torch.Tensor:
        """``[C]`` scores of the candidates ``grads`` against ``rows`` (None and ``grads``
        without layers when the rule ``needs_probe`` not); ``text``: the candidates' hashed
        n-grams."""


class Alignment(Score, name="alignment"):
    """``<g_b, g_t>`` (``/ |g_b|`` when ``normalize``), ``g_t`` the target gradient."""

    def __call__(self, grads, rows, *, text):
        return aligned(grads, rows, self.config.normalize, self.cost)


class ContentScore(Score, name="content"):
    """The content prior alone (selection/content.py): the mean target-vs-stream log-ratio
    of each candidate's hashed n-grams, no model and no gradient. The step runs no probe
    (its cost is that of a plain step plus hashing); the rank stages do not apply (the
    prior is the score). The settings it cannot use are refused by ``SelectionConfig``
    (``GRADIENT_SETTINGS``)."""

    needs_probe = False
    ranked = False

    def __init__(self, config, *, cost=None, ctx=None, documents=None):
        super().__init__(config, cost=cost, ctx=ctx, documents=documents)
        if documents is None:
            raise ConfigError("selection.score='content' (the default) needs the target "
                              "documents' tokens (selection.target_data or content_rows=); a "
                              "gradient target alone has none: pass them, or set "
                              "--selection-score alignment")
        self.prior = ContentPrior(documents)

    def __call__(self, grads, rows, *, text):
        return self.prior.scores_of_counts(text.counts)


def score_for(config: SelectionConfig, *, cost: CostModel | None = None,
              ctx: ParallelContext | None = None, documents: Batch | None = None) -> Score:
    """The registered rule ``config.score``, built for ``config`` and the target documents.

    Raises:
        ConfigError: settings the rule refuses (``Score.check``).
    """
    rule = SCORES.lookup(config.score)
    rule.check(config)
    return rule(config, cost=cost, ctx=ctx, documents=documents)
