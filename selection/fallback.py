"""Held-out check: is selection choosing examples that help targets it does not score?

The target set is split: selection scores against one part, and this check measures, on
every micro-batch, how much more the chosen examples align with the *held-out* part's
gradient than the average candidate does (``advantage = mean_chosen <g_b, g_val> -
mean_all <g_b, g_val>``, in the same score space: cosine / preconditioned if configured).
Every ``every`` optimizer steps the window's mean advantage is reduced over the data-
parallel group (so all ranks decide alike); when it is not positive, selection is only
fitting the scored part, and the selector falls back to a uniform choice for the rest of
the run. A first-order signal: it catches choices that do not generalize to held-out
target documents, not second-order effects of the optimizer.
"""

from __future__ import annotations

import torch

from dattri_ds.distributed import ParallelContext, all_reduce_sum

__all__ = ["HeldOutCheck", "split_rows"]


def split_rows(n: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scoring rows, held-out rows)`` of ``n`` target documents: every
    ``round(1/fraction)``-th one is held out (at least one of each when ``n >= 2``)."""
    stride = max(2, round(1 / fraction))
    held = torch.arange(stride - 1, n, stride) if n >= stride else \
        torch.zeros(0, dtype=torch.long)
    if held.numel() == 0 and n >= 2:
        held = torch.tensor([n - 1])
    keep = torch.ones(n, dtype=torch.bool)
    keep[held] = False
    return torch.nonzero(keep).flatten(), held


class HeldOutCheck:
    """Accumulates the held-out advantage of the chosen examples; decides the fallback."""

    def __init__(self, every: int, ctx: ParallelContext | None = None) -> None:
        self.every, self.ctx = every, ctx or ParallelContext()
        self._sum, self._n = 0.0, 0
        self._checked_at = 0
        self.history: list[dict] = []
        self.fell_back_at: int | None = None

    def add(self, val_scores: torch.Tensor, chosen: torch.Tensor) -> None:
        """One micro-batch: ``val_scores [C]`` against the held-out target, ``chosen`` idx."""
        self._sum += float(val_scores[chosen].mean() - val_scores.mean())
        self._n += 1

    def decide(self, step: int) -> bool:
        """At every ``every``-th step (collective then): True when selection should stop."""
        if self.fell_back_at is not None:
            return True
        if step < self._checked_at + self.every:
            return False
        t = torch.tensor([self._sum, float(self._n)], dtype=torch.float64)
        all_reduce_sum(t, self.ctx.dp_group, self.ctx.dp_world)
        adv = float(t[0] / t[1].clamp_min(1))
        self.history.append({"step": step, "advantage": adv})
        self._sum, self._n, self._checked_at = 0.0, 0, step
        if adv <= 0:
            self.fell_back_at = step
        return self.fell_back_at is not None

    def summary(self) -> dict:
        return {"fell_back_at_step": self.fell_back_at, "checks": self.history}

    def state_dict(self) -> dict:
        """The open window (sum and count), the clock, the history and the fallback step."""
        return {"sum": self._sum, "n": self._n, "checked_at": self._checked_at,
                "history": [dict(h) for h in self.history], "fell_back_at": self.fell_back_at}

    def load_state_dict(self, state: dict) -> None:
        self._sum, self._n = float(state["sum"]), int(state["n"])
        self._checked_at = int(state["checked_at"])
        self.history = [dict(h) for h in state["history"]]
        self.fell_back_at = None if state["fell_back_at"] is None else int(state["fell_back_at"])
