"""Writer: a curation's output folder (``OUTPUTS``: subset.jsonl, scores.npy, ids.json,
config.json, report.md / .html; the subset in the pool data's own format too: a prepared
prefix ``subset`` for prepared data; formats: docs/curation.md, "Outputs")."""

from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path

import numpy as np

from dattri_ds.sample_id import SampleId
from dattri_ds.selection.curate.pool import Pool

__all__ = ["OUTPUTS", "write_outputs"]

#: Files a curation writes (an existing one is refused without --force).
OUTPUTS = ("subset.jsonl", "scores.npy", "ids.json", "config.json", "report.md",
           "report.html", "score_hist.png")


def write_outputs(out: Path, *, pool: Pool, scores: np.ndarray, chosen: np.ndarray,
                  resolved: dict, with_text: bool, examples_shown: int = 5) -> dict:
    """Write the folder (module docstring); returns the summary recorded in config.json."""
    out.mkdir(parents=True, exist_ok=True)
    shown = list(chosen[:examples_shown]) + _bottom(scores, examples_shown)
    rows = (set(chosen.tolist()) if with_text else set()) | {int(x) for x in shown}
    docs = pool.texts.documents(sorted(rows))
    with open(out / "subset.jsonl", "w", encoding="utf-8") as f:
        for k, r in enumerate(chosen.tolist()):
            line = {"id": SampleId.parse(pool.ids[r]).doc, "sample_id": pool.ids[r],
                    "source": pool.source_names[pool.sources[r]], "score": float(scores[r]),
                    "rank": k}
            if with_text:
                line.update(docs[r])
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    np.save(out / "scores.npy", np.asarray(scores, dtype=np.float64))
    (out / "ids.json").write_text(json.dumps(list(pool.ids)) + "\n")
    summary = _summary(pool, scores, chosen)
    summary["subset_files"] = pool.texts.write_subset(out, chosen)
    (out / "config.json").write_text(json.dumps({**resolved, "result": summary}, indent=1,
                                                default=str) + "\n")
    plot = _plot(out, scores, chosen)
    md = _report(pool, scores, chosen, summary, docs, resolved, examples_shown)
    (out / "report.md").write_text(md, encoding="utf-8")
    (out / "report.html").write_text(_html(md, plot), encoding="utf-8")
    return summary


def _bottom(scores: np.ndarray, k: int) -> list[int]:
    return [int(i) for i in np.argsort(scores, kind="stable")[:k]]


def _summary(pool: Pool, scores: np.ndarray, chosen: np.ndarray) -> dict:
    names = pool.source_names
    pool_src = Counter(names[s] for s in pool.sources.tolist())
    sub_src = Counter(names[pool.sources[r]] for r in chosen.tolist())
    return {"pool_rows": len(pool), "kept_rows": int(len(chosen)),
            "kept_tokens": int(pool.tokens[chosen].sum()) if len(chosen) else 0,
            "pool_tokens": int(pool.tokens.sum()),
            "pool_sources": dict(sorted(pool_src.items())),
            "kept_sources": dict(sorted(sub_src.items())),
            "score_mean_kept": float(scores[chosen].mean()) if len(chosen) else None,
            "score_mean_pool": float(scores.mean())}


def _histogram(scores: np.ndarray, chosen: np.ndarray, bins: int = 10) -> list[str]:
    edges = np.linspace(scores.min(), scores.max() + 1e-12, bins + 1)
    allc, _ = np.histogram(scores, edges)
    kept, _ = np.histogram(scores[chosen], edges)
    top = max(1, int(allc.max()))
    return [f"| {edges[i]:+.4f} .. {edges[i + 1]:+.4f} | {allc[i]} | {kept[i]} | "
            f"{'#' * int(round(20 * allc[i] / top))} |" for i in range(bins)]


def _budget_text(budget: dict) -> str:
    """``{"kind": "examples", "amount": 20}`` -> ``20 examples``."""
    return f"{budget['amount']} {budget['kind']}"


def _report(pool, scores, chosen, summary, docs, resolved, k) -> str:
    cfg = resolved["config"]
    lines = [f"# Curated subset: {cfg['method']}", "",
             f"Kept {summary['kept_rows']} of {summary['pool_rows']} rows "
             f"({summary['kept_tokens']} of {summary['pool_tokens']} tokens); budget "
             f"{_budget_text(resolved['budget'])}; seed {cfg['seed']}.", "",
             "## Score distribution (pool, kept)", "", "| bin | pool | kept | |",
             "|---|---|---|---|", *_histogram(scores, chosen), "",
             "## Per-source shares", "", "| source | pool | pool share | kept | kept share |",
             "|---|---|---|---|---|"]
    for s, n in summary["pool_sources"].items():
        m = summary["kept_sources"].get(s, 0)
        lines.append(f"| {s} | {n} | {n / max(1, summary['pool_rows']):.1%} | {m} | "
                     f"{m / max(1, summary['kept_rows']):.1%} |")
    for title, rows in (("Top", list(chosen[:k])), ("Bottom of the pool", _bottom(scores, k))):
        lines += ["", f"## {title} examples", "", "| score | id | source | text |",
                  "|---|---|---|---|"]
        for r in rows:
            d = docs.get(int(r), {})
            text = " ".join(d.get("text", "")[:160].split()).replace("|", "\\|")
            lines.append(f"| {scores[r]:+.4f} | {pool.ids[r]} | "
                         f"{pool.source_names[pool.sources[r]]} | {text} |")
    return "\n".join(lines) + "\n"


def _plot(out: Path, scores: np.ndarray, chosen: np.ndarray) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.hist(scores, bins=40, histtype="step", label="pool")
    ax.hist(scores[chosen], bins=40, histtype="stepfilled", alpha=0.4, label="kept")
    ax.set_xlabel("curation score")
    ax.set_ylabel("rows")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "score_hist.png")
    plt.close(fig)
    return "score_hist.png"


def _html(md: str, plot: str | None) -> str:
    body, table = [], False
    for line in md.splitlines():
        if table and not line.startswith("|"):
            body.append("</table>")
            table = False
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
            if line.startswith("## Score") and plot:
                body.append(f'<img src="{plot}" alt="score distribution">')
        elif line.startswith("|---"):
            continue
        elif line.startswith("|"):
            if not table:
                body.append("<table>")
                table = True
            cells = [html.escape(c.strip()) for c in line.strip("|").split(" | ")]
            body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    if table:
        body.append("</table>")
    text = "\n".join(body)
    return f"<!doctype html><meta charset='utf-8'><title>curation report</title>\n{text}\n"
