"""Damping of the EK-FAC methods, leave one regime out; and the projected default's share.

Reads benchmarks/lds.py summaries run with ``--projections exact,whitened-sparse:4096 --powers 0.8
--dampings 0.003,0.001,0.01,0.03 --methods ekfac,ekfac-trajectory,tfidf --hybrid-weights
0.25,0.5`` (dampings relative to the mean eigenvalue per layer; 0.003 = KFACConfig.damping,
the default) and prints, per regime, each method's LDS at every damping (mean ± s.e. over
seeds) and the paired gain of each damping over 0.003, then the folds, then the projected
default's share of exact.

Rule (the power's, ``loro.py``), per method m (``METHODS``):
g_r(d) = mean over seeds of LDS_r(m, d) - LDS_r(m, 0.003), with paired s.e. s_r(d)
(g_r(0.003) = 0). Fold h: d*(h) = the damping with the highest mean of g_r(d) over the other
regimes r != h (0.003 when no other damping has a positive mean gain). On h, a non-default
d* loses if g_h(d*) < -s_h(d*) (more than one paired s.e. below the default), wins if
g_h > s_h, else ties. A non-default damping is adopted for m only if every fold chooses it
and it loses on no held-out regime.

Projected share: per regime, mean LDS of ekfac-trajectory on whitened-sparse:4096 (damping
0.003, power 0.8) over its mean exact LDS at the same damping and power (goal >= 90%), with
the paired difference projected - exact.

Usage: python damping.py NAME=summary.json [NAME=summary.json ...]
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid import read  # noqa: E402  (the NAME=summary.json reader)

#: The two EK-FAC methods alone, and with the text prior at the weights ``attribute`` ships
#: (Attributor.text_weight: z(m) + w z(tfidf), 0.25 trajectory, 0.5 single checkpoint).
METHODS = ("ekfac-trajectory", "ekfac", "ekfac-trajectory+0.25*tfidf", "ekfac+0.5*tfidf")
DEFAULT = 0.003
PROJECTED = "whitened-sparse:4096"


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    return mean_se([x - y for x, y in zip(a, b)])


def fmt(ms: tuple[float, float], sign: bool = True) -> str:
    return (f"{ms[0]:+.3f}" if sign else f"{ms[0]:.3f}") + f" ± {ms[1]:.3f}"


def load(path: str) -> tuple[dict, dict]:
    """``({(method, projection, damping): per-seed LDS}, summary)`` at power 0.8 (or None)."""
    s = json.load(open(path))
    rows = {(r["method"], r["projection"], r["damping"]): r["per_seed"] for r in s["results"]
            if r.get("power") in (None, 0.8)}
    return rows, s


def dampings(rows: dict) -> list[float]:
    return sorted({d for (m, p, d) in rows if p == "exact" and d is not None})


def agreement(summary: dict) -> str:
    head = summary.get("head", "")
    return head.split("retrained losses ")[-1].split(" ± ")[0] if "agreement" in head else "-"


def tables(regimes: dict, summaries: dict) -> None:
    ds = dampings(next(iter(regimes.values())))
    for m in METHODS:
        print(f"\n{m} (exact, power 0.8): LDS mean ± s.e. over seeds at each damping; "
              f"paired gain over {DEFAULT:g} (mean ± s.e.)")
        print("| regime | seeds | agreement | tfidf | " + " | ".join(f"d={d:g}" for d in ds)
              + " | " + " | ".join(f"d={d:g} - {DEFAULT:g}" for d in ds if d != DEFAULT)
              + " | best |\n|---|" + "---|" * (3 + 2 * len(ds)))
        for name, rows in regimes.items():
            base = rows[(m, "exact", DEFAULT)]
            means = {d: mean_se(rows[(m, "exact", d)])[0] for d in ds}
            best = max(means, key=means.get)
            print(f"| {name} | {len(base)} | {agreement(summaries[name])} | "
                  f"{mean_se(rows[('tfidf', 'exact', None)])[0]:.3f} | "
                  + " | ".join(fmt(mean_se(rows[(m, 'exact', d)]), False) for d in ds) + " | "
                  + " | ".join(fmt(paired(rows[(m, "exact", d)], base)) for d in ds
                               if d != DEFAULT) + f" | {best:g} |")


def folds(regimes: dict) -> None:
    names = list(regimes)
    ds = dampings(regimes[names[0]])
    for m in METHODS:
        gain = {r: {d: paired(regimes[r][(m, "exact", d)], regimes[r][(m, "exact", DEFAULT)])
                    for d in ds} for r in names}
        print(f"\nfolds for {m} (damping chosen on the other {len(names) - 1} regimes -> "
              "held-out gain over the default, verdict):")
        chosen, lost = set(), []
        for h in names:
            rest = {d: sum(gain[r][d][0] for r in names if r != h) / (len(names) - 1)
                    for d in ds}
            d = max(rest, key=rest.get)
            chosen.add(d)
            g, se = gain[h][d]
            verdict = ("default" if d == DEFAULT else
                       "win" if g > se else ("tie" if g >= -se else "LOSS"))
            if verdict == "LOSS":
                lost.append(h)
            print(f"  {h}: d={d:g} (others " + ", ".join(
                f"{x:g} {v:+.4f}" for x, v in rest.items() if x != DEFAULT)
                + f"; held out {g:+.3f} ± {se:.3f} {verdict})")
        if chosen == {DEFAULT}:
            out = f"every fold keeps the default {DEFAULT:g}"
        elif len(chosen) == 1 and not lost:
            out = f"passes: every fold chooses {chosen.pop():g}, no held-out loss"
        else:
            out = ("does not pass: folds choose " + ", ".join(f"{d:g}" for d in sorted(chosen))
                   + (f"; loses on {', '.join(lost)}" if lost else ""))
        print(f"  => {m}: {out}")
        means = {d: sum(gain[r][d][0] for r in names) / len(names) for d in ds}
        print("     mean gain over all regimes: " + ", ".join(
            f"d={d:g} {v:+.4f}" for d, v in means.items()))
        wins = {d: sum(gain[r][d][0] > gain[r][d][1] for r in names) for d in ds if d != DEFAULT}
        losses = {d: sum(gain[r][d][0] < -gain[r][d][1] for r in names) for d in ds
                  if d != DEFAULT}
        print("     regimes won / lost by more than one paired s.e.: " + ", ".join(
            f"d={d:g} {wins[d]}/{losses[d]}" for d in wins))


def projected(regimes: dict, m: str = "ekfac-trajectory") -> None:
    print(f"\nprojected default: {m} on {PROJECTED} (damping {DEFAULT:g}, power 0.8) vs exact")
    print("| regime | exact | projected | share of exact | projected - exact (paired) | "
          ">= 90% |\n|---|---|---|---|---|---|")
    missing = []
    for name, rows in regimes.items():
        key = (m, PROJECTED, DEFAULT)
        if key not in rows:
            missing.append(name)
            continue
        ex, pr = rows[(m, "exact", DEFAULT)], rows[key]
        share = mean_se(pr)[0] / mean_se(ex)[0]
        print(f"| {name} | {fmt(mean_se(ex), False)} | {fmt(mean_se(pr), False)} | "
              f"{100 * share:.1f}% | {fmt(paired(pr, ex))} | {'yes' if share >= 0.9 else 'NO'} |")
    if missing:
        print("  not measured on: " + ", ".join(missing))


def compact(regimes: dict, summaries: dict) -> None:
    """One line per regime (the docs' table): LDS means of the two EK-FAC methods at each
    damping, the best damping (``*`` = its gain over 0.003 exceeds one paired s.e.), and the
    projected default's share of exact."""
    ds = dampings(next(iter(regimes.values())))
    print("\ncompact table (LDS means at d = " + " / ".join(f"{d:g}" for d in ds)
          + "; best, * = gain over 0.003 > 1 paired s.e.; projected share):")
    print("| regime | seeds | agreement | tfidf | ekfac-trajectory | best | ekfac | best | "
          f"{PROJECTED} share |\n|---|---|---|---|---|---|---|---|---|")
    for name, rows in regimes.items():
        cells = [name, str(len(rows[("tfidf", "exact", None)])), agreement(summaries[name]),
                 f"{mean_se(rows[('tfidf', 'exact', None)])[0]:.3f}"]
        for m in METHODS[:2]:
            means = {d: mean_se(rows[(m, "exact", d)])[0] for d in ds}
            best = max(means, key=means.get)
            g, se = paired(rows[(m, "exact", best)], rows[(m, "exact", DEFAULT)])
            cells += [" / ".join(f"{means[d]:.3f}" for d in ds),
                      f"{best:g}" + (f" ({g:+.3f}*)" if best != DEFAULT and g > se else "")]
        key = ("ekfac-trajectory", PROJECTED, DEFAULT)
        cells.append(f"{100 * mean_se(rows[key])[0] / means_default(rows):.1f}%"
                     if key in rows else "-")
        print("| " + " | ".join(cells) + " |")


def means_default(rows: dict) -> float:
    return mean_se(rows[("ekfac-trajectory", "exact", DEFAULT)])[0]


def main(argv: list[str]) -> None:
    regimes, summaries = read(argv, load)
    tables(regimes, summaries)
    folds(regimes)
    projected(regimes)
    projected(regimes, "ekfac")
    compact(regimes, summaries)


if __name__ == "__main__":
    main(sys.argv[1:])
