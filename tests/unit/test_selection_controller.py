"""The run-time controller (selection/controller.py, ``selection.controller``).

Invariants: on hand-made gains and costs the allocator gives every arm its floor in every
window, gives the rest to the arm with the best gain per cost once its paired advantage is
clear, and is deterministic (same inputs, same schedule, seeded order); the controller
measures the held-out loss once per block edge and charges each block's gain and cost to
the arm that ran it; its state round-trips (a resumed controller continues like an
uninterrupted one); in a selector, arms that need no probe run none and the summary reports
each arm; settings it cannot serve fail at start.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.selection import OnlineSelector, SelectionConfig
from dattri_ds.selection.controller import (
    Allocator, Controller, HeldOutLoss, window_counts,
)
from reference import tiny_gpt2

ARMS = ("uniform", "content", "gradient")


def _simulate(rates: dict[str, tuple[float, float]], windows: int, noise: float = 0.1,
              seed: int = 0) -> Allocator:
    """Run ``windows`` windows on an allocator: a block of arm a gains ``g_a * drift``
    (+ noise) for cost ``c_a``; ``drift`` shrinks with time (paired comparison cancels it)."""
    alloc = Allocator(ARMS, window=10, floor=0.1)
    rng = random.Random(seed)
    block = 0
    while alloc.windows < windows:
        arm = alloc.arm()
        g, c = rates[arm]
        drift = 1.0 / (1 + 0.05 * block)
        alloc.record(arm, g * drift * (1 + noise * rng.uniform(-1, 1)), c, 5)
        block += 1
    return alloc


def test_window_counts_and_floor():
    """Even split before any estimate; then the floor each and the rest to the best."""
    assert window_counts(ARMS, 10, 1, None) == {"uniform": 4, "content": 3, "gradient": 3}
    assert window_counts(ARMS, 10, 2, "gradient") == {"uniform": 2, "content": 2,
                                                      "gradient": 6}
    with pytest.raises(ConfigError, match="controller_floor"):
        Allocator(ARMS, window=4, floor=0.5)
    with pytest.raises(ConfigError, match="distinct"):
        Allocator(("uniform", "uniform"), window=4, floor=0.1)


@pytest.mark.parametrize("best,rates", [
    ("content", {"uniform": (1.0, 1.0), "content": (1.5, 1.02), "gradient": (2.0, 4.0)}),
    ("gradient", {"uniform": (1.0, 1.0), "content": (1.1, 1.02), "gradient": (8.0, 4.0)}),
    ("uniform", {"uniform": (1.0, 1.0), "content": (0.9, 1.02), "gradient": (3.0, 4.0)}),
])
def test_allocation_on_hand_made_gains_and_costs(best, rates):
    """The arm with the best gain per cost gets the most steps; every arm keeps its floor
    (one block of ten) in every window; the order inside a window is seeded."""
    alloc = _simulate(rates, windows=8)
    assert alloc.history[0] == {"uniform": 4, "content": 3, "gradient": 3}
    for counts in alloc.history:
        assert all(n >= 1 for n in counts.values()) and sum(counts.values()) == 10
    assert alloc.history[-1][best] == 8
    steps = {a: t["steps"] for a, t in alloc.totals.items()}
    assert max(steps, key=steps.get) == best
    s = alloc.summary()
    assert s["favoured"] == best and s["windows"] == 8
    # pooled gain per cost favours whichever arm ran early (larger gains then); the paired
    # advantage over the reference in the same windows does not
    adv = {a: v["advantage_vs_uniform"] for a, v in s["arms"].items()}
    assert max(adv, key=adv.get) == best


def test_allocation_is_deterministic_and_conservative():
    """Same gains, same schedule; with gains per cost equal up to noise the costlier arms
    do not get more than their floor (the reference keeps the rest)."""
    rates = {"uniform": (1.0, 1.0), "content": (1.5, 1.02), "gradient": (2.0, 4.0)}
    a, b = _simulate(rates, 5), _simulate(rates, 5)
    assert a.history == b.history and a.schedule == b.schedule and a.diffs == b.diffs
    even = {"uniform": (1.0, 1.0), "content": (1.02, 1.02), "gradient": (4.0, 4.0)}
    alloc = _simulate(even, windows=6, noise=0.5)
    assert alloc.history[-1]["gradient"] == 1


def test_second_window_follows_the_first_windows_point_estimate():
    """With one finished window an arm's advantage has no standard error yet; the point
    estimate decides the second window (a lower bound of -inf would keep every costlier arm
    at its floor for two windows, the whole of a short run, even when it is clearly better)."""
    rates = {"uniform": (1.0, 1.0), "content": (3.0, 1.02), "gradient": (2.0, 4.0)}
    alloc = _simulate(rates, windows=1, noise=0.0)
    assert alloc.windows == 1 and math.isinf(alloc.estimate("content")[1])
    assert alloc.best() == "content"
    assert alloc.history[-1] == {"uniform": 1, "content": 8, "gradient": 1}


class _Sim:
    """A training run in miniature: the held-out loss falls by the running arm's gain per
    step; a fake CPU clock advances by the arm's cost per step."""

    def __init__(self, gains, costs):
        self.gains, self.costs = gains, costs
        self.loss_value, self.t = 10.0, 0.0

    def loss(self):
        return self.loss_value

    def clock(self):
        return self.t

    def step(self, arm):
        self.loss_value -= self.gains[arm]
        self.t += self.costs[arm]


def _drive(ctrl, sim, steps, start=0):
    arms = []
    for step in range(start, start + steps):
        for _micro in range(2):  # gradient accumulation: one arm per optimizer step
            arm = ctrl.arm(step)
        sim.step(arm)
        arms.append(arm)
    return arms


def test_controller_measures_at_block_edges_and_charges_the_arm():
    """Held-out loss measured once per block edge (not per micro-batch); each recorded
    block carries its arm's gain and cost (measured clock)."""
    sim = _Sim({"uniform": 0.01, "content": 0.02, "gradient": 0.05},
               {"uniform": 1.0, "content": 1.0, "gradient": 4.0})
    ctrl = Controller(Allocator(ARMS, 4, 0.25), 3, sim.loss, clock=sim.clock)
    arms = _drive(ctrl, sim, 30)
    assert ctrl.measures == 10  # edges at steps 0, 3, ..., 27
    assert all(len(set(arms[i:i + 3])) == 1 for i in range(0, 30, 3))
    tot = ctrl.allocator.totals
    assert sum(t["blocks"] for t in tot.values()) == 9 and sum(t["steps"] for t in
                                                              tot.values()) == 27
    for arm, t in tot.items():
        if t["blocks"]:
            assert t["gain"] == pytest.approx(t["steps"] * sim.gains[arm])
            assert t["cost"] == pytest.approx(t["steps"] * sim.costs[arm])
    assert ctrl.summary()["held_out_measures"] == 10


def test_state_round_trip_continues_like_an_uninterrupted_run():
    """model costs: save mid-block, load into a fresh controller, continue: the same arms
    and the same totals as without the interruption."""
    def make(sim):
        return Controller(Allocator(ARMS, 4, 0.25), 3, sim.loss, cost="model",
                          units={"uniform": 1.0, "content": 1.0, "gradient": 4.0}.get,
                          clock=sim.clock)
    gains = {"uniform": 0.01, "content": 0.03, "gradient": 0.05}
    ref_sim = _Sim(gains, {a: 1.0 for a in ARMS})
    ref = make(ref_sim)
    want = _drive(ref, ref_sim, 40)
    sim = _Sim(gains, {a: 1.0 for a in ARMS})
    first = make(sim)
    got = _drive(first, sim, 17)
    state = first.state_dict()
    assert all(isinstance(v, (int, float, str, list, dict, type(None))) for v in state.values())
    second = make(sim)
    second.load_state_dict(state)
    got += _drive(second, sim, 23, start=17)
    assert got == want
    assert second.allocator.totals == ref.allocator.totals


def _batch(ids):
    return {"input_ids": ids, "labels": ids}


def test_held_out_loss_is_the_token_mean_forward_only():
    """HeldOutLoss equals the model's loss on the held-out documents and leaves no grads
    and the training mode as it was."""
    model = tiny_gpt2(seed=0)
    model.train()
    docs = torch.randint(0, 97, (3, 8), generator=torch.Generator().manual_seed(1))
    got = HeldOutLoss(model, _batch(docs))()
    model.eval()
    with torch.no_grad():
        want = float(model(**_batch(docs)).loss)
    assert got == pytest.approx(want, rel=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_selector_runs_the_arms_and_reports_them():
    """In a selector with SGD steps between selections: uniform and content blocks run no
    probe, gradient blocks do; the summary reports every arm; the held-out check is off."""
    model = tiny_gpt2(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tgt = torch.randint(0, 97, (9, 8), generator=torch.Generator().manual_seed(7))
    cfg = SelectionConfig(enabled=True, score="alignment", validation_fraction=0.34,
                          controller=True, controller_block=1, controller_window=3,
                          controller_cost="model", refresh_every=100)
    sel = OnlineSelector.for_target_data(model, cfg, _batch(tgt))
    assert sel.check is None
    probes = []
    raw = sel.probe.probe
    sel.probe.probe = lambda fwd, **kw: probes.append(1) or raw(fwd, **kw)
    gen = torch.Generator().manual_seed(3)
    arms = []
    for step in range(9):
        before = len(probes)
        got = sel.select(_batch(torch.randint(0, 97, (8, 8), generator=gen)), 4, step)
        arms.append(sel.controller._arm)
        probed = len(probes) > before
        assert probed == (arms[-1] == "gradient"), (step, arms[-1])
        assert got.batch["input_ids"].shape[0] == 4
        opt.zero_grad()
        model(**got.batch).loss.backward()
        opt.step()
    summary = sel.summary()["controller"]
    sel.close()
    assert set(arms) == set(ARMS)
    assert sum(v["blocks"] for v in summary["arms"].values()) == 8
    assert summary["cost_unit"].startswith("plain steps") and summary["windows"] >= 2
    g = summary["arms"]["gradient"]
    assert g["cost"] == pytest.approx(g["steps"] * sel.plan.ratio())


def test_controller_settings_fail_at_start():
    """Without a validation split, with too high a floor, duplicate arms, the random
    baseline or a scale-reading policy with the content arm: a ConfigError at start."""
    with pytest.raises(ConfigError, match="validation_fraction"):
        SelectionConfig(controller=True)
    with pytest.raises(ConfigError, match="controller_floor"):
        SelectionConfig(controller=True, validation_fraction=0.2, controller_floor=0.5)
    with pytest.raises(ConfigError, match="distinct"):
        SelectionConfig(controller=True, validation_fraction=0.2,
                        controller_arms=("uniform", "uniform"))
    with pytest.raises(ConfigError, match="distinct"):
        SelectionConfig(controller=True, validation_fraction=0.2,
                        controller_arms=("uniform", "bandit"))
    with pytest.raises(ConfigError, match="random"):
        SelectionConfig(controller=True, validation_fraction=0.2, random=True)
    with pytest.raises(ConfigError, match="content"):
        SelectionConfig(controller=True, validation_fraction=0.2, policy="greats",
                        content_weight=0.0, projection={"dim": 8})
    assert SelectionConfig.from_dict({"controller": True, "validation_fraction": 0.2,
                                      "controller_arms": ["uniform", "gradient"]}
                                     ).controller_arms == ("uniform", "gradient")
    # a selector built without held-out documents cannot measure: refused at construction
    from dattri_ds.selection import ValidationTarget

    model = tiny_gpt2(seed=0)
    cfg = SelectionConfig(enabled=True, score="alignment", controller=True,
                          validation_fraction=0.2)
    probe = OnlineSelector.probe_capture(model, cfg)
    tgt = torch.randint(0, 97, (4, 8))
    target = ValidationTarget(probe, lambda b: model(**b).loss, _batch(tgt))
    with pytest.raises(ConfigError, match="held-out"):
        OnlineSelector(model, cfg, target, probe=probe)
    probe.detach()
    assert math.isfinite(HeldOutLoss(model, _batch(tgt))())
