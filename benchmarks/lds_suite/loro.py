"""Leave-one-regime-out choice of the curvature power (0.8 vs 1) per method and family.

Reads benchmarks/lds.py summaries (``--powers 0.8,1.0 --repeats R``) and the paired differences
of regimes A-D, whose summaries predate the per-seed record (their paired change vs power 1
is quoted from docs/attribution_fidelity.md, where it was computed from the seeds).

Rule, per method m: d_r = mean over seeds of LDS_r(0.8) - LDS_r(1) in regime r, with its
paired s.e. s_r. Fold h: choose p*(h) = 0.8 if mean_{r != h} d_r > 0 else 1 (the power
with the higher mean LDS over the other regimes). On h, p*(h) does not lose if its paired
advantage (d_h for 0.8, -d_h for 1) is >= -s_h (within 1 paired s.e. either way: a tie).
A family (single-checkpoint: ekfac, kfac; trajectory: ekfac-trajectory, kfac-trajectory)
adopts a power only if every fold of both of its methods chooses it and it does not lose
on any held-out regime.

Usage: python benchmarks/lds_suite/loro.py NAME=summary.json [NAME=summary.json ...]
(regimes A-D enter the folds with their QUOTED d; give A=... to use a rerun's summary
instead). Prints the per-regime LDS table of the given summaries, the d table and the folds.
"""
from __future__ import annotations

import json
import math
import sys

#: (d ± s.e.) of 0.8 vs 1 per method, regimes A-D (docs/attribution_fidelity.md, 5 seeds).
QUOTED = {
    "A": {"ekfac-trajectory": (0.017, 0.007), "kfac-trajectory": (0.012, 0.012),
          "ekfac": (-0.011, 0.010), "kfac": (-0.011, 0.010)},
    "B": {"ekfac-trajectory": (0.021, 0.005), "kfac-trajectory": (0.017, 0.004),
          "ekfac": (0.003, 0.005), "kfac": (-0.001, 0.006)},
    "C": {"ekfac-trajectory": (0.021, 0.006), "kfac-trajectory": (0.008, 0.006),
          "ekfac": (-0.004, 0.005), "kfac": (-0.015, 0.011)},
    "D": {"ekfac-trajectory": (0.082, 0.012), "kfac-trajectory": (0.082, 0.013),
          "ekfac": (0.056, 0.015), "kfac": (0.048, 0.010)},
}
FAMILIES = {"single-checkpoint": ("ekfac", "kfac"),
            "trajectory": ("ekfac-trajectory", "kfac-trajectory")}


def paired(path: str) -> dict[str, tuple[float, float]]:
    """``{method: (mean d, paired s.e.)}`` from a summary with per-seed LDS."""
    rows = json.load(open(path))["results"]
    by = {(r["method"], float(r["power"])): r["per_seed"] for r in rows if r.get("power")}
    out = {}
    for m in {k[0] for k in by}:
        d = [a - b for a, b in zip(by[(m, 0.8)], by[(m, 1.0)])]
        mean = sum(d) / len(d)
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
        out[m] = (mean, sd / math.sqrt(len(d)))
    return out


METHODS = ("ekfac", "kfac", "ekfac-trajectory", "kfac-trajectory")


def lds_table(summaries: dict[str, str]) -> None:
    """Per regime: LDS mean ± s.e. per method at powers 0.8 / 1, tfidf, seeds, agreement."""
    print("| regime | seeds | seed agreement | tfidf | " + " | ".join(
        f"{m} 0.8 / 1" for m in METHODS) + " |\n|---|" + "---|" * (4 + len(METHODS)))
    for name, path in summaries.items():
        s = json.load(open(path))
        rows = {(r["method"], r.get("power") and float(r["power"])): r for r in s["results"]}
        cell = lambda r: f"{r['lds_mean']:.3f} ± {r['lds_se']:.3f}"
        agree = s["head"].split("retrained losses ")[-1] if "agreement" in s["head"] else "-"
        print(f"| {name} | {len(s['seeds'])} | {agree} | {cell(rows[('tfidf', None)])} | "
              + " | ".join(f"{cell(rows[(m, 0.8)])} / {cell(rows[(m, 1.0)])}" for m in METHODS)
              + " |")


def main(argv: list[str]) -> None:
    regimes = dict(QUOTED)
    summaries = {}
    for arg in argv:
        name, _, path = arg.partition("=")
        regimes[name] = paired(path)
        summaries[name] = path
    lds_table(summaries)
    print()
    names = list(regimes)
    print("d = LDS(0.8) - LDS(1), mean ± paired s.e.:")
    print("| method | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for fam, methods in FAMILIES.items():
        for m in methods:
            print(f"| {m} | " + " | ".join(f"{regimes[r][m][0]:+.3f} ± {regimes[r][m][1]:.3f}"
                                          for r in names) + " |")
    print("\nfolds (chosen on the others -> held-out advantage of the choice, verdict):")
    for fam, methods in FAMILIES.items():
        choices, ok = set(), True
        for m in methods:
            cells = []
            for h in names:
                rest = [regimes[r][m][0] for r in names if r != h]
                p = 0.8 if sum(rest) / len(rest) > 0 else 1.0
                d, se = regimes[h][m]
                adv = d if p == 0.8 else -d
                verdict = "win" if adv > se else ("tie" if adv >= -se else "LOSS")
                ok &= verdict != "LOSS"
                choices.add(p)
                cells.append(f"{h}: {p:g} ({adv:+.3f} ± {se:.3f} {verdict})")
            print(f"  {m}: " + "; ".join(cells))
        adopt = f"power {choices.pop():g}" if len(choices) == 1 and ok else "no power passes"
        print(f"  => {fam}: {adopt}")
        for m in methods:
            d = {r: regimes[r][m][0] for r in names}
            lo8, lo1 = min(d, key=d.get), max(d, key=d.get)
            print(f"     {m}: worst regime for 0.8 {lo8} ({d[lo8]:+.3f}), for 1 {lo1} "
                  f"({-d[lo1]:+.3f}); mean d over all {sum(d.values()) / len(d):+.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
