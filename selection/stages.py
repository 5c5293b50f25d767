"""The stages of a selection step: objects built once from the config, each called as
``stage(state) -> state`` on the step's ``StepState``; the last one's ``Selection`` is the
outcome. A stage keeps only what outlives a step (saved with the selector's state). The
arms' stage lists: docs/selection_stages.md."""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from dattri_ds.capture.hooks import GradientCapture
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.errors import CaptureError, ConfigError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops import CostModel, default_cost_model
from dattri_ds.ops.projection import stable_seed
from dattri_ds.selection.cascade import Cascade, needed
from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.log import log_file, remove_stale_logs, writes_log
from dattri_ds.selection.policy import fill_uniform, mixed
from dattri_ds.selection.rank import Ranker
from dattri_ds.selection.scorer import Score
from dattri_ds.selection.smoothing import CandidateText
from dattri_ds.selection.stepcost import decide_reuse
from dattri_ds.selection.target import TargetProvider
from dattri_ds.capture.semantics import batch_info, content_id

__all__ = ["Batch", "Selection", "StepState", "Stage", "SampleIds", "Shortlist", "TextScore",
           "Probe", "Rank", "Choose", "Uniform", "Log", "generator"]


Batch = dict[str, torch.Tensor]

#: The run statistics the ``Log`` stage counts (``OnlineSelector.summary``).
_STATS = ("steps", "candidates", "chosen", "score_sum", "chosen_score_sum")


@dataclass(frozen=True)
class Selection:
    """The outcome of one selection.

    Attributes:
        batch: model inputs of the chosen examples (``[k, T]`` tensors).
        indices: chosen candidate indices (into this rank's candidates).
        scores: ``[C]`` scores of this rank's candidates (of the kept ones when candidates
            with a NaN/inf gradient or score were dropped).
        chosen_ids: sample ids (content hashes) of the chosen examples.
        chosen_scores: ``[k]`` their scores.
        loss: with ``reuse_forward``, the model's loss on ``batch`` computed from the
            candidates' retained forward graphs: back-propagate it instead of forwarding
            ``batch`` again. None: forward ``batch`` as usual.
        probed: the positions of the candidates ``scores`` covers when not all were
            probed (the cascade's shortlist less dropped ones); ``chosen_scores`` is NaN for
            chosen examples outside it (the uniform share). None: ``scores`` covers all.
    """

    batch: Batch
    indices: torch.Tensor
    scores: torch.Tensor
    chosen_ids: tuple[str, ...]
    chosen_scores: torch.Tensor
    loss: torch.Tensor | None = None
    probed: torch.Tensor | None = None


@dataclass(frozen=True)
class StepState:
    """One micro-batch's selection so far.

    Attributes:
        batch: all ``C`` candidates' model inputs.
        k: examples to train from them.
        step: the optimizer step.
        user_ids: prefixes of the candidates' sample ids (e.g. document ids), or None.
        reuse: the probe keeps one graph per candidate for the training backward.
        text: the hashed n-grams of the candidates in play (``pool``).
        pool: positions (into ``batch``) of the candidates in play: the shortlist, less
            those dropped for a non-finite gradient or score. None: all ``C``.
        shortlisted: ``pool`` is the cascade's shortlist (the uniform share then comes
            from all ``C``, and ``Selection.probed`` names the pool).
        ids: sample ids of all ``C`` candidates, when a stage computed them without a
            probe (the shortlist, a text score).
        grads: the per-example gradients of the candidates in play (no layers for a score
            that reads none).
        scores: ``[P]`` scores of the candidates in play (float32, CPU): what is logged.
        ranked: ``[P]`` what the policy ranks (the scores through the rank stages).
        losses: with ``reuse``, the probed candidates' own losses (one graph each).
        selection: the outcome, set by the choosing stage.
    """

    batch: Batch
    k: int
    step: int
    user_ids: list[str] | None = None
    reuse: bool = False
    text: CandidateText | None = None
    pool: torch.Tensor | None = None
    shortlisted: bool = False
    ids: tuple[str, ...] | None = None
    grads: GradBatch | None = None
    scores: torch.Tensor | None = None
    ranked: torch.Tensor | None = None
    losses: tuple[torch.Tensor, ...] | None = None
    selection: Selection | None = None

    @property
    def candidates(self) -> int:
        """``C``: the micro-batch's candidates."""
        return self.batch["input_ids"].shape[0]

    def rows(self, positions: torch.Tensor) -> Batch:
        """The model inputs of the candidates at ``positions`` (into ``batch``)."""
        return {n: v[positions.to(v.device)] for n, v in self.batch.items()}

    def in_play(self) -> tuple[Batch, list[str] | None]:
        """The model inputs and user ids of the candidates in play (``pool``)."""
        if self.pool is None:
            return self.batch, self.user_ids
        users = None if self.user_ids is None else [self.user_ids[i] for i in self.pool.tolist()]
        return self.rows(self.pool), users


class Stage(Protocol):
    """One stage of a selection step."""

    def __call__(self, state: StepState) -> StepState: ...


def generator(step: int, ids) -> torch.Generator:
    """Seeded by the step and the candidates' content ids: mixed choices replay
    exactly and do not depend on the parallel layout (DP rank, accumulation, TP)."""
    return torch.Generator().manual_seed(stable_seed("select", step, *ids))


class SampleIds:
    """The candidates' sample ids as the probe would record them (content hashes under the
    capture's label shift and ignore index, user ids as prefixes), without a probe pass."""

    def __init__(self, capture: CaptureConfig) -> None:
        self.capture = capture

    def __call__(self, batch: Batch, user_ids: list[str] | None) -> tuple[str, ...]:
        return batch_info((), batch, label_shift=self.capture.label_shift,
                          ignore_index=self.capture.ignore_index, user_ids=user_ids).sample_ids


class Shortlist:
    """The cascade (selection/cascade.py): the content prior ranks all ``C`` candidates,
    the top ``S`` stay in play."""

    def __init__(self, cascade: Cascade, ids: SampleIds) -> None:
        self.cascade, self.ids = cascade, ids

    def __call__(self, s: StepState) -> StepState:
        ids = self.ids(s.batch, s.user_ids)
        short, text = self.cascade(s.text, s.k)
        return replace(s, pool=short, text=text, shortlisted=True, ids=ids)


class TextScore:
    """The score of a rule that reads text only (``score="content"``): no probe, no target."""

    def __init__(self, rule: Score, ids: SampleIds) -> None:
        self.rule, self.ids = rule, ids

    def __call__(self, s: StepState) -> StepState:
        ids = self.ids(s.batch, s.user_ids)
        grads = GradBatch(step=s.step, sample_ids=ids, layers={})
        scores = self.rule(grads, None, text=s.text)
        return replace(s, ids=ids, grads=grads, scores=scores.detach().float().cpu())


class Probe:
    """The target, probe and score stages of a gradient rule: the target's rows for the
    step (refreshed by their provider), one forward and an output-gradient-only backward of
    the candidates in play (``GradientCapture.probe``: no parameter gradient, so ZeRO-3's
    partitioned gradients are never touched), and the rule's ``[P]`` scores.

    Candidates with a NaN/inf gradient or score leave the pool (named in a warning).

    Args:
        model: the module the engine calls.
        rule: the registered ``Score``.
        rows: the provider of what candidates are scored against.
        probe: the probe capture on ``model``.
        config: the selection settings (``reuse_forward``).
        cost: cost model (its roofline weighs forward reuse).
        reuse: None: decided at the first step (``decide_reuse``); False: never (``why``).
    """

    def __init__(self, model: nn.Module, rule: Score, rows: TargetProvider,
                 probe: GradientCapture, config: SelectionConfig, cost: CostModel | None,
                 reuse: bool | None = None, why: str = "") -> None:
        self.model, self.rule, self.rows, self.probe = model, rule, rows, probe
        self.config, self.cost = config, cost
        self.reuse, self.why = reuse, why

    def reusing(self, tokens: int, candidates: int, trained: int) -> bool:
        """Reuse this step's forward? Decided once by ``decide_reuse``; never with a
        recording capture on the model (it does not record probe forwards): ``auto`` then
        turns reuse off, ``on`` is refused."""
        if self.reuse is None:
            device = next(self.model.parameters()).device
            roofline = (self.cost or default_cost_model(device)).roofline
            self.reuse, self.why = decide_reuse(
                self.config.reuse_forward, self.model, tokens=tokens,
                candidates=candidates, trained=trained, layers=len(self.probe.layers),
                flops_per_s=roofline.flops_per_s)
        if not self.reuse or getattr(self.model, "_dattri_ds_capture", None) is None:
            return self.reuse
        if self.config.reuse_forward == "on":
            raise ConfigError("selection.reuse_forward='on' trains on graphs built during the "
                              "probe, which a recording GradientCapture (--capture) does not "
                              "record: set selection.reuse_forward='auto' or 'off' to capture")
        self.reuse, self.why = False, "a recording capture is attached"
        return False

    def __call__(self, s: StepState) -> StepState:
        batch, users = s.in_play()
        rows = self.rows.get(s.step)
        dropped = self.probe.skipped
        losses: list[torch.Tensor] = []
        if s.reuse:
            grads = self.probe.probe(lambda: self._per_example(batch, users, losses),
                                     retain_graph=True)
        else:
            if users is not None:
                self.probe.tag(users)
            grads = self.probe.probe(lambda: self.model(**batch).loss)
        if grads is None:
            if self.probe.skipped > dropped:
                raise CaptureError(
                    f"Every candidate of step {s.step} has a NaN/inf gradient (the model's "
                    f"loss is non-finite: training diverged, or the inputs hold NaN/inf); "
                    f"nothing can be selected. Lower the learning rate or check the data")
            raise ConfigError("The probe pass captured nothing: the model's loss does not "
                              "depend on any captured layer")
        kept = grads.kept
        scores = self.rule(grads, rows, text=s.text)
        finite = torch.isfinite(scores)
        if not bool(finite.all()):
            ok = torch.nonzero(finite.cpu()).flatten()
            if ok.numel() == 0:
                raise CaptureError(
                    f"Every candidate score of step {s.step} is NaN/inf although the "
                    f"candidates' gradients are finite: the target gradient is non-finite (its "
                    f"model diverged, or a target text has no loss token); nothing can be "
                    f"selected")
            bad = [grads.sample_ids[i] for i in torch.nonzero(~finite.cpu()).flatten().tolist()]
            warnings.warn(f"Step {s.step}: candidate(s) {bad[:5]} have a NaN/inf selection "
                          f"score and are dropped", stacklevel=2)
            grads, scores = grads.index(ok), scores[ok.to(scores.device)]
            kept = ok if kept is None else kept[ok]
        out = replace(s, grads=grads, scores=scores.detach().float().cpu(),
                      losses=tuple(losses) if s.reuse else None)
        if kept is None:
            return out
        return replace(out, pool=kept if s.pool is None else s.pool[kept],
                       text=s.text.subset(kept))

    def _per_example(self, batch: Batch, users: list[str] | None,
                     losses: list[torch.Tensor]) -> torch.Tensor:
        """``reuse_forward``: one model call per candidate (one graph each); the calls'
        losses are kept in ``losses`` and their sum is probed."""
        for i in range(batch["input_ids"].shape[0]):
            if users is not None:
                self.probe.tag(users[i:i + 1])
            losses.append(self.model(**{n: v[i:i + 1] for n, v in batch.items()}).loss)
        return torch.stack(losses).sum()


class Rank:
    """The rank stages (selection/rank.py: neighbour smoothing, the content prior), in
    order, turn the scores into what the policy ranks."""

    def __init__(self, rankers: list[Ranker]) -> None:
        self.rankers = rankers

    def __call__(self, s: StepState) -> StepState:
        ranked = s.scores
        for stage in self.rankers:
            ranked = stage(ranked, s.text)
        return replace(s, ranked=ranked)


class Choose:
    """The policy and the uniform mix (selection/policy.py ``mixed``) on this rank's
    candidates: the top ``n = k - round(uniform_mix * k)`` of those in play, a seeded
    uniform draw fills up to ``k`` (from all ``C`` when the pool is a shortlist).

    Args:
        uniform_mix: ``selection.uniform_mix``.
        capture: the probe's capture settings (the reused loss's reduction).
    """

    def __init__(self, uniform_mix: float, capture: CaptureConfig) -> None:
        self.uniform_mix, self.capture = uniform_mix, capture

    def __call__(self, s: StepState) -> StepState:
        if s.shortlisted:
            return replace(s, selection=self._from_shortlist(s))
        idx = mixed(s.ranked, s.k, uniform_mix=self.uniform_mix,
                    generator=generator(s.step, s.grads.sample_ids))
        positions = idx if s.pool is None else s.pool[idx]
        sel = Selection(s.rows(positions), positions, s.scores,
                        tuple(s.grads.sample_ids[i] for i in idx.tolist()), s.scores[idx],
                        self._reused_loss(s, positions))
        return replace(s, selection=sel)

    def _from_shortlist(self, s: StepState) -> Selection:
        """The policy's ``n`` among the shortlist, the uniform share from all ``C``; chosen
        examples outside the shortlist have a NaN score."""
        c = s.candidates
        picked = mixed(s.ranked, needed(s.k, c, self.uniform_mix), uniform_mix=0.0,
                       generator=generator(s.step, s.grads.sample_ids))
        chosen = s.pool[picked]
        if chosen.numel() < min(s.k, c):
            chosen = fill_uniform(chosen, c, min(s.k, c), generator(s.step, s.ids))
        chosen_scores = torch.full((chosen.numel(),), float("nan"))
        where = {p: i for i, p in enumerate(s.pool.tolist())}
        for j, p in enumerate(chosen.tolist()):
            if p in where:
                chosen_scores[j] = s.scores[where[p]]
        return Selection(s.rows(chosen), chosen, s.scores,
                         tuple(s.ids[i] for i in chosen.tolist()), chosen_scores,
                         probed=s.pool)

    def _reused_loss(self, s: StepState, positions: torch.Tensor) -> torch.Tensor | None:
        """The model's loss on the candidates at ``positions`` from their retained graphs,
        reduced like one batch of them (``capture.loss_reduction``): token mean
        ``sum_i n_i L_i / sum_i n_i`` (``n_i`` label tokens), example mean, or sum."""
        if s.losses is None:
            return None
        cap = self.capture
        chosen = torch.stack([s.losses[i] for i in positions.tolist()])
        if cap.loss_reduction == "sum":
            return chosen.sum()
        if cap.loss_reduction == "example_mean":
            return chosen.mean()
        batch = s.batch
        labels = batch.get("labels", batch["input_ids"])[positions.to(batch["input_ids"].device)]
        n = (labels[:, cap.label_shift:] != cap.ignore_index).sum(1).to(chosen.dtype)
        return (chosen * n.to(chosen.device)).sum() / n.sum().clamp_min(1)


class Uniform:
    """The uniform arm (``random``): a seeded uniform draw of ``k`` candidates, no scoring;
    the seed counts this rank's draws (saved with the selector's state)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx, self.draws = ctx, 0

    def __call__(self, s: StepState) -> StepState:
        c = s.candidates
        self.draws += 1
        gen = torch.Generator().manual_seed(stable_seed("random", s.step, self.ctx.dp_rank,
                                                        self.draws))
        idx = torch.randperm(c, generator=gen)[:min(s.k, c)].sort().values
        rows = s.batch["input_ids"][idx]
        users = s.user_ids
        ids = tuple(content_id(row, None, None if users is None else users[i])
                    for row, i in zip(rows, idx.tolist()))
        sel = Selection(s.rows(idx), idx, torch.zeros(c), ids, torch.zeros(len(idx)))
        return replace(s, selection=sel)

    def state_dict(self) -> dict:
        return {"draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.draws = int(state["draws"])


class Log:
    """The last stage: counts the selection into the run statistics and writes its record.

    Args:
        config: the selection settings (``log_scores``).
        ctx: data-parallel group.
        log_path: the run's ``selection.jsonl`` (None: no log), rewritten by every run
            (training restarts at step 0); rank 0 removes logs of ranks a previous, wider
            run left behind.
    """

    def __init__(self, config: SelectionConfig, ctx: ParallelContext,
                 log_path: str | Path | None) -> None:
        self.ctx = ctx
        if log_path is not None and ctx.dp_rank == 0:
            remove_stale_logs(log_path, ctx.dp_world)
        self._file = open(log_file(log_path, ctx.dp_rank), "w", encoding="utf-8") if (
            log_path is not None and writes_log(config, ctx)) else None
        self.stats = {"steps": 0, "candidates": 0, "chosen": 0, "score_sum": 0.0,
                      "chosen_score_sum": 0.0}

    def __call__(self, state: StepState) -> StepState:
        sel, st = state.selection, self.stats
        st["steps"] += 1
        st["candidates"] += sel.scores.numel()
        st["chosen"] += sel.indices.numel()
        st["score_sum"] += float(sel.scores.sum())
        finite = sel.chosen_scores[torch.isfinite(sel.chosen_scores)]
        st["chosen_score_sum"] += float(finite.sum())
        if self._file is not None:
            record = {
                "step": state.step, "dp_rank": self.ctx.dp_rank, "chosen": list(sel.chosen_ids),
                "chosen_scores": [round(float(s), 6) if math.isfinite(s) else None
                                  for s in sel.chosen_scores.tolist()],
                "candidate_scores": [round(float(s), 6) for s in sel.scores]}
            if sel.probed is not None:
                record["probed"] = sel.probed.tolist()
            self._file.write(json.dumps(record) + "\n")
        return state

    def totals(self, device: torch.device | str) -> dict:
        """The run statistics summed over the data-parallel ranks (collective)."""
        local = torch.tensor([float(self.stats[k]) for k in _STATS], dtype=torch.float64,
                             device=device)
        total = all_reduce_sum(local, self.ctx.dp_group, self.ctx.dp_world).tolist()
        return {k: (v if k.endswith("sum") else int(round(v))) for k, v in zip(_STATS, total)}

    def flush(self) -> None:
        """Write the log through to disk (before a checkpoint records how far it got)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def resume(self, lines: list[str] | tuple[str, ...]) -> None:
        """Continue the log with ``lines`` (a checkpoint's records before the resumed step)."""
        if self._file is not None and lines:
            self._file.writelines(line if line.endswith("\n") else line + "\n"
                                  for line in lines)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def state_dict(self) -> dict:
        return {"stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        self.stats.clear()
        self.stats.update(state["stats"])
