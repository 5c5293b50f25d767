"""OnlineSelector: every micro-batch, score candidates against the target and keep the best.

A step (``select``, ``C = ceil(candidate_multiple * k)`` candidates, ``k`` trained) runs these
stages in order, each a small object built once from the config:

1. **arm** (the run-time controller, ``controller``; selection/controller.py): at each
   block edge the held-out target loss is measured and the arm of the next block chosen:
   ``uniform`` (a seeded uniform draw; no stage below runs), ``content`` (the content prior
   ranks all candidates, then stages 7-8 and 11; no probe) or ``gradient`` (every stage
   below); without a controller every step is ``gradient``;
2. **target**: the score's rows for this step (``Score.rows`` over the target gradient,
   refreshed every ``refresh_every`` steps; selection/target.py builds and shapes it);
3. **shortlist** (the cascade, ``shortlist``; selection/cascade.py): the content prior
   ranks all ``C`` candidates and only the top ``S = ceil(shortlist * n)`` go on to the
   probe, ``n = k - round(uniform_mix * k)`` (stages 4-8 then see those ``S``; without
   ``shortlist``: all ``C``);
4. **probe**: one forward and a backward that computes only the captured layers'
   output-gradients (``GradientCapture.probe``): no parameter gradient, so DeepSpeed
   ZeRO-3's partitioned gradients and reductions are never touched (skipped when the
   ``Score`` needs no gradients);
5. **score**: the registered ``Score`` of ``selection.score`` maps the candidates'
   gradients and the rows to ``[C]`` scores (selection/scorer.py); non-finite ones dropped;
6. **rank**: the ``Ranker`` stages (neighbour smoothing, the content prior) turn the scores
   into what the policy ranks (selection/rank.py);
7. **repeat cap**: candidates trained ``max_repeats`` times already go last;
8. **policy + uniform mix**: the registered ``Policy`` picks ``n`` (with the candidates'
   gram when it ``needs_gram``), a seeded uniform draw from all ``C`` candidates it did not
   pick fills up to ``k`` (selection/policy.py);
9. **scope**: per rank, or globally: the candidates' scores and token tensors are gathered
   from every data-parallel rank (``C * T`` integers each, never gradients), ``k * world``
   picked and dealt out round-robin by score, so every rank trains exactly ``k``;
10. **held-out check**: the chosen examples' advantage on the held-out target documents
    (``validation_fraction``) decides a fallback to uniform choice (selection/fallback.py;
    off under the controller, which decides instead);
11. **log**: chosen ids and scores to ``selection.jsonl`` and the run statistics.

The training loop then runs its ordinary forward/backward on the chosen examples only, so
the update is exactly that of a batch which never contained the others (or back-propagates
``Selection.loss`` from the retained probe graphs with ``reuse_forward``).
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from dattri_ds.capture import GradientCapture
from dattri_ds.config import CaptureConfig
from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.errors import CaptureError, ConfigError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops import CostModel, default_cost_model
from dattri_ds.ops.projection import stable_seed
from dattri_ds.semantics import batch_info, content_id
from dattri_ds.selection.blocks import probe_share, top_block_patterns
from dattri_ds.selection.cascade import PriorText, cascade_for, needed, shared_prior
from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.contrast import PoolSample
from dattri_ds.selection.controller import controller_for
from dattri_ds.selection.fallback import HeldOutCheck
from dattri_ds.selection.policy import POLICIES, cap_repeats, fill_uniform
from dattri_ds.selection.rank import CandidateText, content_weight, rankers
from dattri_ds.selection.scorer import aligned, score_for
from dattri_ds.selection.stepcost import StepCost, decide_reuse
from dattri_ds.selection.target import (
    Target, TargetProvider, build_target, pool_reference, prepare,
)

__all__ = ["Selection", "OnlineSelector", "check_engine_supported", "check_target_compatible"]

Batch = dict[str, torch.Tensor]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """The outcome of one selection.

    Attributes:
        batch: model inputs of the chosen examples (``[k, T]`` tensors).
        indices: chosen candidate indices (into this rank's candidates for rank scope, into
            the rank-major concatenation of all ranks' candidates for global scope).
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


def check_engine_supported(engine: object) -> None:
    """Raise ConfigError, before any step, for DeepSpeed features selection cannot serve."""
    names = {c.__name__ for c in type(engine).__mro__}
    if "PipelineEngine" in names:
        raise ConfigError("Online selection does not support DeepSpeed pipeline parallelism "
                          "(PipelineEngine): candidates must be scored by one module call. Use "
                          "ZeRO data parallelism, or turn selection off")
    cfg = getattr(engine, "_config", None)
    if cfg is not None and getattr(cfg, "sequence_parallel_size", 1) > 1:
        raise ConfigError("Online selection does not support DeepSpeed sequence parallelism "
                          "(sequence_parallel_size > 1)")
    data_eff = getattr(cfg, "data_efficiency_config", None) or {}
    if isinstance(data_eff, dict) and data_eff.get("enabled"):
        raise ConfigError("Online selection and DeepSpeed data_efficiency both reorder the "
                          "training data; enable only one of them")


def check_target_compatible(train: object, target: object) -> None:
    """Refuse target data tokenized differently from the training data (before any step).

    Both arguments are ``TokenizedDocuments``-like: ``tokenizer_fingerprint`` and ``seq_len``.
    """
    tf = getattr(train, "tokenizer_fingerprint", "")
    gf = getattr(target, "tokenizer_fingerprint", "")
    if tf and gf and tf != gf:
        raise ConfigError(f"The target data was tokenized with '{gf}' but the training data with "
                          f"'{tf}': tokenize the target texts with the training tokenizer")
    if train.seq_len != target.seq_len:
        raise ConfigError(f"Target examples have {target.seq_len} tokens but training examples "
                          f"have {train.seq_len}: tokenize both with the same seq_len")
    if len(target) == 0:
        raise ConfigError("The target set is empty: give selection.target_data at least one "
                          "document")


def _text(batch: Batch) -> CandidateText:
    return CandidateText(batch["input_ids"], batch.get("attention_mask"))


def log_file(log_path: str | Path, dp_rank: int) -> Path:
    """The selection log of a data-parallel rank: ``log_path`` itself for rank 0, else
    ``<stem>.dp<rank><suffix>`` next to it (``selection.dp1.jsonl``)."""
    p = Path(log_path)
    return p if dp_rank == 0 else p.with_name(f"{p.stem}.dp{dp_rank}{p.suffix}")


def writes_log(config: SelectionConfig, ctx: ParallelContext) -> bool:
    """Whether this rank writes a selection log: every DP rank under local scope with
    several ranks, else DP rank 0 only (``log_scores`` on)."""
    per_rank = config.scope != "global" and ctx.dp_world > 1
    return config.log_scores and (per_rank or ctx.dp_rank == 0)


def _remove_stale_logs(log_path: str | Path, writers: int) -> None:
    """Delete ``<stem>.dp<r><suffix>`` for ``r >= writers`` (files no rank of this run owns)."""
    p = Path(log_path)
    for f in p.parent.glob(f"{p.stem}.dp*{p.suffix}"):
        rank = f.name[len(p.stem) + 3:len(f.name) - len(p.suffix)]
        if rank.isdigit() and int(rank) >= writers:
            f.unlink(missing_ok=True)


def read_selection_log(log_path: str | Path) -> list[dict]:
    """Every record of a run's selection log, all DP ranks' files merged, ordered by
    ``(step, dp_rank)`` (a rank's micro-batches keep their order). Missing log: ``[]``."""
    p = Path(log_path)
    files = [p] if p.exists() else []
    files += sorted(p.parent.glob(f"{p.stem}.dp*{p.suffix}"))
    records = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            records += [json.loads(line) for line in fh if line.strip()]
    return sorted(records, key=lambda r: (r["step"], r.get("dp_rank", 0)))


class OnlineSelector:
    """Chooses, each micro-batch, which candidates the engine trains on.

    Args:
        model: the module the engine calls (``engine.module``).
        config: SelectionConfig.
        target: provider of the target gradient (``build_target`` or ``for_target_data``
            build it from the config; ``probe_capture`` gives the probe it needs). The
            selector keeps it shaped by the optimizer and the score as ``rows``.
        probe: the probe capture on ``model`` (``probe_capture``).
        ctx: data-parallel group (for global scope).
        lr_fn: current learning rate (for GREATS).
        log_path: jsonl file for the per-step log of chosen ids and scores, rewritten by
            every run (training restarts at step 0). Under global scope (every rank's view
            identical) DP rank 0 writes it; under local scope with several DP ranks each
            writes its own, ``log_file(log_path, dp_rank)``, and ``read_selection_log``
            merges them; rank 0 removes logs of ranks a previous, wider run left behind.
        cost: cost model for routing.
        optimizer: the training optimizer (torch or DeepSpeed ZeRO), read for
            ``precondition="adam"``.
        held_out: the held-out part of the target (``validation_fraction``): the chosen
            examples' advantage on it decides the fallback to uniform choice.
        reference: builds the pool sample's gradient provider from its rows (scores with a
            pool: contrast, step); default: like the target (``pool_reference``).
        step_examples: examples per optimizer step over all ranks (the step score's ``m``);
            default: ``k`` times the data-parallel world.
        content_rows: the target documents' model inputs for the content prior
            (``content_weight``, ``score="content"``); default: a ``ValidationTarget``'s own.
    """

    def __init__(self, model: nn.Module, config: SelectionConfig, target: TargetProvider, *,
                 probe: GradientCapture, ctx: ParallelContext | None = None,
                 lr_fn: Callable[[], float] | None = None, log_path: str | Path | None = None,
                 cost: CostModel | None = None, optimizer=None,
                 held_out: TargetProvider | None = None,
                 reference: Callable[[Batch], TargetProvider] | None = None,
                 step_examples: int | None = None,
                 content_rows: Batch | None = None) -> None:
        self.model, self.config = model, config
        self.ctx = ctx or ParallelContext()
        goal = Target.of(target, content_rows, held_out)
        self.rule = score_for(config, cost=cost, ctx=ctx, documents=goal.documents)  # score
        self.policy = POLICIES.lookup(config.policy)  # the policy stage
        if reference is None and self.rule.needs_pool:
            reference = pool_reference(model, config, goal.gradient, probe, ctx)
        goal, reference = prepare(goal, config, probe=probe, ctx=ctx, optimizer=optimizer,
                                  reference=reference)
        self.documents, self.held_out = goal.documents, goal.held_out
        self._pool = PoolSample(self.rule.pool_rows) if self.rule.needs_pool else None
        self.rows = self.rule.rows(goal.gradient, self._pool, reference)  # the target stage
        self.content_weight = content_weight(config, self.policy, goal.documents) \
            if self.rule.ranked else 0.0
        self._rankers = rankers(config, self.content_weight, goal.documents) \
            if self.rule.ranked else []  # the rank stage
        self.cascade = cascade_for(config, self._rankers, goal.documents)  # the shortlist
        self.step_examples = step_examples
        self._step_others = max(0, (step_examples or 1) - 1)  # set per select() from k
        self.check = HeldOutCheck(config.fallback_every, ctx) \
            if held_out is not None and not config.controller else None  # controller decides
        held_docs = getattr(getattr(goal.held_out, "inner", goal.held_out), "data", None)
        self.controller = controller_for(  # which arm chooses each block (run time)
            config, model, held_docs, ctx=self.ctx, label_shift=probe.config.label_shift,
            ignore_index=probe.config.ignore_index, units=self._arm_units)
        self._arms: dict[str, Callable[..., Selection]] = {"uniform": self._select_random}
        if self.controller is not None and "content" in config.controller_arms:
            self._prior = self.cascade.prior if self.cascade is not None else \
                shared_prior(self._rankers, goal.documents)
            if not any(self._prior is getattr(r, "prior", None)
                       for r in [*self._rankers, self.cascade]):
                self.controller.prior = self._prior  # saved with the controller's state
            self._arms["content"] = self._select_content
        self.probe = probe
        self.lr_fn = lr_fn
        self.cost = cost
        per_rank = config.scope != "global" and self.ctx.dp_world > 1
        if log_path is not None and self.ctx.dp_rank == 0:
            _remove_stale_logs(log_path, self.ctx.dp_world if per_rank else 1)
        self._log = open(log_file(log_path, self.ctx.dp_rank), "w", encoding="utf-8") if (
            log_path is not None and writes_log(config, self.ctx)) else None
        self._trained: dict[str, int] = {}  # content id -> times trained (max_repeats)
        self._draws = 0
        self.stats = {"steps": 0, "candidates": 0, "chosen": 0, "score_sum": 0.0,
                      "chosen_score_sum": 0.0}
        self.last_kept: torch.Tensor | None = None
        self.plan: StepCost | None = None
        self._losses: list[torch.Tensor] | None = None  # reuse_forward: per-candidate losses
        self.reuse: bool | None = None  # decided at the first select (needs T)
        self._reuse_why = ""
        if self.cascade is not None:
            self.reuse, self._reuse_why = False, "the cascade's uniform share is not probed"

    @property
    def target(self) -> TargetProvider:
        """The provider of the score's rows (``rows``: the target gradient shaped by the
        optimizer and the score), the name callers use."""
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
                        lr_fn: Callable[[], float] | None = None,
                        log_path: str | Path | None = None, optimizer=None,
                        step_examples: int | None = None) -> OnlineSelector:
        """The selector of ``config`` on ``model``: a probe capture, the target (a
        ``ValidationTarget`` on ``target_data`` model inputs, or the store's ``FixedTarget``),
        preconditioned by ``optimizer`` when ``config.precondition`` asks. Launch and the
        benchmark build it here, so they run the same selection."""
        probe = cls.probe_capture(model, config, capture)
        goal = build_target(config, model, target_data, probe=probe, ctx=ctx, device=device)
        return cls(model, config, goal.gradient, probe=probe, ctx=ctx, lr_fn=lr_fn,
                   log_path=log_path, optimizer=optimizer, held_out=goal.held_out,
                   step_examples=step_examples, content_rows=goal.documents)

    def num_candidates(self, k: int) -> int:
        """Candidates scored for ``k`` trained examples: ``ceil(candidate_multiple * k)``."""
        return math.ceil(self.config.candidate_multiple * k - 1e-9)

    def score(self, batch: Batch, step: int, user_ids: list[str] | None = None, *,
              reuse: bool = False, text: CandidateText | None = None
              ) -> tuple[GradBatch, torch.Tensor]:
        """The target, probe and score stages: per-example gradients of the candidates and
        their scores (a rule that needs no probe gets a GradBatch of ids and no layers).

        Candidates with a NaN/inf gradient or score are dropped (named in a warning);
        ``self.last_kept`` then holds the ``[K]`` positions of the kept candidates (None when
        all are kept), and the returned grads/scores cover only those.

        Raises:
            CaptureError: every candidate has a non-finite gradient or score.
        """
        text = _text(batch) if text is None else text
        if not self.rule.needs_probe:  # scored from text alone: no probe, no target refresh
            self.last_kept = None
            ids = self._sample_ids(batch, user_ids)
            grads = GradBatch(step=step, sample_ids=ids, layers={})
            return grads, self._against(grads, None, text)
        rows = self.rows.get(step)
        dropped = self.probe.skipped
        if reuse:
            grads = self.probe.probe(lambda: self._per_example(batch, user_ids),
                                     retain_graph=True)
        else:
            if user_ids is not None:
                self.probe.tag(user_ids)
            grads = self.probe.probe(lambda: self._loss(batch))
        if grads is None:
            if self.probe.skipped > dropped:
                raise CaptureError(
                    f"Every candidate of step {step} has a NaN/inf gradient (the model's loss "
                    f"is non-finite: training diverged, or the inputs hold NaN/inf); nothing "
                    f"can be selected. Lower the learning rate or check the data")
            raise ConfigError("The probe pass captured nothing: the model's loss does not "
                              "depend on any captured layer")
        kept = self.probe.last_kept
        scores = self._against(grads, rows, text)
        finite = torch.isfinite(scores)
        if not bool(finite.all()):
            ok = torch.nonzero(finite.cpu()).flatten()
            if ok.numel() == 0:
                raise CaptureError(
                    f"Every candidate score of step {step} is NaN/inf although the candidates' "
                    f"gradients are finite: the target gradient is non-finite (its model "
                    f"diverged, or a target text has no loss token); nothing can be selected")
            bad = [grads.sample_ids[i] for i in torch.nonzero(~finite.cpu()).flatten().tolist()]
            warnings.warn(f"Step {step}: candidate(s) {bad[:5]} have a NaN/inf selection score "
                          f"and are dropped", stacklevel=2)
            grads, scores = grads.index(ok), scores[ok.to(scores.device)]
            kept = ok if kept is None else kept[ok]
        self.last_kept = kept
        return grads, scores

    def _explain(self, candidates: int, trained: int, reuse: bool) -> None:
        """Predict this run's step cost (selection/stepcost.py) and log it once (rank 0)."""
        cfg = self.config
        layers = list(self.probe.layers)
        inner = getattr(self.rows, "inner", self.rows)
        self.plan = StepCost(
            candidates=candidates,
            trained=trained,
            share=probe_share(self.model, layers), normalize=cfg.normalize,
            target_examples=getattr(inner, "rows_per_rank", 0)
            + self.rule.pool_rows,  # the pool's refresh too
            refresh_every=cfg.refresh_every, reuse=reuse, probe=self.rule.needs_probe,
            probed=None if self.cascade is None else self.cascade.size(trained, candidates))
        if self.ctx.dp_rank != 0:
            return
        if not self.rule.needs_probe:
            scored, why = "(the target's n-grams, no probe)", "no probe forward to reuse"
        else:
            blocks = f"top {cfg.top_blocks} block(s), " if cfg.top_blocks else ""
            space = f"projected to {cfg.projection.dim}" if cfg.projection else \
                "exact ghost scores"
            scored = f"({blocks}{len(layers)} layers, {space})"
            why = self._reuse_why if reuse or not self.reuse else \
                "the caller forwards the chosen itself (select(train_loss=False))"
        logger.info(self.plan.explain(f"score '{cfg.score}' {scored}", why))

    def _against(self, grads: GradBatch, rows: GradBatch | None,
                 text: CandidateText) -> torch.Tensor:
        """The score stage: ``[C]`` scores of ``grads`` against ``rows`` by the rule."""
        return self.rule(grads, rows, others=self._step_others, text=text)

    def _loss(self, batch: Batch) -> torch.Tensor:
        """The model's loss on ``batch``, under autocast when ``probe_autocast`` is set."""
        dtype = self.config.probe_autocast
        if dtype is None:
            return self.model(**batch).loss
        device = next(iter(batch.values())).device.type
        with torch.autocast(device_type=device, dtype=getattr(torch, dtype)):
            return self.model(**batch).loss

    def _reusing(self, tokens: int, candidates: int, trained: int) -> bool:
        """Reuse this step's forward? Decided once by ``decide_reuse``; never with a
        recording capture on the model (it does not record probe forwards): ``auto`` then
        turns reuse off, ``on`` is refused."""
        if self.reuse is None:
            device = next(self.model.parameters()).device
            roofline = (self.cost or default_cost_model(device)).roofline
            self.reuse, self._reuse_why = decide_reuse(
                self.config.reuse_forward, self.model, self.config.scope, tokens=tokens,
                candidates=candidates, trained=trained, layers=len(self.probe.layers),
                flops_per_s=roofline.flops_per_s)
        if not self.reuse or getattr(self.model, "_dattri_ds_capture", None) is None:
            return self.reuse
        if self.config.reuse_forward == "on":
            raise ConfigError("selection.reuse_forward='on' trains on graphs built during the "
                              "probe, which a recording GradientCapture (--capture) does not "
                              "record: set selection.reuse_forward='auto' or 'off' to capture")
        self.reuse, self._reuse_why = False, "a recording capture is attached"
        return False

    def _per_example(self, batch: Batch, user_ids: list[str] | None) -> torch.Tensor:
        """``reuse_forward``: one model call per candidate (one graph each); the calls'
        losses are kept for ``_reused_loss`` and their sum is probed."""
        c = next(iter(batch.values())).shape[0]
        self._losses = []
        for i in range(c):
            if user_ids is not None:
                self.probe.tag(user_ids[i:i + 1])
            self._losses.append(self._loss({n: v[i:i + 1] for n, v in batch.items()}))
        return torch.stack(self._losses).sum()

    def _reused_loss(self, positions: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """The model's loss on the candidates at ``positions`` from their retained graphs,
        reduced like one batch of them (``capture.loss_reduction``): token mean
        ``sum_i n_i L_i / sum_i n_i`` (``n_i`` label tokens), example mean, or sum."""
        losses, self._losses = self._losses, None
        if losses is None:
            return None
        cap = self.probe.config
        pos = positions.tolist()
        chosen = torch.stack([losses[i] for i in pos])
        if cap.loss_reduction == "sum":
            return chosen.sum()
        if cap.loss_reduction == "example_mean":
            return chosen.mean()
        labels = batch.get("labels", batch["input_ids"])[positions.to(batch["input_ids"].device)]
        n = (labels[:, cap.label_shift:] != cap.ignore_index).sum(1).to(chosen.dtype)
        return (chosen * n.to(chosen.device)).sum() / n.sum().clamp_min(1)

    def select(self, batch: Batch, k: int, step: int, user_ids: list[str] | None = None, *,
               train_loss: bool = False) -> Selection:
        """Score ``batch`` (C candidates) and return the ``k`` (or policy-sized) to train on.

        ``user_ids`` (e.g. document ids) prefix the logged sample ids. ``train_loss=True``:
        the caller back-propagates ``Selection.loss`` when it is set instead of forwarding
        the chosen batch (forward reuse, ``selection.reuse_forward``).
        """
        if self.config.random or (self.check is not None and self.check.decide(step)):
            return self._select_random(batch, k, step, user_ids)
        c, t = batch["input_ids"].shape[0], batch["input_ids"].shape[-1]
        self._step_others = max(0, (self.step_examples or k * self.ctx.dp_world) - 1)
        reuse = train_loss and self.rule.needs_probe and self._reusing(t, c, k)
        if self.plan is None:
            self._explain(c, k, reuse)
        arm = "gradient" if self.controller is None else self.controller.arm(step)
        if arm in self._arms:  # the controller's cheaper arms: uniform, content
            return self._arms[arm](batch, k, step, user_ids)
        if self._pool is not None:
            self._pool.observe(batch)
        text = _text(batch)  # the candidates' n-grams, hashed at most once
        if self.cascade is not None:
            sel = self._cascaded(batch, k, step, user_ids, text)
            self._record(step, sel)
            return sel
        grads, scores = self.score(batch, step, user_ids, reuse=reuse, text=text)
        scores = scores.detach().float().cpu()
        kept = self.last_kept  # candidates left after dropping non-finite ones (None: all)
        original = batch
        if kept is not None:
            batch = {n: v[kept.to(v.device)] for n, v in batch.items()}
            text = _text(batch)
        ranked = self._ranked(text, scores)  # what the policy ranks (scores: logged)
        if self.config.scope == "global" and self.ctx.dp_world > 1:
            sel = self._select_global(batch, grads, ranked, k)
        else:
            idx = self._choose(self._capped(grads.sample_ids, ranked), k, grads,
                               self._generator(step, grads.sample_ids))
            positions = idx if kept is None else kept[idx]
            sel = Selection({n: v[idx.to(v.device)] for n, v in batch.items()},
                            positions, scores,
                            tuple(grads.sample_ids[i] for i in idx.tolist()), scores[idx],
                            self._reused_loss(positions, original))
            self._count(sel.chosen_ids)
            if self.check is not None:
                val = aligned(grads, self.held_out.get(step), self.config.normalize, self.cost)
                self.check.add(val.detach().float().cpu(), idx)
        self._record(step, sel)
        return sel

    def _cascaded(self, batch: Batch, k: int, step: int, user_ids: list[str] | None,
                  text: CandidateText) -> Selection:
        """A step with the shortlist stage (selection/cascade.py): probe, score, rank, cap
        and policy on the shortlist exactly as on a micro-batch of those candidates; the
        uniform share from all candidates; the held-out check on the probed ones."""
        c = batch["input_ids"].shape[0]
        ids = self._sample_ids(batch, user_ids)
        capped = None if self.config.max_repeats is None else \
            torch.isinf(self._capped(ids, torch.zeros(c)))
        short, short_text = self.cascade(text, k, capped)
        grads, scores = self.score(
            {n: v[short.to(v.device)] for n, v in batch.items()}, step,
            None if user_ids is None else [user_ids[i] for i in short.tolist()],
            text=short_text)
        scores = scores.detach().float().cpu()
        kept = self.last_kept  # of the shortlist (None: all probed)
        if kept is not None:
            short_text = PriorText.subset(short_text, kept, short_text.content)
            short = short[kept]
        self.last_kept = short
        ranked = self._ranked(short_text, scores)
        picked = self._choose(self._capped(grads.sample_ids, ranked), needed(k, c,
                              self.config.uniform_mix), grads,
                              self._generator(step, grads.sample_ids), uniform_mix=0.0)
        chosen = short[picked]
        if chosen.numel() < min(k, c):
            chosen = fill_uniform(chosen, c, min(k, c), self._generator(step, ids))
        chosen_scores = torch.full((chosen.numel(),), float("nan"))
        where = {p: i for i, p in enumerate(short.tolist())}
        for j, p in enumerate(chosen.tolist()):
            if p in where:
                chosen_scores[j] = scores[where[p]]
        sel = Selection({n: v[chosen.to(v.device)] for n, v in batch.items()}, chosen, scores,
                        tuple(ids[i] for i in chosen.tolist()), chosen_scores, probed=short)
        self._count(sel.chosen_ids)
        if self.check is not None:
            val = aligned(grads, self.held_out.get(step), self.config.normalize, self.cost)
            self.check.add(val.detach().float().cpu(), picked)
        return sel

    def _ranked(self, text: CandidateText, scores: torch.Tensor) -> torch.Tensor:
        """The rank stage: ``scores`` through the ``Ranker`` stages in order (neighbour
        smoothing, the content prior; none for a rule that is not ``ranked``)."""
        ranked = scores
        for stage in self._rankers:
            ranked = stage(ranked, text)
        return ranked

    def _sample_ids(self, batch: Batch, user_ids: list[str] | None) -> tuple[str, ...]:
        """The candidates' sample ids as the probe would record them (content hashes under
        the capture's label shift and ignore index, ``user_ids`` as prefixes), without a
        probe pass."""
        cap = self.probe.config
        return batch_info((), batch, label_shift=cap.label_shift, ignore_index=cap.ignore_index,
                          user_ids=user_ids).sample_ids

    def _arm_units(self, arm: str) -> float:
        """The step-cost model's predicted ratio to a plain step of a controller arm."""
        if arm == "gradient":
            return self.plan.ratio() if self.plan is not None else 1.0
        return self.plan.modes()[arm] if self.plan is not None else 1.0

    def _select_content(self, batch: Batch, k: int, step: int,
                        user_ids: list[str] | None) -> Selection:
        """The controller's ``content`` arm: the content prior ranks all candidates (no
        probe), repeat cap, then the policy and the uniform mix as configured."""
        ids = self._sample_ids(batch, user_ids)
        content = self._prior.scores_of_counts(_text(batch).counts)
        idx = self._choose(self._capped(ids, content), k, None, self._generator(step, ids))
        sel = Selection({n: v[idx.to(v.device)] for n, v in batch.items()}, idx, content,
                        tuple(ids[i] for i in idx.tolist()), content[idx])
        self._count(sel.chosen_ids)
        self._record(step, sel)
        return sel

    def _select_random(self, batch: Batch, k: int, step: int,
                       user_ids: list[str] | None) -> Selection:
        """Baseline: a seeded uniform draw of ``k`` candidates, no scoring."""
        c = next(iter(batch.values())).shape[0]
        self._draws += 1
        gen = torch.Generator().manual_seed(stable_seed("random", step, self.ctx.dp_rank,
                                                        self._draws))
        idx = torch.randperm(c, generator=gen)[:min(k, c)].sort().values
        ids = batch["input_ids"][idx]
        sel = Selection({n: v[idx.to(v.device)] for n, v in batch.items()}, idx,
                        torch.zeros(c),
                        tuple(content_id(row, None, None if user_ids is None else user_ids[i])
                              for row, i in zip(ids, idx.tolist())), torch.zeros(len(idx)))
        self._record(step, sel)
        return sel

    @staticmethod
    def _generator(step: int, ids) -> torch.Generator:
        """Seeded by the step and the candidates' content ids: soft and mixed choices replay
        exactly and do not depend on the parallel layout (DP rank, accumulation, TP)."""
        return torch.Generator().manual_seed(stable_seed("select", step, *ids))

    def _count(self, ids) -> None:
        """Count trained examples by content id (for ``max_repeats``)."""
        for i in ids:
            h = i.split("#")[-1]
            self._trained[h] = self._trained.get(h, 0) + 1

    def _capped(self, ids, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` with candidates trained ``max_repeats`` times already at ``-inf``."""
        if self.config.max_repeats is None:
            return scores
        counts = torch.tensor([self._trained.get(i.split("#")[-1], 0) for i in ids])
        return cap_repeats(scores, counts, self.config.max_repeats)

    def _choose(self, scores: torch.Tensor, k: int,
                gram_source: GradBatch | torch.Tensor | None,
                generator: torch.Generator, uniform_mix: float | None = None) -> torch.Tensor:
        """The policy + uniform mix stage (``Policy.mixed``) with this run's parameters
        (``uniform_mix``: default ``selection.uniform_mix``)."""
        cfg = self.config
        lr = cfg.greats_lr if cfg.greats_lr is not None else (self.lr_fn() if self.lr_fn else 1.0)
        mix = cfg.uniform_mix if uniform_mix is None else uniform_mix
        return self.policy.mixed(scores, k, uniform_mix=mix, gram_source=gram_source,
                                 cost=self.cost, generator=generator, lr=lr,
                                 fraction=cfg.fraction, tau=cfg.tau, temperature=cfg.temperature)

    def _select_global(self, batch: Batch, grads: GradBatch, scores: torch.Tensor,
                       k: int) -> Selection:
        import torch.distributed as dist

        ctx = self.ctx
        world = ctx.dp_world
        gathered = [None] * world
        vectors = None
        if self.policy.needs_gram:  # the gram is built from every rank's projected vectors
            vectors = torch.cat([grads.layers[n].data.values for n in grads.layers], 1).cpu()
        local = {"scores": scores, "ids": grads.sample_ids,
                 "batch": {n: v.cpu() for n, v in batch.items()}, "vectors": vectors}
        dist.all_gather_object(gathered, local, group=ctx.dp_group)
        all_scores = torch.cat([g["scores"] for g in gathered])
        all_ids = [i for g in gathered for i in g["ids"]]
        all_batch = {n: torch.cat([g["batch"][n] for g in gathered]) for n in batch}
        vecs = torch.cat([g["vectors"] for g in gathered]) if vectors is not None else None
        chosen = self._choose(self._capped(all_ids, all_scores), k * world, vecs,
                              self._generator(-1, all_ids))
        self._count([all_ids[i] for i in chosen.tolist()])  # every rank counts all: same caps
        per_rank = max(1, chosen.numel() // world)
        ranked = chosen[torch.argsort(-all_scores[chosen].double(), stable=True)]
        mine = ranked[ctx.dp_rank::world][:per_rank].sort().values
        device = next(iter(batch.values())).device
        return Selection({n: v[mine].to(device) for n, v in all_batch.items()}, mine,
                         scores, tuple(all_ids[i] for i in mine.tolist()), all_scores[mine])

    def _record(self, step: int, sel: Selection) -> None:
        st = self.stats
        st["steps"] += 1
        st["candidates"] += sel.scores.numel()
        st["chosen"] += sel.indices.numel()
        st["score_sum"] += float(sel.scores.sum())
        finite = sel.chosen_scores[torch.isfinite(sel.chosen_scores)]
        st["chosen_score_sum"] += float(finite.sum())
        if self._log is not None:
            record = {
                "step": step, "dp_rank": self.ctx.dp_rank, "chosen": list(sel.chosen_ids),
                "chosen_scores": [round(float(s), 6) if math.isfinite(s) else None
                                  for s in sel.chosen_scores.tolist()],
                "candidate_scores": [round(float(s), 6) for s in sel.scores]}
            if sel.probed is not None:
                record["probed"] = sel.probed.tolist()
            self._log.write(json.dumps(record) + "\n")

    def summary(self) -> dict:
        """Selection statistics of the run so far, over all data-parallel ranks.

        Collective over the data-parallel group (every DP rank must call it).
        """
        keys = ("steps", "candidates", "chosen", "score_sum", "chosen_score_sum")
        local = torch.tensor([float(self.stats[k]) for k in keys], dtype=torch.float64,
                             device=next(self.model.parameters()).device)
        total = all_reduce_sum(local, self.ctx.dp_group, self.ctx.dp_world).tolist()
        st = {k: (v if k.endswith("sum") else int(round(v))) for k, v in zip(keys, total)}
        return {"score": self.config.score, "micro_batches": st["steps"],
                "candidates": st["candidates"],
                "chosen": st["chosen"],
                "mean_candidate_score": st["score_sum"] / max(1, st["candidates"]),
                "mean_chosen_score": st["chosen_score_sum"] / max(1, st["chosen"]),
                "target_refreshes": getattr(self.rows, "refreshes", 0),
                **({"cascade": self.cascade.summary(self.ctx, local.device)}
                   if self.cascade is not None else {}),
                **({"controller": self.controller.summary()}
                   if self.controller is not None else {}),
                **({"held_out_check": self.check.summary()} if self.check is not None else {})}

    def close(self) -> None:
        self.probe.detach()
        if self._log is not None:
            self._log.close()
            self._log = None

    def state_dict(self) -> dict:
        """The selector's running state for a checkpoint, one entry per stateful component
        (selection/state.py lists them): plain tensors, numbers, strings, lists and dicts,
        readable with ``torch.load(weights_only=True)``. Flushes the selection log."""
        from dattri_ds.selection.state import selector_state

        return selector_state(self)

    def load_state_dict(self, state: dict, log: list[str] | tuple[str, ...] = ()) -> None:
        """Restore ``state_dict()`` and continue the log with ``log`` (its lines of the
        steps before the resumed one), so the run goes on as if never stopped.

        Raises:
            ConfigError: a state that does not fit this selector's stages.
        """
        from dattri_ds.selection.state import load_selector_state

        load_selector_state(self, state, log)
