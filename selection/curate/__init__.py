"""Offline curation (LESS workflow): pick a training subset from stored pool gradients.

``curate(config, stores, pool, ...)`` (``run.py``) scores every pool row against a target
with a registered method (``methods.py``), keeps a budget (``budget.py``) under diversity
caps, and writes the subset, scores and report (``writer.py``). ``tools/curate.py`` is its
command line (``dattri-ds curate``); docs/curation.md is the recipe.
"""

from __future__ import annotations

from dattri_ds.selection.curate.budget import Budget, choose, rank_order, resolve_budget
from dattri_ds.selection.curate.config import CurateConfig
from dattri_ds.selection.curate.methods import METHODS, CurationMethod, cosine_scores, get_method
from dattri_ds.selection.curate.pool import Pool
from dattri_ds.selection.curate.run import CurateResult, curate
from dattri_ds.selection.curate.scoring import memory_bound, score_pool

__all__ = ["CurateConfig", "CurateResult", "curate", "Pool", "Budget", "resolve_budget",
           "choose", "rank_order", "METHODS", "CurationMethod", "get_method",
           "cosine_scores", "memory_bound", "score_pool"]
