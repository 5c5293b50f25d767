"""OnlineSelector: every micro-batch, score ``C = ceil(candidate_multiple * k)`` candidates
against the target and keep ``k``, folding a ``StepState`` through the stages of one arm
(gradient, content or uniform: selection/stages.py; docs/selection_stages.md). The loop then
trains on the chosen only (or back-propagates ``Selection.loss`` with ``reuse_forward``)."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from dattri_ds.capture.hooks import GradientCapture
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.distributed import ParallelContext
from dattri_ds.gradient import GradBatch
from dattri_ds.ops import CostModel
from dattri_ds.selection.blocks import probe_share, top_block_patterns
from dattri_ds.selection.cascade import cascade_for
from dattri_ds.selection.checks import check_engine_supported, check_target_compatible
from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.log import log_file, read_selection_log, writes_log
from dattri_ds.selection.rank import content_weight, rankers
from dattri_ds.selection.scorer import score_for
from dattri_ds.selection.smoothing import CandidateText
from dattri_ds.selection.stages import (
    Batch, Choose, Log, Probe, Rank, SampleIds, Selection, Shortlist, Stage, StepState,
    TextScore, Uniform,
)
from dattri_ds.selection.state import load_selector_state, selector_state
from dattri_ds.selection.stepcost import StepCost
from dattri_ds.selection.target import TargetProvider, ValidationTarget, build_target

__all__ = ["Selection", "OnlineSelector", "check_engine_supported", "check_target_compatible",
           "log_file", "writes_log", "read_selection_log"]

logger = logging.getLogger(__name__)


class OnlineSelector:
    """Chooses, each micro-batch, which candidates the engine trains on.

    Args:
        model: the module the engine calls (``engine.module``).
        config: SelectionConfig.
        target: provider of the target gradient (``build_target`` or ``for_target_data``
            build it from the config; ``probe_capture`` gives the probe it needs); the
            selector scores against it as ``rows``.
        probe: the probe capture on ``model`` (``probe_capture``).
        ctx: data-parallel group.
        log_path: jsonl file for the per-step log of chosen ids and scores (selection/log.py).
        cost: cost model for routing.
        content_rows: the target documents' model inputs for the content prior
            (``content_weight``, ``score="content"``); default: a ``ValidationTarget``'s own.
    """

    def __init__(self, model: nn.Module, config: SelectionConfig, target: TargetProvider, *,
                 probe: GradientCapture, ctx: ParallelContext | None = None,
                 log_path: str | Path | None = None, cost: CostModel | None = None,
                 content_rows: Batch | None = None) -> None:
        self.model, self.config, self.probe, self.cost = model, config, probe, cost
        self.ctx = ctx or ParallelContext()
        documents = content_rows if content_rows is not None or not isinstance(
            target, ValidationTarget) else target.data
        self.documents = documents
        self.rule = score_for(config, cost=cost, ctx=ctx, documents=documents)
        self.rows = target  # what candidates are scored against
        self._target_rows = target.rows_per_rank  # target examples this rank forwards
        self.content_weight = content_weight(config, documents) if self.rule.ranked else 0.0
        self.rankers = rankers(config, self.content_weight, documents) \
            if self.rule.ranked else []
        self.cascade = cascade_for(config, self.rankers, documents)
        self.uniform, self.log = Uniform(self.ctx), Log(config, self.ctx, log_path)
        self.scorer: Probe | None = None
        self.stages = self._arm() + [self.log]
        self.plan: StepCost | None = None  # predicted at the first step (it needs C, k)
        self._share = probe_share(model, list(probe.layers))  # of the blocks probed

    def _arm(self) -> list[Stage]:
        """The stages of this run's arm (module docstring), in order, before the log."""
        cfg, ids = self.config, SampleIds(self.probe.config)
        if cfg.random:
            return [self.uniform]
        choose = Choose(cfg.uniform_mix, self.probe.config)
        if not self.rule.needs_probe:
            return [TextScore(self.rule, ids), Rank(self.rankers), choose]
        never = (False, "the cascade's uniform share is not probed") if self.cascade else ()
        self.scorer = Probe(self.model, self.rule, self.rows, self.probe, cfg, self.cost, *never)
        shortlist = [Shortlist(self.cascade, ids)] if self.cascade is not None else []
        return [*shortlist, self.scorer, Rank(self.rankers), choose]

    @property
    def target(self) -> TargetProvider:
        """The provider of the score's rows (``rows``), the name callers use."""
        return self.rows

    @staticmethod
    def probe_capture(model: nn.Module, config: SelectionConfig,
                      capture: CaptureConfig | None = None) -> GradientCapture:
        """A probe-only capture of ``model`` with the selection's layers and projection."""
        base = capture or CaptureConfig()
        include = config.include or base.include
        if config.top_blocks is not None:
            include = top_block_patterns(model, config.top_blocks)
        cfg = replace(base, include=include,
                      projection=config.projection,
                      per_example_loss="mean" if config.per_token else base.per_example_loss)
        return GradientCapture(model, cfg, probe_only=True).attach()

    @classmethod
    def for_target_data(cls, model: nn.Module, config: SelectionConfig,
                        target_data: Batch | None, *, capture: CaptureConfig | None = None,
                        ctx: ParallelContext | None = None, device: torch.device | str = "cpu",
                        log_path: str | Path | None = None) -> OnlineSelector:
        """The selector of ``config`` on ``model``: a probe capture and the target (a
        ``ValidationTarget`` on ``target_data`` model inputs, or the store's
        ``FixedTarget``). Launch and the benchmarks build it here, so they run the same
        selection."""
        probe = cls.probe_capture(model, config, capture)
        goal = build_target(config, model, target_data, probe=probe, ctx=ctx, device=device)
        return cls(model, config, goal.gradient, probe=probe, ctx=ctx, log_path=log_path,
                   content_rows=goal.documents)

    def num_candidates(self, k: int) -> int:
        """Candidates scored for ``k`` trained examples: ``ceil(candidate_multiple * k)``."""
        return math.ceil(self.config.candidate_multiple * k - 1e-9)

    def select(self, batch: Batch, k: int, step: int, user_ids: list[str] | None = None, *,
               train_loss: bool = False) -> Selection:
        """Fold ``batch`` (C candidates) through the arm's stages; the ``k`` (or
        policy-sized) examples to train on.

        ``user_ids`` (e.g. document ids) prefix the logged sample ids. ``train_loss=True``:
        the caller back-propagates ``Selection.loss`` when it is set instead of forwarding
        the chosen batch (forward reuse, ``selection.reuse_forward``).
        """
        c, t = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
        reuse = False
        if not self.config.random:
            reuse = train_loss and self.scorer is not None and self.scorer.reusing(t, c, k)
            if self.plan is None:
                self._explain(c, k, reuse)
        text = CandidateText(batch["input_ids"], batch.get("attention_mask"))
        state = StepState(batch, k, step, user_ids, reuse=reuse, text=text)
        for stage in self.stages:
            state = stage(state)
        return state.selection

    def score(self, batch: Batch, step: int, user_ids: list[str] | None = None
              ) -> tuple[GradBatch, torch.Tensor]:
        """The target, probe and score stages alone on all of ``batch`` (no shortlist,
        rank, choice or log): the candidates' gradients (a rule that needs no probe: ids and
        no layers) and their ``[P]`` scores, candidates with a NaN/inf gradient or score
        dropped."""
        stage = self.scorer or TextScore(self.rule, SampleIds(self.probe.config))
        text = CandidateText(batch["input_ids"], batch.get("attention_mask"))
        s = stage(StepState(batch, 0, step, user_ids, text=text))
        return s.grads, s.scores

    def _explain(self, candidates: int, trained: int, reuse: bool) -> None:
        """Predict this run's step cost (selection/stepcost.py) and log it once (rank 0)."""
        cfg, layers, probing = self.config, list(self.probe.layers), self.scorer is not None
        self.plan = StepCost(
            candidates=candidates, trained=trained, share=self._share,
            normalize=cfg.normalize, target_examples=self._target_rows,
            refresh_every=cfg.refresh_every, reuse=reuse, probe=probing,
            probed=None if self.cascade is None else self.cascade.size(trained, candidates))
        if self.ctx.dp_rank != 0:
            return
        if not probing:
            scored, why = "(the target's n-grams, no probe)", "no probe forward to reuse"
        else:
            blocks = f"top {cfg.top_blocks} block(s), " if cfg.top_blocks else ""
            space = f"projected to {cfg.projection.dim}" if cfg.projection else \
                "exact ghost scores"
            scored = f"({blocks}{len(layers)} layers, {space})"
            why = self.scorer.why if reuse or not self.scorer.reuse else \
                "the caller forwards the chosen itself (select(train_loss=False))"
        logger.info(self.plan.explain(f"score '{cfg.score}' {scored}", why))

    def summary(self) -> dict:
        """Selection statistics of the run so far, over all data-parallel ranks.

        Collective over the data-parallel group (every DP rank must call it).
        """
        device = next(self.model.parameters()).device
        st = self.log.totals(device)
        return {"score": self.config.score, "micro_batches": st["steps"],
                "candidates": st["candidates"], "chosen": st["chosen"],
                "mean_candidate_score": st["score_sum"] / max(1, st["candidates"]),
                "mean_chosen_score": st["chosen_score_sum"] / max(1, st["chosen"]),
                "target_refreshes": self.rows.refreshes,
                **({"cascade": self.cascade.summary(self.ctx, device)}
                   if self.cascade is not None else {})}

    def close(self) -> None:
        self.probe.detach()
        self.log.close()

    def components(self) -> dict:
        """The stateful parts a checkpoint saves (selection/state.py), by name."""
        return {"rule": self.rule, "rows": self.rows, "cascade": self.cascade,
                "uniform": self.uniform, "log": self.log}

    def state_dict(self) -> dict:
        """The selector's running state for a checkpoint, one entry per stateful component
        (selection/state.py lists them): plain tensors, numbers, strings, lists and dicts,
        readable with ``torch.load(weights_only=True)``. Flushes the selection log."""
        return selector_state(self)

    def load_state_dict(self, state: dict, log: list[str] | tuple[str, ...] = ()) -> None:
        """Restore ``state_dict()`` and continue the log with ``log`` (its lines of the
        steps before the resumed one), so the run goes on as if never stopped.

        Raises:
            ConfigError: a state that does not fit this selector's stages.
        """
        load_selector_state(self, state, log)
