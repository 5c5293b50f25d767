"""Scoring: candidates x rows -> ``scores [C]``, one registered ``Score`` class per rule.

A ``Score`` knows everything about its rule that the rest of a selection step asks:

* ``needs_probe``: it reads the candidates' per-example gradients (the probe pass; a rule
  without it scores the candidates' text alone and the step runs no probe at all);
* ``ranked``: the rank stages (neighbour smoothing, the content prior) apply to its scores;
* ``pool_rows``: how many candidate rows it keeps as a sample of the training pool
  (``PoolSample``; 0 = no pool), and ``rows``: the provider of what candidates are scored
  against, built from the target gradient (and the pool's mean gradient when it has one);
* ``scale``: its values are on a calibrated scale (a cosine, an inner product) that a
  policy reading the scores' own scale (``threshold``'s tau, GREATS' learning-rate gain) may
  use; a rule without one can only be ranked;
* ``check(config)``: the settings it cannot be combined with (at config time);
* ``__call__(grads, rows, others=..., text=...)``: the ``[C]`` scores (``text``: the
  candidates' hashed n-grams, ``CandidateText``).

The shared measure, ``score_b = <g_b, g_target>`` summed over the target's layers, is routed
ghost vs dense by the cost model: a factorized candidate against a dense target costs
``2*T*I*O`` per example and never builds the per-example weight gradient (``cross_dense``).

A new rule is one subclass, ``class MyScore(Score, name="mine")``, plus ``"mine"`` in
``SelectionConfig.score``'s ``Literal``; nothing else changes.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import ConfigError, ShapeError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops import CostModel, cross_gram, norms
from dattri_ds.registry import Registry
from dattri_ds.selection.content import ContentPrior
from dattri_ds.selection.contrast import ContrastTarget, PoolSample
from dattri_ds.selection.smoothing import CandidateText
from dattri_ds.selection.stepscore import StepTarget, step_scores
from dattri_ds.selection.target import TargetProvider

if TYPE_CHECKING:
    from dattri_ds.selection.config import SelectionConfig

__all__ = ["alignment_scores", "redundancy_gram", "aligned", "Score", "SCORES", "Alignment",
           "StepAlignment", "ContentScore", "score_for"]

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


def redundancy_gram(candidates: GradBatch, layers: list[str],
                    cost: CostModel | None = None) -> torch.Tensor:
    """``[C, C]`` pairwise inner products among candidates (GREATS' redundancy term)."""
    return cross_gram(candidates, candidates, layers=layers, cost=cost)


def aligned(grads: GradBatch, target: GradBatch, normalize: bool,
            cost: CostModel | None = None) -> torch.Tensor:
    """``[C]`` ``<g_b, target>`` (over ``|g_b|`` when ``normalize``: a cosine up to the target's
    norm), summed over the target's layers; also the held-out check's measure."""
    scores = alignment_scores(grads, target, cost)
    if normalize:
        scores = scores / norms(grads, list(target.layers), cost).clamp_min(1e-12)
    return scores


class Score(ABC):
    """One scoring rule (see the module docstring for what each property means).

    Args:
        config: the selection settings.
        cost: cost model for the ops' routing.
        ctx: data-parallel group (for rules that reduce over ranks).
        documents: the target documents' model inputs (None: a target store, no text).
    """

    name: ClassVar[str]
    needs_probe: ClassVar[bool] = True
    ranked: ClassVar[bool] = True
    scale: ClassVar[bool] = True

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        SCORES.register_class(cls, name)

    def __init__(self, config: SelectionConfig, *, cost: CostModel | None = None,
                 ctx: ParallelContext | None = None, documents: Batch | None = None) -> None:
        self.config, self.cost, self.ctx = config, cost, ctx or ParallelContext()
        self.documents = documents
        self.pool_rows = self.pool_size(config)
        """Candidate rows kept as the pool sample (0: the rule needs no pool)."""
        self.needs_pool = self.pool_rows > 0

    @classmethod
    def check(cls, config: SelectionConfig) -> None:
        """Raise ConfigError for settings this rule cannot be combined with."""

    @classmethod
    def pool_size(cls, config: SelectionConfig) -> int:
        """Candidate rows this rule keeps as the pool sample under ``config`` (0: none)."""
        return 0

    def rows(self, gradient: TargetProvider, pool: PoolSample | None,
             reference: Callable[[Batch], TargetProvider] | None) -> TargetProvider:
        """The provider of the rows candidates are scored against (default: the target
        gradient itself). ``reference`` builds the pool's gradient provider from its rows."""
        return gradient

    @abstractmethod
    def __call__(self, grads: GradBatch, rows: GradBatch | None, *, others: int,
                 text: CandidateText) -> torch.Tensor:
        """``[C]`` scores of the candidates ``grads`` against ``rows`` (None and ``grads``
        without layers when the rule ``needs_probe`` not); ``others``: the training step's
        other examples (all ranks); ``text``: the candidates' hashed n-grams."""


class Alignment(Score, name="alignment"):
    """``<g_b, d>`` (``/ |g_b|`` when ``normalize``), ``d`` the target gradient, or with
    ``contrast = w > 0`` the contrastive direction ``g_t/|g_t| - w g_pool/|g_pool|``
    (selection/contrast.py); ``precondition`` has already shaped the target gradient."""

    @classmethod
    def pool_size(cls, config):
        return config.contrast_rows if config.contrast > 0 else 0

    def rows(self, gradient, pool, reference):
        if self.config.contrast > 0:
            return ContrastTarget(gradient, pool, reference, self.config.contrast)
        return gradient

    def __call__(self, grads, rows, *, others, text):
        return aligned(grads, rows, self.config.normalize, self.cost)


class StepAlignment(Score, name="step"):
    """The expected cosine of the training step's summed gradient with the target when the
    candidate takes one of its slots (selection/stepscore.py); rows ``[g_t; p]``, ``p`` the
    pool sample's mean gradient. The pool's weight is measured, so ``contrast`` and
    ``normalize`` do not apply."""

    @classmethod
    def check(cls, config):
        if config.precondition != "none":
            raise ConfigError(f"selection.score='step' measures the step in the plain metric: "
                              f"it cannot be combined with selection.precondition="
                              f"'{config.precondition}'; set precondition='none' or "
                              f"score='alignment'")

    @classmethod
    def pool_size(cls, config):
        return config.contrast_rows

    def rows(self, gradient, pool, reference):
        return StepTarget(gradient, pool, reference)

    def __call__(self, grads, rows, *, others, text):
        return step_scores(grads, rows, others, self.cost, self.ctx)


class ContentScore(Score, name="content"):
    """The content prior alone (selection/content.py): the mean target-vs-stream log-ratio
    of each candidate's hashed n-grams, no model and no gradient. The step runs no probe
    (its cost is that of a plain step plus hashing); the values only rank (no scale), and
    the rank stages do not apply (the prior is the score)."""

    needs_probe = False
    ranked = False
    scale = False

    @classmethod
    def check(cls, config):
        bad = {"target_store": config.target_store is not None,
               "validation_fraction": config.validation_fraction > 0,
               "precondition": config.precondition != "none", "contrast": config.contrast > 0,
               "reuse_forward": config.reuse_forward == "on"}
        for key, on in bad.items():
            if on:
                raise ConfigError(
                    f"selection.score='content' ranks by the target documents' n-grams with "
                    f"no gradient: selection.{key}={getattr(config, key)!r} needs one (or a "
                    f"forward to reuse); unset {key} or use score='alignment'")
        if config.content_weight:
            warnings.warn(f"selection.content_weight={config.content_weight} has no effect "
                          f"with score='content' (the content prior is the score)",
                          stacklevel=3)

    def __init__(self, config, *, cost=None, ctx=None, documents=None):
        super().__init__(config, cost=cost, ctx=ctx, documents=documents)
        if documents is None:
            raise ConfigError("selection.score='content' (the default when the target is "
                              "not a store) needs the target documents' tokens "
                              "(selection.target_data or content_rows=); a gradient target "
                              "alone has none: pass them, or set selection.score='alignment'")
        self.prior = ContentPrior(documents)

    def __call__(self, grads, rows, *, others, text):
        return self.prior.scores_of_counts(text.counts)


def score_for(config: SelectionConfig, *, cost: CostModel | None = None,
              ctx: ParallelContext | None = None, documents: Batch | None = None) -> Score:
    """The registered rule ``config.score``, built for ``config`` and the target documents."""
    return SCORES.lookup(config.score)(config, cost=cost, ctx=ctx, documents=documents)
