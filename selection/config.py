"""SelectionConfig: the ``"selection"`` part of the ``"dattri_ds"`` block (a leaf module:
it imports only dattri_ds core)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from dattri_ds.io import schema
from dattri_ds.capture.config import from_dict
from dattri_ds.errors import ConfigError
from dattri_ds.ops.projection import ProjectionConfig

__all__ = ["SelectionConfig", "GRADIENT_SETTINGS"]

#: Settings only the gradient score (``score="alignment"``) reads: the probe, the target
#: gradient and the rank stages over gradient scores. Given with ``score="content"`` (the
#: default) one of them is an error naming ``--selection-score alignment``, never a
#: silent switch to an 8x-cost step.
GRADIENT_SETTINGS = ("target_store", "shortlist", "content_weight",
                     "smooth_neighbors", "smooth_memory", "top_blocks", "include", "projection",
                     "per_token", "normalize", "refresh_every", "target_batch_size",
                     "reuse_forward")

def flag(name: str) -> str:
    """The launch flag of a selection field (launch/args.py generates it the same way)."""
    return "--selection-" + name.replace("_", "-")


def _as_flag_value(value: Any) -> str:
    """A value as it is written after its flag (``false``, ``null``, ``a b``)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return " ".join(value) if isinstance(value, tuple) else str(value)


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

    score: Literal["content", "alignment"] = "content"
    """What ranks the candidates. ``content`` (default): the target documents' hashed
    n-grams against the candidate stream, no model pass, about a plain step's cost.
    ``alignment``: ``<g_b, g_target>`` from a per-example gradient probe (a cosine when
    ``normalize``), ~8x a plain step at 4x candidates; the settings of ``GRADIENT_SETTINGS``
    shape it and are refused with ``content``. Measurements: docs/selection_compute.md."""

    shortlist: float | None = field(default=None, metadata=schema.bounds(gt=0, le=1024))
    """The cascade (selection/cascade.py): the content prior ranks all candidates and only
    the top ``ceil(shortlist * n)`` are probed and scored, ``n = k - round(uniform_mix * k)``
    the examples the policy chooses (1.5 probes 1.5x what it needs). Needs ``target_data``
    and ``score="alignment"``; >= 1. None: every candidate is probed."""

    uniform_mix: float = field(default=0.5, metadata=schema.bounds(ge=0, le=1))
    """Share of every micro-batch drawn uniformly from the candidates the policy did not
    pick (0: all by the policy, 1: all uniform)."""

    per_token: bool = True
    """Score the gradient of each example's mean token loss instead of its summed loss, so
    long examples are not preferred for their length (target gradient likewise)."""

    smooth_neighbors: int | None = field(default=16, metadata=schema.bounds(ge=1, le=2**20))
    """Before the policy, replace each candidate's score by the mean score of the N texts
    nearest to it in content (hashed unigram/bigram bags; itself included) among this
    batch and this rank's last ``smooth_memory`` scored candidates (selection/smoothing.py).
    Gradient score only. None: raw scores."""

    smooth_memory: int = field(default=1024, metadata=schema.bounds(ge=1, le=2**24))
    """Earlier scored candidates (this rank's) kept as neighbours for ``smooth_neighbors``."""

    content_weight: float | None = field(default=None, metadata=schema.bounds(ge=0))
    """Rank ``z(score) + content_weight * z(content)``, ``content`` the content prior
    (selection/content.py), ``z`` standardizing over the micro-batch; gradient score only.
    None (default): 1.0 with ``target_data``, off for a ``target_store`` (no text; a value
    > 0 there is an error). 0: gradient scores only."""

    refresh_every: int = field(default=10, metadata=schema.bounds(ge=1, le=10**9))
    """Recompute the target gradient every N optimizer steps (it moves with the model)."""

    target_batch_size: int = field(default=8, metadata=schema.bounds(ge=1, le=2**20))
    """Micro-batch size of the target-gradient passes."""

    projection: ProjectionConfig | None = None
    """Score in a projected space (cheaper for big layers); None = exact ghost products."""

    normalize: bool = True
    """Score by cosine ``<g_b, g_target> / ||g_b||`` instead of the raw inner product, so
    large-gradient (hard, long or noisy) candidates are not preferred for their norm alone."""

    include: tuple[str, ...] = ()
    """Module-name patterns scored (empty = every supported layer)."""

    top_blocks: int | None = field(default=None, metadata=schema.bounds(ge=1, le=10**6))
    """Score only the layers of the model's last N repeated blocks (truncated scoring: the
    probe backward stops at the lowest scored block, so the blocks below, the embeddings
    and the head are never back-propagated or scored). None: every layer (or ``include``)."""

    reuse_forward: Literal["auto", "on", "off"] = "auto"
    """``on``: forward every candidate on its own and keep the chosen examples' graphs for
    the training backward (``Selection.loss``), so the chosen are not forwarded twice
    (exact; needs a loss reduced as ``capture.loss_reduction`` says). ``auto``: the step
    cost model decides (selection/stepcost.py; off under ZeRO-3 and on GPUs). ``off``: the
    chosen are forwarded again."""

    random: bool = False
    """Baseline: keep a uniformly random subset of the same candidates (no scoring), for
    measuring what scoring adds."""

    log_scores: bool = True
    """Write chosen ids and scores of every step to ``<out>/selection.jsonl`` (one file per
    data-parallel rank: ``selection.dp<r>.jsonl``)."""

    def __post_init__(self) -> None:
        schema.check(self, "selection")
        if self.score == "content":
            self._check_content()
        if self.top_blocks is not None and self.include:
            raise ConfigError(f"selection.top_blocks={self.top_blocks} and selection.include="
                              f"{list(self.include)} both choose the scored layers; set only "
                              f"one of them")
        self._check_shortlist()
        if self.target_store is not None and self.projection is None:
            raise ConfigError("selection.target_store holds projected gradients: set "
                              "selection.projection to the store's projection")

    def gradient_settings(self) -> list[str]:
        """The fields of ``GRADIENT_SETTINGS`` away from their defaults."""
        defaults = {f.name: f.default for f in fields(self)}
        return [name for name in GRADIENT_SETTINGS if getattr(self, name) != defaults[name]]

    def _check_content(self) -> None:
        """``score="content"`` refuses what only the gradient score reads, by flag name."""
        if self.target_store is not None:
            raise ConfigError(f"{flag('target_store')} {self.target_store} is a gradient "
                              f"target, which the content score (the default) cannot read: "
                              f"add --selection-score alignment, or give --target-data")
        for name in self.gradient_settings():
            given, value = flag(name), getattr(self, name)
            if name == "projection":
                given, value = flag("projection_dim"), value.dim
            raise ConfigError(f"{given} {_as_flag_value(value)} only shapes the gradient "
                              f"score, which the default --selection-score content does not "
                              f"compute: add --selection-score alignment, or drop {given}")

    def _check_shortlist(self) -> None:
        """The settings the cascade (``shortlist``) cannot serve, refused at start."""
        s = self.shortlist
        if s is None:
            return
        why = None
        if s < 1:
            why = (f"probes fewer candidates than the policy must choose (ceil({s} * n) < n, "
                   f"n = k - round(uniform_mix * k)); set shortlist >= 1 (e.g. 1.5)")
        elif self.target_store is not None:
            why = ("ranks candidates by the target documents' n-grams, which "
                   "selection.target_store does not have; give selection.target_data "
                   "instead or unset shortlist")
        elif self.reuse_forward == "on":
            why = ("leaves the uniform share's examples unprobed, so they have no forward "
                   "graph to reuse; set selection.reuse_forward='auto' or 'off'")
        elif self.uniform_mix >= 1:
            why = ("has nothing to shortlist: uniform_mix=1 chooses every example "
                   "uniformly; lower uniform_mix or unset shortlist")
        if why is not None:
            raise ConfigError(f"selection.shortlist={s} {why}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SelectionConfig:
        return from_dict(cls, d, "selection")
