"""Equal-compute comparisons of a selection run against a (longer) random run.

Every evaluation point of a run's curve carries ``cpu_s``: the training process's CPU
seconds (``time.process_time``, one thread) since the run started, evaluations excluded.
Random is trained for several times the variant's steps on the same seed, so its curve
covers the CPU-seconds a selection run spends; reading it there gives the *gain at equal
compute*, and the CPU-seconds each run needs to reach a level give the *compute ratio*.
Curves are read linearly between evaluation points.
"""

from __future__ import annotations

import math


def truncate(curve: list[dict], steps: int) -> list[dict]:
    """The evaluation points of ``curve`` up to optimizer step ``steps``."""
    return [e for e in curve if e["step"] <= steps]


def loss_at(curve: list[dict], x: float, key: str = "cpu_s") -> float:
    """Target loss of ``curve`` at ``x`` (CPU-seconds or ``examples``), linear between
    points; NaN beyond the last point (the random run was not long enough)."""
    if x <= curve[0][key]:
        return curve[0]["target"]
    for a, b in zip(curve, curve[1:]):
        if x <= b[key]:
            f = (x - a[key]) / (b[key] - a[key]) if b[key] > a[key] else 1.0
            return a["target"] + f * (b["target"] - a["target"])
    return float("nan")


def reach(curve: list[dict], level: float, key: str = "cpu_s") -> float:
    """``key`` (CPU-seconds, examples) at which ``curve`` first reaches target loss
    ``level`` (linear between points); inf if it never does."""
    for a, b in zip(curve, curve[1:]):
        if b["target"] <= level:
            if a["target"] <= level:
                return a[key]
            f = (a["target"] - level) / (a["target"] - b["target"])
            return a[key] + f * (b[key] - a[key])
    return float("inf")


def equal_compute(random_curve: list[dict], curve: list[dict], steps: int) -> dict:
    """One seed: ``curve`` (a variant trained ``steps`` steps) against ``random_curve``
    (random on the same seed, at least ``steps`` steps; longer for the compute columns).

    Returns:
        ``gain_cpu``: random's target loss at the variant's final CPU-seconds minus the
        variant's final loss (NaN when random was not trained that long);
        ``gain_at_random_cpu``: the other direction: random's loss at ``steps`` steps minus
        the variant's loss at the CPU-seconds random spent on them (NaN when the variant
        spent fewer);
        ``cpu_ratio``: CPU-seconds the variant needs to reach random's loss at ``steps``
        steps, over the CPU-seconds random needs (inf: never);
        ``cpu``/``random_cpu``: CPU-seconds of both at ``steps`` steps.
    """
    if "cpu_s" not in curve[-1] or "cpu_s" not in random_curve[-1]:
        nan = float("nan")
        return {"gain_cpu": nan, "gain_at_random_cpu": nan, "cpu_ratio": nan, "cpu": nan,
                "random_cpu": nan}
    short = truncate(random_curve, steps)
    level = short[-1]["target"]
    mine = curve[-1]
    need_r, need_v = reach(short, level), reach(curve, level)
    ratio = need_v / need_r if need_r > 0 and math.isfinite(need_v) else float("inf")
    return {"gain_cpu": loss_at(random_curve, mine["cpu_s"]) - mine["target"],
            "gain_at_random_cpu": level - loss_at(curve, short[-1]["cpu_s"]),
            "cpu_ratio": ratio, "cpu": mine["cpu_s"], "random_cpu": short[-1]["cpu_s"]}
