"""The fidelity-cost frontier: LDS against CPU seconds and bytes per row, ours and the peers'.

Reads a regime's summary over seeds written by ``benchmarks/lds.py --repeats R`` (``<dir>/
lds.json``) and the peers' points scored on the same ground truth by
``benchmarks/lds_peers.py`` (``<dir>/peers.json``, optional), prints a markdown table
(every row: LDS mean +- s.e. over seeds, CPU s, bytes per row, on our frontier or not,
paired LDS difference to the best of ours at no more CPU for each peer) and draws a PNG
with two panels (LDS vs CPU s, LDS vs bytes per row, log x). Our frontier: the rows no other
row of ours beats (higher mean LDS) at no more CPU seconds. Each peer is compared (paired
over seeds) with our EK-FAC in the same space (``exact``, ``logra:k``) and with the best
of our rows at no more CPU seconds, model-only (no text overlap) and any. Usage::

    python benchmarks/lds_frontier.py runs/frontier/A --png docs/img/frontier_A.png \\
        --title "Regime A"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: Marker per projection family of our rows.
MARKERS = {"exact": "o", "logra": "s", "whitened": "^", "plain": "x"}
COLORS = {"graddot": "tab:gray", "tracin": "tab:brown", "kfac": "tab:cyan",
          "ekfac": "tab:blue", "kfac-trajectory": "tab:olive",
          "ekfac-trajectory": "tab:green", "tfidf": "black"}


def family(projection: str) -> str:
    if projection == "exact":
        return "exact"
    if projection.startswith("logra"):
        return "logra"
    return "whitened" if projection.startswith("whitened") else "plain"


def load(folder: Path) -> tuple[list[dict], list[dict]]:
    ours = json.loads((folder / "lds.json").read_text())["results"]
    peers_file = folder / "peers.json"
    peers = json.loads(peers_file.read_text())["results"] if peers_file.is_file() else []
    return ours, peers


def our_frontier(rows: list[dict], key: str = "time_s") -> list[dict]:
    """Our rows no other row of ours beats (higher mean LDS) at no more ``key`` (CPU
    seconds, or bytes per row)."""
    rows = [r for r in rows if r.get(key)]
    keep = [r for r in rows if not any(o is not r and o[key] <= r[key]
                                       and o["lds_mean"] > r["lds_mean"] for o in rows)]
    return sorted(keep, key=lambda r: r[key])


def model_only(r: dict) -> bool:
    """A row that reads only the model (no text-overlap baseline or prior)."""
    return "tfidf" not in r["method"]


def paired_gap(peer: dict, ours: list[dict]) -> tuple[dict | None, float, float]:
    """The best of ``ours`` at no more CPU seconds than ``peer``, and the paired LDS
    difference (ours - peer, mean and s.e. over the shared seeds)."""
    cheaper = [r for r in ours if r["time_s"] <= peer["time_s"]]
    if not cheaper:
        return None, float("nan"), float("nan")
    return paired(max(cheaper, key=lambda r: r["lds_mean"]), peer)


def paired(best: dict, peer: dict) -> tuple[dict, float, float]:
    d = [a - b for a, b in zip(best["per_seed"], peer["per_seed"])]
    m = sum(d) / len(d)
    se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5 if len(d) > 1 else 0.0
    return best, m, se


def name(r: dict) -> str:
    return f"{r['method']} {r['projection']}"


def table(ours: list[dict], peers: list[dict]) -> str:
    front = {id(r) for r in our_frontier(ours)}
    lines = ["| | method | projection | LDS (mean ± s.e.) | CPU s | bytes/row | note |",
             "|---|---|---|---|---|---|---|"]
    same = {(r["method"], r["projection"]): r for r in ours}
    for r in sorted(ours, key=lambda r: r["time_s"]):
        note = ("**frontier**" if id(r) in front else "") + (" default" if r.get("default")
                                                             else "")
        lines.append(f"| ours | {r['method']} | {r['projection']} | {r['lds_mean']:+.3f} ± "
                     f"{r['lds_se']:.3f} | {r['time_s']:.2f} | {r.get('bytes_per_row') or '-'} "
                     f"| {note.strip()} |")
    for p in sorted(peers, key=lambda r: r["time_s"]):
        notes = []
        twin = same.get(("ekfac", p["projection"]))  # our EK-FAC in the same space
        if twin is not None:
            _, m, se = paired(twin, p)
            notes.append(f"ours ekfac {p['projection']}: {m:+.3f} ± {se:.3f} at "
                         f"{twin['time_s'] / p['time_s']:.2f}x its CPU")
        for label, pool in (("model-only", [r for r in ours if model_only(r)]),
                            ("any", ours)):
            best, m, se = paired_gap(p, pool)
            if best is not None:
                notes.append(f"best of ours ({label}) at <= its CPU: {name(best)} "
                             f"{m:+.3f} ± {se:.3f}")
        note = "; ".join(notes) or "-"
        lines.append(f"| peer | {p['method']} | {p['projection']} | {p['lds_mean']:+.3f} ± "
                     f"{p['lds_se']:.3f} | {p['time_s']:.2f} | {p['bytes_per_row']} | {note} |")
    return "\n".join(lines)


def plot(ours: list[dict], peers: list[dict], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharey=True)
    for ax, key, label in ((axes[0], "time_s", "CPU seconds (fit + gradients + scores, 1 thread)"),
                           (axes[1], "bytes_per_row", "fp32 bytes per stored training row")):
        pts = [r for r in ours if r.get(key)]
        for r in pts:
            base = r["method"].split("+")[0]
            hybrid = "+" in r["method"]
            ax.errorbar(r[key], r["lds_mean"], yerr=r["lds_se"], fmt=MARKERS[family(
                r["projection"])], color=COLORS.get(base, "tab:purple"), ms=7 if hybrid else 6,
                mfc="none" if hybrid else None, alpha=0.85, capsize=2, lw=0.8)
            if r.get("default"):
                ax.plot(r[key], r["lds_mean"], "*", color="gold", ms=18, mec="k", zorder=5)
        if pts:
            f = our_frontier(pts, key)
            ax.step([r[key] for r in f], [r["lds_mean"] for r in f], where="post",
                    color="tab:green", lw=1.2, alpha=0.6, label="our frontier")
        for p in peers:
            if p.get(key):
                ax.errorbar(p[key], p["lds_mean"], yerr=p["lds_se"], fmt="D", color="tab:red",
                            ms=7, capsize=2, lw=0.8)
                ax.annotate(f"{p['method']} {p['projection']}", (p[key], p["lds_mean"]),
                            fontsize=7, color="tab:red", xytext=(4, -10),
                            textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("LDS (mean ± s.e. over seeds)")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker="o", color=c, label=m) for m, c in COLORS.items()]
    handles += [Line2D([], [], ls="", marker=mk, color="k", mfc="none", label=f"{f} rows")
                for f, mk in MARKERS.items()]
    handles += [Line2D([], [], ls="", marker="D", color="tab:red", label="peers"),
                Line2D([], [], ls="", marker="*", color="gold", mec="k", ms=12,
                       label="default (attribute)"),
                Line2D([], [], color="tab:green", label="our frontier")]
    axes[1].legend(handles=handles, fontsize=7, loc="lower right", ncol=2)
    fig.suptitle(title + " (open markers: + tfidf text prior)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a benchmarks/lds.py --repeats output folder")
    p.add_argument("--png", default=None, help="write the plot here")
    p.add_argument("--title", default="LDS against cost")
    args = p.parse_args()
    ours, peers = load(Path(args.folder))
    print(table(ours, peers))
    if args.png:
        plot(ours, peers, Path(args.png), args.title)


if __name__ == "__main__":
    main()
