"""SelectionConfig: the ``"selection"`` part of the ``"dattri_ds"`` block."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from dattri_ds import schema
from dattri_ds.config import from_dict
from dattri_ds.errors import ConfigError
from dattri_ds.ops.projection import ProjectionConfig
from dattri_ds.selection.policy import POLICIES
from dattri_ds.selection.scorer import SCORES

__all__ = ["SelectionConfig", "PROBE_SETTINGS"]

#: Settings that only the gradient path reads (the probe, the target gradient, the rank
#: stages over gradient scores, the held-out check): one of them away from its default,
#: with ``score`` unset, resolves the score to ``"alignment"`` (``SelectionConfig.score``).
#: ``target_store`` is here too: a gradient store has no text to rank by.
PROBE_SETTINGS = ("target_store", "shortlist", "precondition", "contrast", "content_weight",
                  "smooth_neighbors", "smooth_memory", "top_blocks", "include", "projection",
                  "probe_autocast", "per_token", "normalize", "refresh_every",
                  "target_batch_size", "reuse_forward", "validation_fraction", "controller")


@dataclass(frozen=True, kw_only=True)
class SelectionConfig:
    """Online data selection: score candidates against a target gradient every step."""

    enabled: bool = False
    """Switch selection on (``--online-selection`` sets this)."""

    target_data: str | None = None
    """jsonl file with the target texts (e.g. a validation set of the task you care about);
    launch/train.py requires it (``--target-data``) unless ``target_store`` is given."""

    target_max_docs: int | None = field(default=64, metadata=schema.bounds(ge=1, le=10**9))
    """Use at most this many target documents (None = all)."""

    target_store: str | None = None
    """A gradient store whose mean vector is a fixed target (needs ``projection``)."""

    candidate_multiple: float = field(default=2.0, metadata=schema.bounds(ge=1, le=1024))
    """Candidates scored per trained example (>= 1): 2 scores 2x the micro-batch."""

    shortlist: float | None = field(default=None, metadata=schema.bounds(gt=0, le=1024))
    """The cascade (selection/cascade.py): the content prior ranks all candidates (no
    model), and only the top ``ceil(shortlist * n)`` are probed and scored, ``n = k -
    round(uniform_mix * k)`` the examples the policy chooses; the rank stages and the policy
    choose among that shortlist, the uniform share comes from all candidates. 1.5 probes
    1.5x what the policy needs (at 4x candidates and ``uniform_mix`` 0.5, 3/16 of them).
    Needs target documents (``target_data``), a probing score, scope ``rank``; >= 1. The
    step-cost plan logged at the first step predicts each mode's cost
    (selection/stepcost.py). None: every candidate is probed."""

    policy: Literal["topk", "fraction", "threshold", "greats", "soft"] = "topk"
    """``topk``: the micro-batch-size best; ``fraction``: the top fraction of candidates;
    ``threshold``: every candidate above ``tau`` (at most the micro-batch size); ``greats``:
    greedy with a redundancy discount (GREATS); ``soft``: sample without replacement with
    probability ``~ exp(z / temperature)``, ``z`` the standardized scores."""

    temperature: float = field(default=1.0, metadata=schema.bounds(gt=0))
    """Temperature of ``policy="soft"`` on standardized scores (-> 0: top-k; large: uniform)."""

    uniform_mix: float = field(default=0.5, metadata=schema.bounds(ge=0, le=1))
    """Share of every micro-batch drawn uniformly from the candidates the policy did not
    pick (0: all by the policy, 1: all uniform)."""

    max_repeats: int | None = field(default=None, metadata=schema.bounds(ge=1, le=10**9))
    """Train one example (by content id) at most this many times by score; candidates over
    the cap are picked only when too few others remain. None: no cap."""

    per_token: bool = True
    """Score the gradient of each example's mean token loss instead of its summed loss, so
    long examples are not preferred for their length (target gradient likewise)."""

    precondition: Literal["none", "adam"] = "none"
    """``adam``: score ``<g_b, P g_target>`` with ``P = 1/(sqrt(v_hat) + eps)`` from the
    optimizer's second moments (LESS-style: the first-order effect of an Adam step on the
    target loss). ``P`` is applied to the target only, once per target refresh (under
    ZeRO-3 each rank to its own partition). Needs an Adam-family optimizer and exact
    (unprojected) scoring."""

    score: Literal["alignment", "step", "content"] | None = None
    """What ranks the candidates. ``content``: the content prior alone (see
    ``content_weight``): the target documents' hashed n-grams, no model, no gradient and no
    probe pass, so a step costs about a plain one (0.97x measured at 4x candidates); the
    rank stages do not apply and the values only rank (policies topk, fraction or soft).
    ``alignment``: ``<g_b, g_target>`` from a per-example gradient probe of every candidate
    (a cosine when ``normalize``; ``contrast`` and ``precondition`` shape the target;
    ~8x a plain step at 4x candidates, less with ``shortlist`` or ``controller``).
    ``step``: the expected cosine of the training step's summed gradient with the target
    when the candidate takes one of its slots and typical examples (the pool sample's mean
    gradient, ``contrast_rows``) the others (selection/stepscore.py): the pool's weight is
    measured, so ``contrast`` and ``normalize`` do not apply. Each is a registered
    ``Score`` (selection/scorer.py): a new rule is one class and its name here.

    None (default) is resolved when the config is built, and the resolved name is what the
    resolved config, the selector summary and the step plan show: ``alignment`` for a
    ``target_store`` (it has no text), or when a setting only the gradient path reads is
    away from its default (``PROBE_SETTINGS``: shortlist, precondition, contrast,
    content_weight, smooth_neighbors, smooth_memory, top_blocks, include, projection,
    probe_autocast, per_token, normalize, refresh_every, target_batch_size, reuse_forward,
    validation_fraction, controller; or policy threshold/greats, which read the scores'
    scale): the setting implies the probe. Otherwise ``content`` (the target is documents:
    ``target_data``, or the model inputs given to the selector). Measured through launch
    (docs/selection_compute.md), content reaches random's final target loss in 0.35-0.78x
    random's CPU and is within noise of or ahead of the gradient arms at equal data.
    ``dataclasses.replace`` keeps a resolved name; pass ``score=None`` to resolve again."""

    contrast: float = field(default=0.0, metadata=schema.bounds(ge=0))
    """Score against ``g_t/|g_t| - contrast * g_pool/|g_pool|`` (selection/contrast.py):
    with cosine scoring, ``cos(g_b, g_t) - contrast * cos(g_b, g_pool)``, where ``g_pool``
    is the mean gradient of a sample of the candidate stream (``contrast_rows``), refreshed
    with the target. Rewards what a candidate adds beyond the generic directions every
    training example shares. 0: plain target."""

    contrast_rows: int = field(default=64, metadata=schema.bounds(ge=1, le=2**20))
    """Candidates (the first this rank sees) kept as the pool sample of ``contrast``."""

    smooth_neighbors: int | None = field(default=16, metadata=schema.bounds(ge=1, le=2**20))
    """Before the policy, replace each candidate's score by the mean score of the N texts
    nearest to it in content (hashed unigram/bigram bags; itself included) among this
    batch and the last ``smooth_memory`` scored candidates (selection/smoothing.py): the
    choice follows what a *kind* of text does for the target, not one text's own tokens.
    The memory is per data-parallel rank, so the choice (not the update's exactness) depends
    on how micro-batches are dealt to ranks. Gradient scores only (``score="content"`` is not
    smoothed: the default 16 then has no effect). None: raw scores."""

    smooth_memory: int = field(default=1024, metadata=schema.bounds(ge=1, le=2**24))
    """Earlier scored candidates (this rank's) kept as neighbours for ``smooth_neighbors``."""

    content_weight: float | None = field(default=None, metadata=schema.bounds(ge=0))
    """Rank ``z(score) + content_weight * z(content)``, where ``content`` is the mean
    log-ratio of the candidate's hashed unigrams/bigrams under the target documents vs the
    candidate stream seen so far (selection/content.py; DSIR-style, no model) and ``z``
    standardizes over the micro-batch's candidates; applies to the gradient scores
    (``alignment``, ``step``: setting it without ``score`` resolves the score to
    ``alignment``), not to ``score="content"`` (the prior is the score). None (default): 1.0
    when the target is documents (``target_data``) and the policy ranks (topk, fraction,
    soft); off for a ``target_store`` (it has no text) and for ``threshold``/``greats`` (they
    read the scores' scale); a value > 0 there is an error. 0: gradient scores only."""

    fraction: float = field(default=0.5, metadata=schema.bounds(gt=0, le=1))
    """Kept fraction for ``policy="fraction"``."""

    tau: float = 0.0
    """Score threshold for ``policy="threshold"``."""

    greats_lr: float | None = field(default=None, metadata=schema.bounds(gt=0))
    """Step size in the GREATS gain; None = the optimizer's current learning rate."""

    scope: Literal["rank", "global"] = "rank"
    """``rank``: each data-parallel rank picks from its own candidates; ``global``: pick the
    best across ranks, then deal the chosen examples back so every rank trains the same
    number."""

    refresh_every: int = field(default=10, metadata=schema.bounds(ge=1, le=10**9))
    """Recompute the target gradient every N optimizer steps (it moves with the model)."""

    target_batch_size: int = field(default=8, metadata=schema.bounds(ge=1, le=2**20))
    """Micro-batch size of the target-gradient passes."""

    projection: ProjectionConfig | None = None
    """Score in a projected space (cheaper for big layers); None = exact ghost products."""

    normalize: bool = True
    """Score by cosine ``<g_b, g_target> / ||g_b||`` instead of the raw inner product, so
    large-gradient (hard, long or noisy) candidates are not preferred for their norm alone."""

    probe_autocast: Literal["bfloat16", "float16"] | None = None
    """Run the candidate scoring pass under ``torch.autocast`` in this dtype (scores are
    still accumulated in float32). bfloat16 roughly halves the probe's time on CPUs with
    AVX-512 BF16 and on GPUs; per-layer scores stay within ~1e-4 cosine of float32."""

    validation_fraction: float = field(default=0.0, metadata=schema.bounds(ge=0, lt=1))
    """Hold this share of the target documents out of scoring (every ``1/f``-th one) and
    check, every ``fallback_every`` steps, that the chosen examples align with the held-out
    part better than the average candidate; if not, fall back to uniform choice for the
    rest of the run (reported in the summary's ``held_out_check``). 0: no check."""

    fallback_every: int = field(default=25, metadata=schema.bounds(ge=1, le=10**9))
    """Optimizer steps per held-out check window (``validation_fraction > 0``)."""

    controller: bool = False
    """Decide at run time which arm chooses each block of steps (selection/controller.py):
    ``uniform`` (no scoring), ``content`` (the content prior, no probe) or ``gradient``
    (this config's score, the cascade with ``shortlist``), by the held-out target-loss gain
    per CPU-second each arm measurably buys. Every arm keeps ``controller_floor`` of every
    window; the rest goes to the arm whose paired advantage over ``uniform`` is above zero
    by more than its standard error. Needs ``validation_fraction > 0`` (the held-out
    documents it measures on; the held-out check's fallback is then off: the controller
    decides). The choices are in the run summary (``controller``)."""

    controller_arms: tuple[str, ...] = ("uniform", "content", "gradient")
    """Arms the controller allocates among (two or more of ``uniform``, ``content``,
    ``gradient``); the first is the reference of the paired comparison."""

    controller_block: int = field(default=5, metadata=schema.bounds(ge=1, le=10**6))
    """Optimizer steps per block (one arm per block; the held-out loss is measured, with a
    forward of the held-out documents, at every block edge)."""

    controller_window: int = field(default=10, metadata=schema.bounds(ge=2, le=10**6))
    """Blocks per window (each arm runs its floor in every window, in a seeded order)."""

    controller_floor: float = field(default=0.1, metadata=schema.bounds(gt=0, lt=1))
    """Least share of every window's blocks each arm runs (at least one block)."""

    controller_cost: Literal["measured", "model"] = "measured"
    """Cost of a block: ``measured`` CPU-seconds (all ranks), or ``model``: the step-cost
    model's predicted plain-step units (selection/stepcost.py), deterministic, so a run
    replays and resumes bit for bit."""

    include: tuple[str, ...] = ()
    """Module-name patterns scored (empty = every supported layer)."""

    top_blocks: int | None = field(default=None, metadata=schema.bounds(ge=1, le=10**6))
    """Score only the layers of the model's last N repeated blocks (truncated scoring: the
    probe backward stops at the lowest scored block, so the blocks below, the embeddings
    and the head are never back-propagated or scored). None: every layer (or ``include``)."""

    reuse_forward: Literal["auto", "on", "off"] = "auto"
    """``on``: forward every candidate on its own (one graph per example) and keep the
    chosen examples' graphs for the training backward (``Selection.loss``), so the chosen
    are not forwarded a second time (``k`` forwards saved per micro-batch; the activations
    kept are those the batched probe holds anyway). Exact; scope ``rank`` only; needs a
    model whose loss is reduced as ``capture.loss_reduction`` says. ``auto``: the step
    cost model decides (selection/stepcost.py: on for unpartitioned CPU models, off under
    ZeRO-3, where every model call gathers every module's parameters again, and on GPUs).
    ``off``: the chosen are forwarded again."""

    random: bool = False
    """Baseline: keep a uniformly random subset of the same candidates (no scoring), for
    measuring what scoring adds."""

    log_scores: bool = True
    """Write chosen ids and scores of every step to ``<out>/selection.jsonl`` (one file per
    data-parallel rank under local scope: ``selection.dp<r>.jsonl``)."""

    def __post_init__(self) -> None:
        schema.check(self, "selection")
        if self.score is None:
            object.__setattr__(self, "score", self._default_score())
        if self.validation_fraction > 0 and self.scope == "global":
            raise ConfigError("selection.validation_fraction (the held-out check) supports "
                              "scope 'rank' only; set selection.scope='rank' or "
                              "validation_fraction=0")
        if self.validation_fraction > 0 and self.target_store:
            raise ConfigError("selection.validation_fraction splits the target documents: it "
                              "needs selection.target_data, not selection.target_store")
        if self.precondition == "adam" and (self.projection is not None or self.target_store):
            raise ConfigError("selection.precondition='adam' scales the exact target gradient "
                              "by the optimizer's per-parameter second moments: it cannot be "
                              "combined with selection.projection or selection.target_store")
        SCORES.lookup(self.score).check(self)  # the settings the scoring rule refuses
        if POLICIES.lookup(self.policy).scaled and not SCORES.lookup(self.score).scale:
            raise ConfigError(f"selection.policy='{self.policy}' reads the scores' own scale, "
                              f"which score='{self.score}' does not have (its values only "
                              f"rank); use policy topk, fraction or soft")
        if self.top_blocks is not None and self.include:
            raise ConfigError(f"selection.top_blocks={self.top_blocks} and selection.include="
                              f"{list(self.include)} both choose the scored layers; set only "
                              f"one of them")
        if self.reuse_forward == "on" and self.scope == "global":
            raise ConfigError("selection.reuse_forward keeps this rank's candidates' graphs "
                              "for training: examples chosen on another rank have none. Set "
                              "selection.scope='rank' or reuse_forward='auto'")
        self._check_shortlist()
        self._check_controller()
        if self.target_store is not None and self.projection is None:
            raise ConfigError("selection.target_store holds projected gradients: set "
                              "selection.projection to the store's projection")
        if self.policy == "greats" and self.scope == "global" and self.projection is None:
            raise ConfigError("policy 'greats' with scope 'global' compares candidates across "
                              "ranks: set selection.projection (e.g. {\"dim\": 256})")

    def probe_settings(self) -> list[str]:
        """The settings of ``PROBE_SETTINGS`` (and a scaled policy) away from their
        defaults: each one only the gradient path reads."""
        defaults = {f.name: f.default for f in fields(self)}
        out = [name for name in PROBE_SETTINGS if getattr(self, name) != defaults[name]]
        return out + (["policy"] if POLICIES.lookup(self.policy).scaled else [])

    def _default_score(self) -> str:
        """``score`` when unset: ``alignment`` for a target store or a probe-only setting
        (``probe_settings``), else ``content`` (see the field's docstring)."""
        return "alignment" if self.probe_settings() else "content"

    def _check_shortlist(self) -> None:
        """The settings the cascade (``shortlist``) cannot serve, refused at start."""
        s = self.shortlist
        if s is None:
            return
        why = None
        if s < 1:
            why = (f"probes fewer candidates than the policy must choose (ceil({s} * n) < n, "
                   f"n = k - round(uniform_mix * k)); set shortlist >= 1 (e.g. 1.5)")
        elif not SCORES.lookup(self.score).needs_probe:
            why = (f"shortlists candidates for the gradient probe, which score="
                   f"'{self.score}' does not run (it probes none already); unset shortlist "
                   f"or use score='alignment'")
        elif self.target_store is not None:
            why = ("ranks candidates by the target documents' n-grams, which "
                   "selection.target_store does not have; give selection.target_data "
                   "instead or unset shortlist")
        elif self.scope == "global":
            why = ("shortlists each rank's own candidates: scope 'global' compares every "
                   "rank's candidates by one score; set selection.scope='rank' or unset "
                   "shortlist")
        elif self.reuse_forward == "on":
            why = ("leaves the uniform share's examples unprobed, so they have no forward "
                   "graph to reuse; set selection.reuse_forward='auto' or 'off'")
        elif self.uniform_mix >= 1:
            why = ("has nothing to shortlist: uniform_mix=1 chooses every example "
                   "uniformly; lower uniform_mix or unset shortlist")
        if why is not None:
            raise ConfigError(f"selection.shortlist={s} {why}")

    def _check_controller(self) -> None:
        """The settings the run-time controller cannot serve, refused at start."""
        if not self.controller:
            return
        arms = list(self.controller_arms)
        if self.validation_fraction <= 0:
            raise ConfigError("selection.controller=true measures each arm's gain on the "
                              "held-out target documents, and selection.validation_fraction="
                              f"{self.validation_fraction} holds none out: set "
                              "validation_fraction (e.g. 0.2) or controller=false")
        known = ("uniform", "content", "gradient")
        if len(arms) < 2 or len(set(arms)) != len(arms) or not set(arms) <= set(known):
            raise ConfigError(f"selection.controller_arms={arms}: give two or more distinct "
                              f"arms of {', '.join(known)}")
        floor_blocks = max(1, math.ceil(self.controller_floor * self.controller_window - 1e-9))
        if floor_blocks * len(arms) > self.controller_window:
            raise ConfigError(f"selection.controller_floor={self.controller_floor} gives each "
                              f"of {len(arms)} arms {floor_blocks} of the "
                              f"{self.controller_window} blocks of a window; lower "
                              f"controller_floor or set controller_window >= "
                              f"{floor_blocks * len(arms)}")
        if self.random:
            raise ConfigError("selection.random=true chooses uniformly at every step, so "
                              "selection.controller has nothing to decide; set one of them")
        if "content" in arms and POLICIES.lookup(self.policy).scaled:
            raise ConfigError(f"selection.controller_arms has 'content', which ranks by the "
                              f"content prior: policy='{self.policy}' reads the scores' own "
                              f"scale; use policy topk, fraction or soft, or drop the arm")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SelectionConfig:
        return from_dict(cls, d, "selection", nested={"projection": ProjectionConfig})
