"""What a selection step costs against a plain step, in forward units, explained once per run.

Units per example: a forward is 1, the activation-gradient half of a backward is 1, the
weight-gradient half is 1, so a plain step on ``k`` examples is ``3k``. With ``C``
candidates, a probe backward that reaches a share ``s`` of the blocks (``s = 1`` when every
layer is scored: the backward must reach the embeddings; ``N / L`` for the top ``N`` of
``L`` blocks), ``n`` target examples recomputed every ``r`` steps:

| part                 | units                  | why                                        |
|----------------------|------------------------|--------------------------------------------|
| probe forward        | ``C``                  | every candidate is forwarded once          |
| probe backward       | ``C * s``              | activation gradients only, no weight GEMMs |
| scoring              | ``C * s * (1 + norm)`` | a ghost ``<G_b, G_target>`` costs one      |
|                      |                        | weight-gradient GEMM per scored layer;     |
|                      |                        | cosine adds the ghost norms (``norm ~ 1``) |
| training step        | ``3k``                 | the chosen are forwarded again (no reuse)  |
| target refresh       | ``n * 2s / r``         | probe forward + backward of the target     |

At ``C = 2k`` without forward reuse the ratio is at least ``(2 + 2s + 3) / 3``: 2.33x with
every layer scored, 1.67x as ``s -> 0``. Only reusing the candidates' forward for the
training backward (``2 + 2s + 2``)/3 can reach 1.5x, and only with ``s <= 0.25``.

Forward reuse (``selection.reuse_forward``) needs one model call per candidate (a graph
per example, so the chosen can be back-propagated alone). Measured here (GPT-2 4x256,
T=128, 16 examples, CPU-s of one thread): 16 single calls cost 1.17x one batched call in
one process, but 2.4-2.8x under ZeRO-3 on 2 ranks, where every call gathers every
module's partitioned parameters again; there the extra gathers cost more than the ``k``
forwards reuse saves. ``decide_reuse`` encodes that.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["StepCost", "decide_reuse", "REUSE_MIN_FLOPS"]


@dataclass(frozen=True)
class StepCost:
    """Predicted units of one selection step (see the module table).

    Attributes:
        candidates: ``C``, candidates scored per micro-batch.
        trained: ``k``, examples trained per micro-batch.
        share: ``s``, share of the blocks the probe backward runs through.
        normalize: cosine scores (adds the candidates' gradient norms).
        target_examples: ``n``, target examples per refresh on this rank.
        refresh_every: ``r``, steps between target refreshes.
    """

    candidates: int
    trained: int
    share: float
    normalize: bool
    target_examples: int
    refresh_every: int
    reuse: bool = False

    def units(self) -> dict[str, float]:
        c, k, s = self.candidates, self.trained, self.share
        return {"probe forward": float(c), "probe backward": c * s,
                "scoring": c * s * (2.0 if self.normalize else 1.0),
                "training step": (2.0 if self.reuse else 3.0) * k,
                "target refresh": self.target_examples * 2.0 * s / self.refresh_every}

    def ratio(self) -> float:
        """Predicted selection step / plain step (``3k``)."""
        return sum(self.units().values()) / (3.0 * self.trained)

    def bound(self) -> float:
        """The ratio without scoring and refresh: the floor of this path."""
        u = self.units()
        return (u["probe forward"] + u["probe backward"] + u["training step"]) / (3.0 * self.trained)

    def explain(self, scored: str, reuse_why: str) -> str:
        parts = ", ".join(f"{name} {v:.3g}" for name, v in self.units().items())
        return (f"online selection step plan: {scored}; {self.candidates} candidates for "
                f"{self.trained} trained; forward reuse {'on' if self.reuse else 'off'} "
                f"({reuse_why}); units (1 = one example's forward, plain step = "
                f"{3 * self.trained}): {parts}; predicted {self.ratio():.2f}x a plain step "
                f"(floor of this path {self.bound():.2f}x)")


#: Per-example forward work (FLOPs, ``2 * T * parameters``) below which one model call per
#: candidate costs more in fixed per-call overhead (Python, hooks, per-record bookkeeping:
#: a few ms) than the saved forwards: measured here, GPT-2 2x64 at T=32 (~10 MFLOP) ran a
#: reused step at 7.5x a plain step against 3.3x batched.
REUSE_MIN_FLOPS = 1e9


def decide_reuse(setting: str, model: nn.Module, scope: str, tokens: int) -> tuple[bool, str]:
    """``(reuse the candidates' forward?, why)`` for ``selection.reuse_forward`` on
    candidates of ``tokens`` tokens."""
    if setting != "auto":
        return setting == "on", "set by selection.reuse_forward"
    if scope == "global":
        return False, "global scope trains examples of other ranks"
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        return False, ("ZeRO-3 partitioned parameters: one call per candidate gathers every "
                       "module again (measured 2.4-2.8x a batched forward on 2 ranks)")
    if params and params[0].device.type != "cpu":
        return False, f"per-example calls underuse a {params[0].device.type} device"
    flops = 2.0 * tokens * sum(p.numel() for p in params)
    if flops < REUSE_MIN_FLOPS:
        return False, (f"a per-example forward is ~{flops / 1e9:.2g} GFLOP, under "
                       f"{REUSE_MIN_FLOPS / 1e9:g}: per-call overhead outweighs the saved "
                       f"forwards")
    return True, (f"unpartitioned CPU model, ~{flops / 1e9:.2g} GFLOP per example's forward: "
                  f"per-example calls cost ~1.17x a batched forward and save the chosen "
                  f"examples' second forward")
