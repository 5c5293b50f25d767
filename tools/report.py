"""Report an attribution: per query, the top proponents and opponents as text, with plots.

    python tools/report.py --attribution runs/main/attr-ekfac --train-data data/corpus/train.jsonl

Writes ``report.md`` and ``report.html`` next to the attribution, plus ``scores_hist.png``
(score distribution per query) and, for TracIn, ``tracin_checkpoints.png`` (each
checkpoint's lr-weighted contribution to the top proponents' scores).
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from dattri_ds.schema import add_flag  # noqa: E402
from dattri_ds.tools.common import logger, setup_logging  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds report", description=__doc__.splitlines()[0])
    p.add_argument("--attribution", required=True, help="output folder of tools/attribute.py")
    p.add_argument("--train-data", default="data/corpus/train.jsonl",
                   help="jsonl holding the training texts (ids before '#' in store ids)")
    add_flag(p, "--top-k", int, ge=1, default=5)
    add_flag(p, "--chars", int, ge=1,
             default=300, help="characters of text shown")
    return p


def _docs(path: str) -> dict[str, dict]:
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            out[d["id"]] = d
    return out


def _plots(att: Path, scores: np.ndarray, queries: list[dict], top: list[dict],
           train_ids: list[str]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    for j, q in enumerate(queries):
        ax.hist(scores[:, j], bins=40, histtype="step", label=q["id"])
    ax.set_xlabel("attribution score (positive = helps the query)")
    ax.set_ylabel("training examples")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(att / "scores_hist.png")
    plt.close(fig)
    made.append("scores_hist.png")
    per = att / "per_checkpoint.npy"
    if per.exists():
        contrib = np.load(per)  # [C, N, Q]
        summary = json.loads((att / "summary.json").read_text())
        index = {t: i for i, t in enumerate(train_ids)}
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
        rows = [index[p["id"]] for p in top[0]["proponents"][:5]]
        bottom = np.zeros(len(rows))
        for c, tag in enumerate(summary["checkpoints"]):
            vals = contrib[c, rows, 0]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=tag)
            bottom += vals
        ax.set_xticks(range(len(rows)), [train_ids[r].split("#")[0] for r in rows],
                      rotation=20, fontsize=7)
        ax.set_ylabel("lr-weighted contribution")
        ax.set_title(f"TracIn: top proponents of {queries[0]['id']} by checkpoint", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(att / "tracin_checkpoints.png")
        plt.close(fig)
        made.append("tracin_checkpoints.png")
    return made


def _entry(e: dict, docs: dict[str, dict], chars: int) -> tuple[str, str, str, float]:
    doc_id = e["id"].split("#")[0].split("@")[0]
    d = docs.get(doc_id, {})
    text = " ".join(d.get("text", "(text not found)").split())[:chars]
    return doc_id, d.get("source", "?"), text, e["score"]


def _token_view(att: Path, train_ids: list[str]):
    """(per-token scores [N, Q, T], query tokens, train id -> row), or None without them."""
    if not (att / "per_token.npy").exists():
        return None
    return (np.load(att / "per_token.npy"), json.loads((att / "query_tokens.json").read_text()),
            {i: n for n, i in enumerate(train_ids)})


def _coloured_tokens(view, j: int, train_id: str) -> str:
    """Query j's tokens coloured by their influence score under one training example
    (green: training on it lowers that token's loss, red: raises it; opacity ~ |score|)."""
    scores, tokens, row = view
    s = scores[row[train_id], j]
    scale = float(np.abs(s).max()) or 1.0
    spans = []
    for tok in tokens[j]:
        v = float(s[tok["t"]])
        rgb = "0,160,0" if v >= 0 else "200,0,0"
        spans.append(f'<span title="{v:.4g}" style="background:rgba({rgb},'
                     f'{abs(v) / scale:.3f})">{html.escape(tok["text"])}</span>')
    return (f"<p>Tokens by influence of the top proponent <code>{html.escape(train_id)}</code>"
            f" (hover for the score):</p><p class=tokens>{''.join(spans)}</p>")


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    setup_logging()
    att = Path(args.attribution)
    summary = json.loads((att / "summary.json").read_text())
    queries = json.loads((att / "queries.json").read_text())
    top = json.loads((att / "topk.json").read_text())
    train_ids = json.loads((att / "train_ids.json").read_text())
    scores = np.load(att / "scores.npy")
    docs = _docs(args.train_data)
    plots = _plots(att, scores, queries, top, train_ids)
    md = [f"# Attribution report ({summary['method']})", "",
          f"{summary['train']} training examples x {summary['queries']} queries, checkpoints "
          f"{', '.join(summary['checkpoints'])}; score > 0: training on the example lowers the "
          f"query's loss.", ""]
    body = [f"<h1>Attribution report ({html.escape(summary['method'])})</h1>",
            f"<p>{md[2]}</p>"]
    tokens = _token_view(att, train_ids)
    for j, (q, t) in enumerate(zip(queries, top)):
        qtext = " ".join(q["text"].split())[:args.chars]
        md += [f"## Query `{q['id']}` ({q['source']})", "", f"> {qtext}", ""]
        body += [f"<h2>Query {html.escape(q['id'])}</h2>", f"<blockquote>{html.escape(qtext)}"
                 f"</blockquote>"]
        if tokens is not None:
            body.append(_coloured_tokens(tokens, j, t["proponents"][0]["id"]))
        for label, key in (("Top proponents", "proponents"), ("Top opponents", "opponents")):
            md += [f"**{label}**", "", "| score | id | source | text |", "|---:|---|---|---|"]
            body += [f"<h3>{label}</h3><table><tr><th>score</th><th>id</th><th>source</th>"
                     f"<th>text</th></tr>"]
            for e in t[key][:args.top_k]:
                doc_id, src, text, score = _entry(e, docs, args.chars)
                md.append(f"| {score:.4g} | {doc_id} | {src} | {text.replace('|', '/')} |")
                body.append(f"<tr><td>{score:.4g}</td><td>{html.escape(doc_id)}</td><td>"
                            f"{html.escape(src)}</td><td>{html.escape(text)}</td></tr>")
            md.append("")
            body.append("</table>")
    md += [f"![{p}]({p})" for p in plots]
    body += [f'<img src="{p}">' for p in plots]
    (att / "report.md").write_text("\n".join(md) + "\n")
    (att / "report.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>dattri-ds report</title><style>body{font:"
        "14px sans-serif;max-width:60em;margin:auto}td{vertical-align:top;border-top:1px solid"
        " #ddd;padding:4px}.tokens{white-space:pre-wrap;font-family:monospace}</style>" + "\n".join(body))
    logger.info("report -> %s", att / "report.md")
    return att / "report.md"


if __name__ == "__main__":
    from dattri_ds.cli import run

    sys.exit(run(main))
