"""Report an attribution: per query, the top proponents and opponents as text, with plots.

    python tools/report.py --attribution runs/main/attr-ekfac --train-data data/corpus/train.jsonl

Writes ``report.md`` and ``report.html`` next to the attribution, plus ``scores_hist.png``
(score distribution per query) and, for trajectories (TracIn, the EK-FAC trajectory),
``tracin_checkpoints.png`` (titled by the method; each checkpoint's weighted contribution
to the top proponents' scores). Without ``--train-data`` (jsonl) or ``--data-path``
(prepared data: a row's text is its window's tokens decoded) the training texts are the data
attribute or collect recorded.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from dattri_ds.cli import exits as cli  # noqa: E402
from dattri_ds.io import files  # noqa: E402
from dattri_ds.errors import InputFileError  # noqa: E402
from dattri_ds.methods import get_attributor  # noqa: E402
from dattri_ds.tools.configs import DATA, add_flags  # noqa: E402
from dattri_ds.tools.datasets import open_data  # noqa: E402
from dattri_ds.io.outputs import check_dir, writing  # noqa: E402
from dattri_ds.sample_id import SampleId  # noqa: E402
from dattri_ds.io.schema import add_flag  # noqa: E402
from dattri_ds.tools.provenance import training_data  # noqa: E402
from dattri_ds.tools.runtime import announce, logger, setup_logging  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds report", description=__doc__.splitlines()[0])
    p.add_argument("--attribution", required=True, help="output folder of tools/attribute.py")
    p.add_argument("--train-data", default=None,
                   help="jsonl holding the training texts (ids before '#' in store ids; "
                        "default: the file attribute or collect read, as they recorded it)")
    add_flags(p, DATA)  # --data-path (prepared training data) and --packing
    add_flag(p, "--seq-len", int, ge=2, default=None,
             help="--data-path: tokens per example (default: as recorded)")
    add_flag(p, "--top-k", int, ge=1, default=5)
    add_flag(p, "--chars", int, ge=1,
             default=300, help="characters of text shown")
    return p


_FIX = "pass --attribution the --out folder of tools/attribute.py"


def _prior_note(summary: dict) -> str:
    """How the scores mix in the text prior (attribute --text-weight), if they do."""
    w = summary.get("text_weight") or 0
    if not w:
        return ""
    return (f" (scores include the text-overlap prior at weight {w:g}: + {w:g} x std x "
            f"z(TF-IDF overlap) per query; the method's own scores are model_scores.npy)")


def _json(att: Path, name: str, ok, expected: str):
    """One JSON file of the attribution folder, checked to be what attribute wrote."""
    path = att / name
    value = files.read_json(path, "attribution file", fix=_FIX)
    if not ok(value):
        raise InputFileError(f"attribution file '{path}' is not what tools/attribute.py "
                             f"writes: expected {expected}, got {str(value)[:60]}. Fix: {_FIX}")
    return value


def _is_list_of(kind, keys=()):
    return lambda v: isinstance(v, list) and all(
        isinstance(x, kind) and all(k in x for k in keys) for x in v)


def read_attribution(att: Path):
    """(summary, queries, top-k, train ids, scores [N, Q]) of an attribution folder, each file
    read through :mod:`dattri_ds.io.files` and checked against the others' sizes."""
    att = files.check_dir(att, "--attribution folder", _FIX)
    if not ((att / "summary.json").exists() or (att / "summary.json").is_symlink()):
        have = sorted(p.name for p in att.iterdir())[:8]
        raise InputFileError(f"attribution summary '{att / 'summary.json'}' does not exist "
                             f"(the folder holds {have}): it is not the output of "
                             f"tools/attribute.py, or that run did not finish. Fix: {_FIX}")
    summary = _json(att, "summary.json", lambda v: isinstance(v, dict) and isinstance(
        v.get("method"), str) and isinstance(v.get("checkpoints"), list),
        "an object with 'method', 'train', 'queries' and 'checkpoints'")
    queries = _json(att, "queries.json", _is_list_of(dict, ("id", "text")),
                    "a list of {id, source, text} objects")
    top = _json(att, "topk.json", _is_list_of(dict, ("proponents", "opponents")),
                "a list of {proponents, opponents} objects")
    train_ids = _json(att, "train_ids.json", _is_list_of(str), "a list of training ids")
    scores = files.load_array(att / "scores.npy", "attribution scores", _FIX)
    want = (len(train_ids), len(queries))
    if scores.shape != want or scores.dtype.kind != "f":
        raise InputFileError(f"attribution scores '{att / 'scores.npy'}' are {scores.dtype} "
                             f"{list(scores.shape)}; expected floats [N={want[0]}, Q={want[1]}] "
                             f"(train_ids.json x queries.json). Fix: {_FIX}")
    return summary, queries, top, train_ids, scores


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
        contrib = files.load_array(per, "attribution file", _FIX)  # [C, N, Q]
        summary = files.read_json(att / "summary.json", "attribution summary", fix=_FIX)
        index = {t: i for i, t in enumerate(train_ids)}
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
        rows = [index[p["id"]] for p in top[0]["proponents"][:5]]
        bottom = np.zeros(len(rows))
        for c, tag in enumerate(summary["checkpoints"]):
            vals = contrib[c, rows, 0]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=tag)
            bottom += vals
        ax.set_xticks(range(len(rows)), [SampleId.parse(train_ids[r]).doc for r in rows],
                      rotation=20, fontsize=7)
        weighting = summary.get("weighting") or get_attributor(
            summary["method"]).default_weighting
        ax.set_ylabel(f"{weighting}-weighted contribution")
        ax.set_title(f"{summary['method']}: top proponents of {queries[0]['id']} by checkpoint",
                     fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(att / "tracin_checkpoints.png")
        plt.close(fig)
        made.append("tracin_checkpoints.png")
    return made


def _entry(e: dict, docs: dict[str, dict], chars: int) -> tuple[str, str, str, float]:
    doc_id = SampleId.parse(e["id"]).doc
    d = docs.get(doc_id)
    if d is None:
        return doc_id, "?", "(not in the training data)", e["score"]
    return doc_id, d["source"], " ".join(d["text"].split())[:chars], e["score"]


def _token_view(att: Path, train_ids: list[str]):
    """(per-token scores [N, Q, T], query tokens, train id -> row), or None without them."""
    if not (att / "per_token.npy").exists():
        return None
    return (files.load_array(att / "per_token.npy", "attribution file", _FIX),
            files.read_json(att / "query_tokens.json", "attribution file", fix=_FIX),
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
    summary, queries, top, train_ids, scores = read_attribution(att)
    check_dir(att, flag="--attribution", force=True, overwrites=("report.md", "report.html"))
    origin = training_data("--train-data", args.train_data, data_path=args.data_path,
                           packing=args.packing, attribution=att)
    announce("report", attribution=att, training_texts=" ".join(origin.files))
    data = open_data(origin, args.seq_len or origin.seq_len)
    docs = data.documents_of([e["id"] for t in top for k in ("proponents", "opponents")
                              for e in t[k][:args.top_k]])
    with writing(att):  # a full disk: one line naming the folder
        plots = _plots(att, scores, queries, top, train_ids)
    md = [f"# Attribution report ({summary['method']})", "",
          f"{summary['train']} training examples x {summary['queries']} queries, checkpoints "
          f"{', '.join(summary['checkpoints'])}; score > 0: training on the example lowers the "
          f"query's loss" + _prior_note(summary) + ".", ""]
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
    with writing(att):
        (att / "report.md").write_text("\n".join(md) + "\n")
        (att / "report.html").write_text(
            "<!doctype html><meta charset='utf-8'><title>dattri-ds report</title><style>body{"
            "font:14px sans-serif;max-width:60em;margin:auto}td{vertical-align:top;border-top:"
            "1px solid #ddd;padding:4px}.tokens{white-space:pre-wrap;font-family:monospace}"
            "</style>" + "\n".join(body))
    logger.info("report -> %s", att / "report.md")
    return att / "report.md"


if __name__ == "__main__":
    sys.exit(cli.run(main))
