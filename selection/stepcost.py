"""What a selection step costs against a plain step, in forward units, explained once per run.

Units per example: a forward is 1, each half of a backward (activation and weight gradients)
is 1, so a plain step on ``k`` examples is ``3k``. The per-part table, the ratio of every
mode (uniform, content, cascade, full probe) and the measurements behind the constants are
in docs/selection_cost.md ("The step-cost model").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

__all__ = ["StepCost", "decide_reuse", "REUSE_CALL_OVERHEAD_S"]


@dataclass(frozen=True)
class StepCost:
    """Predicted units of one selection step (docs/selection_cost.md, "The step-cost model").

    Attributes:
        candidates: ``C``, candidates scored per micro-batch.
        trained: ``k``, examples trained per micro-batch.
        share: ``s``, share of the blocks the probe backward runs through.
        normalize: cosine scores (adds the candidates' gradient norms).
        target_examples: ``n``, target examples per refresh on this rank.
        refresh_every: ``r``, steps between target refreshes.
        reuse: the chosen are back-propagated from the probe's graphs (no second forward).
        probe: the score reads gradients (False: ``score="content"``, no probe, no target
            refresh: only the training step and hashing, ~1x a plain step).
        probed: ``S``, candidates probed per micro-batch (the cascade's shortlist); None:
            all ``candidates``.
    """

    candidates: int
    trained: int
    share: float
    normalize: bool
    target_examples: int
    refresh_every: int
    reuse: bool = False
    probe: bool = True
    probed: int | None = None

    def units(self) -> dict[str, float]:
        c = self.candidates if self.probed is None else self.probed
        k, s = self.trained, self.share
        p = 1.0 if self.probe else 0.0
        return {"probe forward": p * c, "probe backward": p * c * s,
                "scoring": p * c * s * (2.0 if self.normalize else 1.0),
                "training step": (2.0 if self.reuse else 3.0) * k,
                "target refresh": p * self.target_examples * (1.0 + 2.0 * s)
                / self.refresh_every}

    def ratio(self) -> float:
        """Predicted selection step / plain step (``3k``)."""
        return sum(self.units().values()) / (3.0 * self.trained)

    def bound(self) -> float:
        """The ratio without scoring and refresh: the floor of this path."""
        u = self.units()
        return (u["probe forward"] + u["probe backward"] + u["training step"]) / (3.0 * self.trained)

    def per_probed(self) -> float:
        """Units one probed candidate adds: forward, backward to the scored blocks, scoring
        (``1 + s + s (1 + norm)``)."""
        s = self.share
        return 1.0 + s + s * (2.0 if self.normalize else 1.0)

    def modes(self, shortlist: int | None = None) -> dict[str, float]:
        """Predicted ratio to a plain step of every mode on this run's sizes (module table):
        ``uniform``, ``content``, ``cascade S=<S>`` (``shortlist`` or this plan's ``probed``;
        absent when neither), ``full probe``. Forward reuse is not assumed in any of them."""
        base = replace(self, reuse=False, probe=True)
        out = {"uniform": 1.0, "content": 1.0}
        s = shortlist if shortlist is not None else self.probed
        if s is not None and s < self.candidates:
            out[f"cascade S={s}"] = replace(base, probed=s).ratio()
        out["full probe"] = replace(base, probed=None).ratio()
        return out

    def shortlist_within(self, budget: float) -> int:
        """The most candidates a cascade may probe so that a step costs at most ``budget``
        times a plain step (0: not even one; capped at ``candidates``)."""
        fixed = replace(self, probed=0, reuse=False, probe=True).units()
        free = budget * 3.0 * self.trained - sum(fixed.values())
        if free <= 0:
            return 0
        # the refresh does not grow with S: each probed candidate adds per_probed() units
        return min(self.candidates, int(free // self.per_probed() + 1e-9))

    def explain(self, scored: str, reuse_why: str) -> str:
        parts = ", ".join(f"{name} {v:.3g}" for name, v in self.units().items())
        probed = "" if self.probed is None else f" (cascade: {self.probed} probed)"
        modes = ", ".join(f"{name} {v:.2f}x" for name, v in self.modes().items())
        return (f"online selection step plan: {scored}; {self.candidates} candidates{probed} "
                f"for {self.trained} trained; forward reuse {'on' if self.reuse else 'off'} "
                f"({reuse_why}); units (1 = one example's forward, plain step = "
                f"{3 * self.trained}): {parts}; predicted {self.ratio():.2f}x a plain step "
                f"(floor of this path {self.bound():.2f}x); modes on these sizes: {modes}; "
                f"a cascade within 1.5x probes at most {self.shortlist_within(1.5)} candidates")


#: Fixed CPU seconds per model call and captured layer that per-candidate calls add
#: (measured: docs/selection_cost.md, "The step-cost model").
REUSE_CALL_OVERHEAD_S = 7e-4


def decide_reuse(setting: str, model: nn.Module, *, tokens: int, candidates: int,
                 trained: int, layers: int, flops_per_s: float) -> tuple[bool, str]:
    """``(reuse the candidates' forward?, why)`` for ``selection.reuse_forward``.

    ``auto`` reuses when the saved forwards outweigh the per-call overhead:
    ``k * 2 * T * P / flops_per_s > C * layers * REUSE_CALL_OVERHEAD_S`` (``P`` parameters),
    and never for partitioned (ZeRO-3) parameters or non-CPU devices.
    """
    if setting != "auto":
        return setting == "on", "set by selection.reuse_forward"
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        return False, ("ZeRO-3 partitioned parameters: one call per candidate gathers every "
                       "module again (measured 2.4-2.8x a batched forward on 2 ranks)")
    if params and params[0].device.type != "cpu":
        return False, f"per-example calls underuse a {params[0].device.type} device"
    saved = trained * 2.0 * tokens * sum(p.numel() for p in params) / flops_per_s
    extra = candidates * layers * REUSE_CALL_OVERHEAD_S
    why = (f"saves ~{saved * 1e3:.3g} ms of forwards, per-candidate calls add "
           f"~{extra * 1e3:.3g} ms")
    return saved > extra, why
