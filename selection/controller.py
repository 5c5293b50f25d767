"""Run-time controller: which arm chooses each block of steps, by held-out gain per CPU-second.

Arms (``selection.controller_arms``): ``uniform`` (a uniform draw, no scoring), ``content``
(the content prior ranks, no probe), ``gradient`` (the configured score: the full probe, or
the cascade with ``shortlist``). Training is cut into blocks of ``controller_block``
optimizer steps, each run by one arm; ``controller_window`` blocks make a window.

**Measurement.** At every block edge the model's loss on the held-out target documents
(``validation_fraction``; never scored, never trained on) is measured with a forward only
(eval mode, no gradient; each data-parallel rank forwards its share, sums all-reduced):
the block's gain is ``L(start) - L(end)`` on the same documents, its cost the CPU-seconds
the block took over all ranks (the measurement itself excluded), or, with
``controller_cost="model"``, the step-cost model's predicted plain-step units
(selection/stepcost.py; deterministic, so a run replays and resumes bit for bit).

**Fair comparison.** Every arm runs at least ``floor_blocks = max(1, ceil(floor * window))``
blocks of every window, in a seeded random order, so arms are interleaved in time and see
the same stretch of training. Per window and arm the efficiency is ``r = sum gain / sum
cost``, and the paired difference ``d_a = r_a - r_ref`` against the first arm (``uniform``
by default) in the same window removes what the stretch of training itself contributes.

**Allocation.** The first window splits blocks evenly. Afterwards each arm keeps its floor
and the remaining blocks of the window go to the arm with the highest lower confidence
bound ``mean(d_a) - se(d_a)`` (exponentially weighted over windows, ``DECAY`` per window;
the reference's bound is 0; after one window, before a standard error exists, the point
estimate ``d_a``). From the third window on, a costlier arm must show a gain per
CPU-second above the reference's by more than its standard error to get more than its
floor. All inputs are reduced over ranks, so every rank
makes the same choices; the order within a window is seeded by the window's index.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.ops.projection import stable_seed

__all__ = ["Allocator", "HeldOutLoss", "Controller", "DECAY", "window_counts", "controller_for"]

Batch = dict[str, torch.Tensor]

DECAY = 0.8
"""Weight of a window's paired difference per later window (effective memory ~5 windows)."""


def _bound(mean: float, se: float) -> float:
    """``mean - se``, or ``mean`` while ``se`` is unknown (one window: with the lower bound
    at -inf every costlier arm would wait a second window behind the reference, and a
    short run, two windows, would never leave it)."""
    return mean - se if math.isfinite(se) else mean


def window_counts(arms: tuple[str, ...], window: int, floor_blocks: int,
                  best: str | None) -> dict[str, int]:
    """Blocks per arm in one window: ``floor_blocks`` each and the rest to ``best``; when
    ``best`` is None, as even as possible (the earlier arms get the remainder)."""
    if best is None:
        base, extra = divmod(window, len(arms))
        return {a: base + (i < extra) for i, a in enumerate(arms)}
    counts = {a: floor_blocks for a in arms}
    counts[best] += window - floor_blocks * len(arms)
    return counts


class Allocator:
    """The bandit: schedules arms over blocks and learns from each block's gain and cost.

    Pure bookkeeping (no model, no clock), seeded and deterministic: the same sequence of
    ``record`` calls gives the same schedule.

    Args:
        arms: arm names; the first is the reference of the paired differences.
        window: blocks per window.
        floor: least share of every window's blocks per arm.
    """

    def __init__(self, arms: tuple[str, ...], window: int, floor: float) -> None:
        if len(arms) < 2 or len(set(arms)) != len(arms):
            raise ConfigError(f"selection.controller_arms={list(arms)}: give two or more "
                              f"distinct arms (uniform, content, gradient)")
        self.arms, self.window = tuple(arms), window
        self.floor_blocks = max(1, math.ceil(floor * window - 1e-9))
        if self.floor_blocks * len(arms) > window:
            raise ConfigError(f"selection.controller_floor={floor} gives each of the "
                              f"{len(arms)} arms {self.floor_blocks} of the {window} blocks of a "
                              f"window: more than the window holds; lower controller_floor or "
                              f"raise controller_window to >= {self.floor_blocks * len(arms)}")
        self.windows = 0  # windows completed
        self.schedule: list[str] = []  # arms of the current window's blocks, in order
        self.done = 0  # blocks of the current window recorded
        self._cur = {a: [0.0, 0.0] for a in self.arms}  # this window: [gain, cost]
        self.diffs: dict[str, list[float]] = {a: [] for a in self.arms}  # per window
        self.totals = {a: {"blocks": 0, "steps": 0, "gain": 0.0, "cost": 0.0}
                       for a in self.arms}
        self.history: list[dict[str, int]] = []  # blocks per arm of every window
        self._plan()

    def _plan(self) -> None:
        counts = window_counts(self.arms, self.window, self.floor_blocks, self.best())
        order = [a for a in self.arms for _ in range(counts[a])]
        gen = torch.Generator().manual_seed(stable_seed("controller", self.windows))
        self.schedule = [order[i] for i in torch.randperm(len(order), generator=gen).tolist()]
        self.history.append(counts)
        self.done = 0
        self._cur = {a: [0.0, 0.0] for a in self.arms}

    def arm(self) -> str:
        """The arm of the next block."""
        return self.schedule[self.done]

    def estimate(self, arm: str) -> tuple[float, float]:
        """``(mean, standard error)`` of ``arm``'s paired difference to the reference
        (weights ``DECAY**age``; se = inf with fewer than two windows)."""
        d = self.diffs[arm]
        if len(d) < 2:
            return (sum(d) / len(d) if d else 0.0), math.inf
        w = [DECAY ** (len(d) - 1 - i) for i in range(len(d))]
        sw = sum(w)
        mean = sum(wi * di for wi, di in zip(w, d)) / sw
        var = sum(wi * (di - mean) ** 2 for wi, di in zip(w, d)) / sw
        n_eff = sw * sw / sum(wi * wi for wi in w)
        return mean, math.sqrt(var / max(n_eff - 1, 1e-9))

    def best(self) -> str | None:
        """The arm with the highest lower bound (the reference's is 0; an arm with one
        window has no standard error yet and is judged by its point estimate); None before
        any window completed."""
        if self.windows == 0:
            return None
        bounds = {a: 0.0 if a == self.arms[0] else _bound(*self.estimate(a))
                  for a in self.arms}
        return max(self.arms, key=lambda a: (bounds[a], -self.arms.index(a)))

    def record(self, arm: str, gain: float, cost: float, steps: int) -> None:
        """One finished block of ``arm``: held-out loss gain, cost, optimizer steps."""
        t = self.totals[arm]
        t["blocks"] += 1
        t["steps"] += steps
        t["gain"] += gain
        t["cost"] += cost
        self._cur[arm][0] += gain
        self._cur[arm][1] += cost
        self.done += 1
        if self.done < len(self.schedule):
            return
        rate = {a: g / c if c > 0 else 0.0 for a, (g, c) in self._cur.items()}
        for a in self.arms:
            self.diffs[a].append(rate[a] - rate[self.arms[0]])
        self.windows += 1
        self._plan()

    def summary(self) -> dict:
        """Per arm: blocks, steps, cost, gain, gain per cost, paired advantage over the
        reference (mean, se); the latest window's allocation and the arm it favours."""
        arms = {}
        for a, t in self.totals.items():
            mean, se = self.estimate(a)
            arms[a] = {**t, "gain_per_cost": t["gain"] / t["cost"] if t["cost"] > 0 else None,
                       "advantage_vs_" + self.arms[0]: mean,
                       "advantage_se": se if math.isfinite(se) else None}
        return {"arms": arms, "windows": self.windows, "favoured": self.best(),
                "allocation": self.history[-1], "history": self.history}

    def state_dict(self) -> dict:
        return {"windows": self.windows, "schedule": list(self.schedule), "done": self.done,
                "current": {a: list(v) for a, v in self._cur.items()},
                "diffs": {a: list(v) for a, v in self.diffs.items()},
                "totals": {a: dict(v) for a, v in self.totals.items()},
                "history": [dict(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        if set(state["totals"]) != set(self.arms):
            raise ConfigError(f"The checkpoint's controller ran arms {sorted(state['totals'])}, "
                              f"this run {sorted(self.arms)}: resume with the same "
                              f"selection.controller_arms")
        self.windows, self.done = int(state["windows"]), int(state["done"])
        self.schedule = list(state["schedule"])
        self._cur = {a: [float(x) for x in v] for a, v in state["current"].items()}
        self.diffs = {a: [float(x) for x in v] for a, v in state["diffs"].items()}
        self.totals = {a: dict(v) for a, v in state["totals"].items()}
        self.history = [dict(h) for h in state["history"]]


class HeldOutLoss:
    """The model's token-mean loss on the held-out target documents, forward only.

    Each data-parallel rank forwards rows ``rank::world`` in one call (all rows when there
    are fewer than ranks) and the sums are all-reduced, so every rank gets the same value.

    Args:
        model: the trained module.
        documents: the held-out documents' model inputs (``input_ids``, optional
            ``labels``/``attention_mask``), on CPU.
        ctx: data-parallel group.
        label_shift, ignore_index: how the model's labels count tokens.
    """

    def __init__(self, model: nn.Module, documents: Batch, ctx: ParallelContext | None = None,
                 *, label_shift: int = 1, ignore_index: int = -100) -> None:
        self.model, self.ctx = model, ctx or ParallelContext()
        n = documents["input_ids"].shape[0]
        self.split = n >= self.ctx.dp_world
        rows = torch.arange(self.ctx.dp_rank, n, self.ctx.dp_world) if self.split else \
            torch.arange(n)
        self.batch = {k: v[rows] for k, v in documents.items()}
        self.batch.setdefault("labels", self.batch["input_ids"])
        self.label_shift, self.ignore_index = label_shift, ignore_index

    def __call__(self) -> float:
        device = next(self.model.parameters()).device
        batch = {k: v.to(device) for k, v in self.batch.items()}
        tokens = (batch["labels"][:, self.label_shift:] != self.ignore_index).sum()
        was = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                loss = self.model(**batch).loss.detach().double()
        finally:
            self.model.train(was)
        t = torch.stack([loss * tokens, tokens.double()]).to(device)
        if self.split:
            all_reduce_sum(t, self.ctx.dp_group, self.ctx.dp_world)
        return float(t[0] / t[1].clamp_min(1))


class Controller:
    """Runs the ``Allocator`` on a training run: block edges, measurements, costs.

    Args:
        allocator: the bandit.
        block: optimizer steps per block.
        loss: ``() -> float``, the held-out loss (collective over the data-parallel group).
        cost: ``"measured"`` (CPU-seconds, summed over ranks) or ``"model"`` (plain-step
            units of ``units(arm)`` per step).
        units: ``arm -> predicted step / plain step`` (the step-cost model's modes).
        ctx: data-parallel group (CPU-seconds are summed over it).
        clock: CPU seconds of this process (``time.process_time``; tests pass their own).
        prior: the ``content`` arm's content prior when no other stage holds it (its
            stream counts are saved with the controller's state).
    """

    def __init__(self, allocator: Allocator, block: int, loss: Callable[[], float], *,
                 cost: str = "measured", units: Callable[[str], float] | None = None,
                 ctx: ParallelContext | None = None,
                 clock: Callable[[], float] = time.process_time, prior=None) -> None:
        self.allocator, self.block, self.loss, self.prior = allocator, block, loss, prior
        self.cost, self.units, self.clock = cost, units, clock
        self.ctx = ctx or ParallelContext()
        self._block: int | None = None  # index of the running block
        self._arm = ""
        self._start_loss = 0.0
        self._t0 = 0.0
        self._steps: set[int] = set()
        self._discard = False  # the running block's cost is unknown (resumed mid-block)
        self.measure_s = 0.0
        self.measures = 0

    def _measure(self) -> float:
        t = self.clock()
        value = self.loss()
        self.measure_s += self.clock() - t
        self.measures += 1
        return value

    def arm(self, step: int) -> str:
        """The arm that chooses this micro-batch of optimizer step ``step`` (the first
        micro-batch of a new block closes the last one: collective then)."""
        b = step // self.block
        if self._block is None or b != self._block:
            self._edge(b)
        self._steps.add(step)
        return self._arm

    def _edge(self, b: int) -> None:
        spent = self.clock() - self._t0
        now = self._measure()
        if self._block is not None and not self._discard:
            steps = len(self._steps)
            if self.cost == "model":
                cost = steps * (self.units(self._arm) if self.units else 1.0)
            else:
                c = torch.tensor([spent], dtype=torch.float64)
                cost = float(all_reduce_sum(c, self.ctx.dp_group, self.ctx.dp_world))
            self.allocator.record(self._arm, self._start_loss - now, cost, steps)
        self._block, self._arm = b, self.allocator.arm()
        self._start_loss, self._steps, self._discard = now, set(), False
        self._t0 = self.clock()

    def summary(self) -> dict:
        """The allocator's summary with the block size, cost unit and measurement cost."""
        return {**self.allocator.summary(), "block_steps": self.block,
                "cost_unit": "plain steps (step-cost model)" if self.cost == "model"
                else "CPU-s (all ranks)", "held_out_measures": self.measures,
                "held_out_measure_cpu_s": self.measure_s}

    def state_dict(self) -> dict:
        """Plain numbers, strings and lists (a checkpoint's ``"controller"`` entry)."""
        return {"allocator": self.allocator.state_dict(),
                "block": -1 if self._block is None else self._block, "arm": self._arm,
                "start_loss": self._start_loss, "steps": sorted(self._steps),
                "measures": self.measures, "measure_s": self.measure_s,
                "prior": None if self.prior is None else self.prior.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``. With measured costs the interrupted block's CPU time
        is lost: that block is not recorded (its arm still finishes it)."""
        self.allocator.load_state_dict(state["allocator"])
        self._block = None if int(state["block"]) < 0 else int(state["block"])
        self._arm, self._start_loss = str(state["arm"]), float(state["start_loss"])
        self._steps = {int(s) for s in state["steps"]}
        self.measures, self.measure_s = int(state["measures"]), float(state["measure_s"])
        if self.prior is not None and state.get("prior") is not None:
            self.prior.load_state_dict(state["prior"])
        self._discard = self.cost != "model"
        self._t0 = self.clock()


def controller_for(config, model: nn.Module, held_out: Batch | None, *,
                   ctx: ParallelContext | None = None, label_shift: int = 1,
                   ignore_index: int = -100,
                   units: Callable[[str], float] | None = None) -> Controller | None:
    """The controller of ``config`` (None when ``selection.controller`` is off) on the
    held-out documents' model inputs ``held_out``.

    Raises:
        ConfigError: the controller is on and there are no held-out documents.
    """
    if not config.controller:
        return None
    if held_out is None:
        raise ConfigError("selection.controller measures each arm's gain on the held-out "
                          "target documents, and this selector has none: set "
                          "selection.validation_fraction (e.g. 0.2) and build the selector "
                          "with OnlineSelector.for_target_data (or pass held_out=)")
    loss = HeldOutLoss(model, held_out, ctx, label_shift=label_shift,
                       ignore_index=ignore_index)
    return Controller(Allocator(tuple(config.controller_arms), config.controller_window,
                                config.controller_floor),
                      config.controller_block, loss, cost=config.controller_cost, units=units,
                      ctx=ctx)
