"""Hybrid of model-based attribution and text overlap: per-regime tables and the
leave-one-regime-out choice of the weight w.

Reads benchmarks/lds.py summaries run with ``--methods ekfac,ekfac-trajectory,tfidf
--hybrid-weights W`` (rows ``m+<w>*tfidf`` = per query z(m) + w z(tfidf), z standardized over
the training documents) and prints, per regime, each row's LDS and the paired differences
(mean over seeds ± s.e. of the per-seed differences) of every hybrid against its base
method and against tfidf, then the folds.

Rule, per base method m (ekfac-trajectory, ekfac): g_r(w) = mean over seeds of
LDS_r(m + w tfidf) - LDS_r(m), with paired s.e. s_r(w). Fold h: w*(h) = the w with the
highest mean of g_r(w) over the other regimes r != h. On h, w*(h) loses if
g_h(w*) < -s_h(w*) (more than one paired s.e. below the method), wins if g_h > s_h, else
ties. The hybrid is adopted only if no fold loses.

Also prints the default (ekfac-trajectory at the default power) against tfidf per regime
(paired; "> 2 s.e." is the goal of the suite).

Usage: python hybrid.py [--bases m1,m2 [--chosen m1=w1,m2=w2]] NAME=summary.json ...
(default bases ekfac-trajectory,ekfac with the weights their folds chose; the K-FAC run used
``--bases kfac-trajectory,kfac``.)
"""
from __future__ import annotations

import json
import math
import sys

BASES = ("ekfac-trajectory", "ekfac")
#: The weight every fold chose per base (printed by ``folds``; used by the compact table).
CHOSEN = {"ekfac-trajectory": 0.25, "ekfac": 0.5}


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def load(path: str) -> tuple[dict, dict]:
    """``({method: per-seed LDS}, summary)`` of the rows at the default power (0.8)."""
    s = json.load(open(path))
    rows = {r["method"]: r["per_seed"] for r in s["results"]
            if r["projection"] == "exact" and r.get("power") in (None, 0.8)}
    return rows, s


def weights(rows: dict, base: str) -> list[float]:
    pre = base + "+"
    return sorted(float(m[len(pre):-len("*tfidf")]) for m in rows
                  if m.startswith(pre) and m.endswith("*tfidf"))


def hybrid(base: str, w: float) -> str:
    return f"{base}+{w:g}*tfidf"


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    return mean_se([x - y for x, y in zip(a, b)])


def fmt(ms: tuple[float, float]) -> str:
    return f"{ms[0]:+.3f} ± {ms[1]:.3f}"


def tables(regimes: dict[str, dict], summaries: dict[str, dict]) -> None:
    ws = weights(next(iter(regimes.values())), BASES[0])
    print("LDS, mean ± s.e. over seeds (default power):")
    cols = ["tfidf", *reversed(BASES)] + [hybrid(b, w) for b in BASES for w in ws]
    print("| regime | seeds | agreement | " + " | ".join(cols) + " |\n|---|" + "---|" * (
        len(cols) + 2))
    for name, rows in regimes.items():
        head = summaries[name]["head"]
        agree = head.split("retrained losses ")[-1] if "agreement" in head else "-"
        print(f"| {name} | {len(rows['tfidf'])} | {agree} | " + " | ".join(
            fmt(mean_se(rows[c])).lstrip("+") for c in cols) + " |")
    for base in BASES:
        print(f"\n{base} + w tfidf: paired difference vs {base} / vs tfidf (mean ± s.e.):")
        print("| regime | " + " | ".join(f"w={w:g}" for w in ws) + " |\n|---|" + "---|" * len(ws))
        for name, rows in regimes.items():
            print(f"| {name} | " + " | ".join(
                f"{fmt(paired(rows[hybrid(base, w)], rows[base]))} / "
                f"{fmt(paired(rows[hybrid(base, w)], rows['tfidf']))}" for w in ws) + " |")


def folds(regimes: dict[str, dict]) -> None:
    names = list(regimes)
    for base in BASES:
        ws = weights(regimes[names[0]], base)
        gain = {r: {w: paired(regimes[r][hybrid(base, w)], regimes[r][base]) for w in ws}
                for r in names}
        print(f"\nfolds for {base} + w tfidf (w chosen on the others -> held-out gain, verdict):")
        cells, lost = [], []
        for h in names:
            rest = {w: sum(gain[r][w][0] for r in names if r != h) / (len(names) - 1)
                    for w in ws}
            w = max(rest, key=rest.get)
            g, se = gain[h][w]
            verdict = "win" if g > se else ("tie" if g >= -se else "LOSS")
            if verdict == "LOSS":
                lost.append(h)
            cells.append(f"{h}: w={w:g} (others {rest[w]:+.3f}; held out {g:+.3f} ± {se:.3f} "
                         f"{verdict})")
        print("  " + "\n  ".join(cells))
        print(f"  => {base}: " + ("passes (no held-out loss)" if not lost
                                  else f"does not pass: loses on {', '.join(lost)}"))
        means = {w: sum(gain[r][w][0] for r in names) / len(names) for w in ws}
        print("     mean gain over all regimes: " + ", ".join(
            f"w={w:g} {m:+.3f}" for w, m in means.items()))


def default_vs_tfidf(regimes: dict[str, dict]) -> None:
    print("\ndefault (ekfac-trajectory) - tfidf, paired (mean ± s.e.; > 2 s.e.?):")
    for name, rows in regimes.items():
        d, se = paired(rows["ekfac-trajectory"], rows["tfidf"])
        print(f"  {name}: {d:+.3f} ± {se:.3f} ({'yes' if d > 2 * se else 'no'}; "
              f"{sum(a > b for a, b in zip(rows['ekfac-trajectory'], rows['tfidf']))}"
              f"/{len(rows['tfidf'])} seeds above)")


def compact(regimes: dict[str, dict], summaries: dict[str, dict],
            chosen: dict[str, float]) -> None:
    """One line per regime: tfidf, each base and its hybrid at the chosen weight, the
    hybrid's paired gain over its base and over tfidf (``**`` = more than 2 s.e.)."""
    print("\ncompact table at the weights every fold chose " + ", ".join(
        f"{b} w={w:g}" for b, w in chosen.items()) + ":")
    cols = []
    for b, w in chosen.items():
        cols += [b, f"+{w:g} tfidf", "vs base", "vs tfidf"]
    print("| regime | seeds | agreement | tfidf | " + " | ".join(cols) + " |\n|---|"
          + "---|" * (len(cols) + 3))
    for name, rows in regimes.items():
        head = summaries[name]["head"]
        agree = head.split("retrained losses ")[-1].split(" ± ")[0] if "agreement" in head else "-"
        cells = [name, str(len(rows["tfidf"])), agree, f"{mean_se(rows['tfidf'])[0]:.3f}"]
        for b, w in chosen.items():
            h = rows[hybrid(b, w)]
            vt = paired(h, rows["tfidf"])
            cells += [f"{mean_se(rows[b])[0]:.3f}", f"{mean_se(h)[0]:.3f}",
                      fmt(paired(h, rows[b])),
                      fmt(vt) + (" **" if vt[0] > 2 * vt[1] else "")]
        print("| " + " | ".join(cells) + " |")


def read(argv: list[str], load_one) -> tuple[dict, dict]:
    """``NAME=summary.json`` arguments -> ``({name: rows}, {name: summary})`` by ``load_one``
    (also ../lds_damping_2026-12-03/damping.py's reader)."""
    regimes, summaries = {}, {}
    for arg in argv:
        name, _, path = arg.partition("=")
        regimes[name], summaries[name] = load_one(path)
    return regimes, summaries


def main(argv: list[str]) -> None:
    global BASES
    chosen = CHOSEN
    if argv[:1] == ["--bases"]:
        BASES, argv = tuple(argv[1].split(",")), argv[2:]
        chosen = {}
    if argv[:1] == ["--chosen"]:
        chosen = {b: float(w) for b, w in (x.split("=") for x in argv[1].split(","))}
        argv = argv[2:]
    regimes, summaries = read(argv, load)
    tables(regimes, summaries)
    folds(regimes)
    if "ekfac-trajectory" in BASES:
        default_vs_tfidf(regimes)
    if chosen:
        compact(regimes, summaries, chosen)


if __name__ == "__main__":
    main(sys.argv[1:])
