"""Paired statistics of selection runs against random: equal data and equal compute.

Every evaluation point of a run's curve carries ``cpu_s``: the training process's CPU
seconds (``time.process_time``, one thread) since the run started, evaluations excluded.
Random is trained for several times the variant's steps on the same seed, so its curve
covers the CPU-seconds a selection run spends; reading it there gives the *gain at equal
compute*, and the CPU-seconds each run needs to reach a level give the *compute ratio*.
Curves are read linearly between evaluation points.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

try:
    from benchmarks import _noisy_pools as noisy
except ImportError:  # benchmarks/ itself on sys.path
    import _noisy_pools as noisy

#: the "after warm-up" mean gain counts evaluations after this step
WARMUP_EVAL = 50


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


def interp_examples(curve: list[dict], level: float) -> float:
    """Trained examples at which ``curve`` (linear between evals) first reaches ``level``."""
    for a, b in zip(curve, curve[1:]):
        if b["target"] <= level:
            if a["target"] == b["target"]:
                return b["examples"]
            f = (a["target"] - level) / (a["target"] - b["target"])
            return a["examples"] + max(0.0, f) * (b["examples"] - a["examples"])
    return float("inf")


def se(xs: list[float]) -> float:
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def compare(runs: dict[str, list[dict]], name: str, steps: int) -> dict:
    """Paired statistics of variant ``name`` (trained ``steps`` steps) against ``random``
    (lists in seed order; random may be longer: its curve up to ``steps`` gives the
    equal-examples columns, all of it the equal-compute ones, ``_compute.equal_compute``)."""
    final, after, eff, gen, gcpu, grcpu, ratio, cpu, rcpu = ([] for _ in range(9))
    for r, v in zip(runs["random"], runs[name]):
        rc, vc = truncate(r["curve"], steps), v["curve"]
        final.append(rc[-1]["target"] - vc[-1]["target"])
        pts = [(a["target"] - b["target"]) for a, b in zip(rc, vc) if a["step"] > WARMUP_EVAL]
        after.append(statistics.mean(pts) if pts else float("nan"))
        eff.append(interp_examples(vc, rc[-1]["target"]) / rc[-1]["examples"])
        gen.append(vc[-1]["general"] - rc[-1]["general"])
        ec = equal_compute(r["curve"], vc, steps)
        gcpu.append(ec["gain_cpu"])
        grcpu.append(ec["gain_at_random_cpu"])
        ratio.append(ec["cpu_ratio"])
        cpu.append(ec["cpu"])
        rcpu.append(ec["random_cpu"])
    finite = [e for e in eff if math.isfinite(e)]
    g = [x for x in gcpu if math.isfinite(x)]
    rr = [x for x in ratio if math.isfinite(x)]
    gr = [x for x in grcpu if math.isfinite(x)]
    nan = float("nan")
    return {"n": len(final), "final": statistics.mean(final), "final_se": se(final),
            "after": statistics.mean(after), "after_se": se(after),
            "eff_median": statistics.median(eff) if eff else nan,
            "eff_reached": f"{len(finite)}/{len(eff)}",
            "general_cost": statistics.mean(gen), "general_cost_se": se(gen),
            "random_general": statistics.mean(truncate(r["curve"], steps)[-1]["general"]
                                              for r in runs["random"]),
            "wins": sum(f > 0 for f in final),
            "gain_cpu": statistics.mean(g) if g else nan, "gain_cpu_se": se(g),
            "gain_cpu_n": len(g), "wins_cpu": sum(x > 0 for x in g),
            "gain_rcpu": statistics.mean(gr) if gr else nan, "gain_rcpu_se": se(gr),
            "gain_rcpu_n": len(gr), "wins_rcpu": sum(x > 0 for x in gr),
            "cpu_ratio_median": statistics.median(ratio) if ratio else nan,
            "cpu_ratio": statistics.mean(rr) if rr else nan, "cpu_ratio_se": se(rr),
            "cpu_reached": f"{len(rr)}/{len(ratio)}",
            "cpu": statistics.mean(cpu) if cpu else nan,
            "random_cpu": statistics.mean(rcpu) if rcpu else nan,
            "random_steps": min(r["curve"][-1]["step"] for r in runs["random"])}


def fmt(name: str, c: dict) -> str:
    """The paired statistics of ``compare`` as text (the compute line only when the runs
    recorded CPU-seconds per evaluation)."""
    text = (f"  {name:<12} final gain {c['final']:+.4f} +- {c['final_se']:.4f} "
            f"(wins {c['wins']}/{c['n']}) | gain after warm-up {c['after']:+.4f} +- "
            f"{c['after_se']:.4f} | data efficiency median {c['eff_median']:.2f} "
            f"(reached {c['eff_reached']}) | general loss {c['general_cost']:+.4f} +- "
            f"{c['general_cost_se']:.4f} vs random's {c['random_general']:.4f}")
    if math.isnan(c["cpu"]):
        return text
    return text + (
            f"\n      equal compute: gain {c['gain_cpu']:+.4f} +- {c['gain_cpu_se']:.4f} "
            f"(wins {c['wins_cpu']}/{c['gain_cpu_n']}; random read at the variant's CPU-s, "
            f"its run {c['random_steps']} steps); at random's CPU-s {c['gain_rcpu']:+.4f} +- "
            f"{c['gain_rcpu_se']:.4f} (wins {c['wins_rcpu']}/{c['gain_rcpu_n']}; the variant "
            f"read there) | CPU-s to reach random's final loss / "
            f"random's: median {c['cpu_ratio_median']:.2f}, mean {c['cpu_ratio']:.2f} +- "
            f"{c['cpu_ratio_se']:.2f} (reached {c['cpu_reached']}) | training CPU-s "
            f"{c['cpu']:.0f} vs random {c['random_cpu']:.0f} ({c['cpu'] / c['random_cpu']:.2f}x)"
            f" at equal examples")


def details(runs: dict[str, list[dict]], name: str) -> str:
    """Diagnostics of ``name`` vs random: in-domain/source shares, junk share per kind
    (held-out kinds apart), per-source general loss at the end
    (variant - random, mean over seeds), score correlations (--diagnose-every)."""
    def mean_share(rs):
        keys = {k for r in rs for k in r["sources"]}
        return {k: statistics.mean(r["sources"].get(k, 0.0) for r in rs) for k in keys}

    share, rshare = mean_share(runs[name]), mean_share(runs["random"])
    top = sorted((k for k in share if not k.startswith(noisy.JUNK_PREFIX)),
                 key=lambda k: share[k] - rshare.get(k, 0.0), reverse=True)[:2]
    parts = ["most enriched: " + ", ".join(f"{k} {share[k]:.0%} (random {rshare.get(k, 0):.0%})"
                                            for k in top)]
    junk, rjunk = noisy.junk_shares(share), noisy.junk_shares(rshare)
    for label, kinds in (("junk", [k for k in junk if k not in noisy.HELDOUT_KINDS]),
                         ("held-out junk", [k for k in junk if k in noisy.HELDOUT_KINDS])):
        if kinds:
            parts.append(f"{label} {sum(junk[k] for k in kinds):.1%} (random "
                         f"{sum(rjunk.get(k, 0) for k in kinds):.1%}): " + ", ".join(
                             f"{k} {junk[k]:.1%}/{rjunk.get(k, 0):.1%}" for k in sorted(kinds)))
    pairs = [(truncate(r["curve"], v["curve"][-1]["step"])[-1].get("by_source"),
              v["curve"][-1].get("by_source")) for r, v in zip(runs["random"], runs[name])]
    if all(a and b for a, b in pairs):
        srcs = sorted(pairs[0][0])
        d = {k: statistics.mean(b[k] - a[k] for a, b in pairs) for k in srcs}
        parts.append("general loss by source vs random: " +
                     " ".join(f"{k} {v:+.3f}" for k, v in d.items()))
    diags = [x for r in runs[name] for x in r.get("diagnostics", [])]
    if diags and "rho_norm" in diags[0]:
        m = {k: statistics.mean(x[k] for x in diags)
             for k in ("rho_norm", "rho_loss", "norm_ratio", "loss_ratio")}
        parts.append(f"spearman(score, |g|) {m['rho_norm']:+.2f}, (score, loss) "
                     f"{m['rho_loss']:+.2f}; chosen/candidates |g| {m['norm_ratio']:.2f}, "
                     f"loss {m['loss_ratio']:.2f} ({len(diags)} micro-batches)")
    return " | ".join(parts)


def summarize(paths: list[str], markdown: bool = False) -> None:
    """Paired tables from ``--results`` files: per target and multiple, every variant (and
    step count) against random over the seeds both ran; random's run of a seed is its
    longest one with at least the variant's steps (a later record of the same run replaces
    an earlier one). ``markdown``: the same numbers as two markdown tables (equal data and
    compute; junk shares of the noisy pools)."""
    recs: dict[tuple, dict] = {}
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                recs[(r["target"], r["multiple"], r["variant"], r["steps"], r["seed"])] = r
    rows = []
    for target, mult in sorted({k[:2] for k in recs}, key=str):
        mine = {k[2:]: r for k, r in recs.items() if k[:2] == (target, mult)}
        arms = sorted({(n, st) for n, st, _ in mine if n != "random"}, key=str)
        longest: dict[int, dict] = {}
        for (n, st, seed), r in mine.items():
            if n == "random" and st >= longest.get(seed, {"steps": -1})["steps"]:
                longest[seed] = r
        if not longest:
            print(f"== {target} x{mult:g}: no random runs to pair with")
            continue
        if not markdown:
            print(f"== {target} x{mult:g} (random runs of "
                  f"{sorted({r['steps'] for r in longest.values()})} steps)")
        for name, steps in arms:
            seeds = sorted(s for (n, st, s) in mine if (n, st) == (name, steps)
                           and s in longest and longest[s]["steps"] >= steps)
            if not seeds:
                continue
            runs = {"random": [longest[s] for s in seeds],
                    name: [mine[(name, steps, s)] for s in seeds]}
            c = compare(runs, name, steps)
            rows.append((target, mult, name, steps, seeds, c, runs))
            if not markdown:
                print(fmt(f"{name}@{steps}", c) + f" | seeds {seeds}")
                print("      " + details(runs, name))
    if markdown:
        print(markdown_tables(rows))


def _pm(x: float, e: float, signed: bool = True) -> str:
    if math.isnan(x):
        return "-"
    v = f"{x:+.3f}" if signed else f"{x:.2f}"
    return v if math.isnan(e) else f"{v} +- {e:.3f}"


def markdown_tables(rows: list[tuple]) -> str:
    """The rows of ``summarize`` as markdown: equal data and compute; junk shares."""
    out = ["| target | mult | variant | steps | seeds | final gain (wins) | data eff. (median) "
           "| general loss vs random | CPU/run vs random | gain at equal CPU, random extended "
           "(wins) | gain at random's CPU (wins) | CPU to random's final loss / random's "
           "(median; reached) |", "|" + "---|" * 12]
    for target, mult, name, steps, seeds, c, _ in rows:
        out.append(
            f"| {target} | {mult:g}x | {name} | {steps} | {len(seeds)} | "
            f"{_pm(c['final'], c['final_se'])} ({c['wins']}/{c['n']}) | {c['eff_median']:.2f} | "
            f"{_pm(c['general_cost'], c['general_cost_se'])} | "
            f"{c['cpu'] / c['random_cpu']:.2f}x | "
            f"{_pm(c['gain_cpu'], c['gain_cpu_se'])} ({c['wins_cpu']}/{c['gain_cpu_n']}) | "
            f"{_pm(c['gain_rcpu'], c['gain_rcpu_se'])} ({c['wins_rcpu']}/{c['gain_rcpu_n']}) | "
            f"{c['cpu_ratio_median']:.2f}; {c['cpu_reached']} |")
    junk_rows = []
    for target, mult, name, steps, seeds, c, runs in rows:
        def shares(rs):
            keys = {k for r in rs for k in r["sources"]}
            return {k: statistics.mean(r["sources"].get(k, 0.0) for r in rs) for k in keys}
        share, rshare = shares(runs[name]), shares(runs["random"])
        junk, rjunk = noisy.junk_shares(share), noisy.junk_shares(rshare)
        if not junk and not rjunk:
            continue
        tune = sorted(k for k in set(junk) | set(rjunk) if k not in noisy.HELDOUT_KINDS)
        held = sorted(k for k in set(junk) | set(rjunk) if k in noisy.HELDOUT_KINDS)
        clean = sum(v for k, v in share.items() if k.endswith("_clean"))
        rclean = sum(v for k, v in rshare.items() if k.endswith("_clean"))
        junk_rows.append(
            f"| {target} | {mult:g}x | {name} | {len(seeds)} | "
            f"{sum(junk.get(k, 0) for k in tune):.1%} ({sum(rjunk.get(k, 0) for k in tune):.1%}) | "
            + ", ".join(f"{k} {junk.get(k, 0):.1%}" for k in tune) + " | "
            f"{sum(junk.get(k, 0) for k in held):.1%} ({sum(rjunk.get(k, 0) for k in held):.1%}) | "
            + ", ".join(f"{k} {junk.get(k, 0):.1%}" for k in held) +
            f" | {clean:.1%} ({rclean:.1%}) |")
    if junk_rows:
        out += ["", "| target | mult | variant | seeds | junk share, tuning kinds (random) | "
                "by kind | junk share, held-out kinds (random) | by kind | clean in-domain "
                "extra (random) |", "|" + "---|" * 9] + junk_rows
    return "\n".join(out)
