"""README demo: train a tiny GPT-2 on the offline corpus, then attribute held-out queries to it.

Steps: tokenizer (SentencePiece BPE, cached) on the training pool -> small GPT-2 from
``configs/model_gpt2_tiny.json`` -> a few hundred AdamW steps of the shipped training loop
(launch/loop.py on ``--backend torch``; the run folder ``<out>/run`` is one the offline
tools read) -> projected per-example
gradients of the training documents and of a few held-out queries (Hamlet, trivia, code)
with ``GradientCapture`` -> cosine scores ``[N, Q]`` -> most and least helpful training
documents per query, and precision@k by source.

Sign convention: ``score[n, q] = cos(g_n, g_q)``. A gradient step on document n changes
the query loss by ``-lr * <g_n, g_q> + O(lr^2)``, so a positive score means training on n
lowers the loss of q (helpful), a negative one raises it.

Usage::

    python tools/demo.py [--out runs/demo] [--steps N] [--quick]

``--quick`` uses ``data/tiny`` (under ~40 s on 2 CPU cores); the default uses the
3,500-document pool (under ~3 minutes). The report is ``<out>/report.json``; scores and
ids are in ``<out>/scores.pt``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from dattri_ds.launch.config import RunConfig, TrainConfig
from dattri_ds.launch.engine import EngineConfig
from dattri_ds.launch.train import train_in_process

import dattri_ds
from dattri_ds import CaptureConfig, ProjectionConfig
from dattri_ds.cli import exits as cli
from dattri_ds.cli.noise import quiet_third_party
from dattri_ds.data import (
    Document,
    TokenizedDocuments,
    load_documents,
    source_counts,
    tokenize_documents,
    train_tokenizer,
)
from dattri_ds.io.schema import add_flag
from dattri_ds.models.causal_lm import build_model

logger = logging.getLogger("dattri_ds.tools.demo")

ROOT = Path(__file__).resolve().parents[1]
#: Target set (file stem) -> the pool source that should rank highest for its queries.
EXPECTED_SOURCE = {"hamlet": "shakespeare", "target": "shakespeare", "code": "python_code",
                   "trivia": None}
PRESETS = {
    "default": dict(train="data/corpus/train.jsonl", hamlet="data/target/hamlet.jsonl",
                    vocab_size=1024, seq_len=128, steps=400, batch_size=16, lr=3e-3,
                    attr_docs=3500, proj_dim=256, log_every=50),
    "quick": dict(train="data/tiny/train.jsonl", hamlet="data/tiny/target.jsonl",
                  vocab_size=512, seq_len=128, steps=60, batch_size=16, lr=3e-3,
                  attr_docs=200, proj_dim=256, log_every=10),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="output directory (report.json, scores.pt)")
    p.add_argument("--quick", action="store_true", help="data/tiny, fewer steps (~40 s)")
    add_flag(p, "--steps", int, ge=1, help="optimizer steps (preset: 400, quick 60)")
    add_flag(p, "--batch-size", int, ge=1, help="training batch size (preset: 16)")
    add_flag(p, "--lr", float, gt=0, help="peak AdamW learning rate (preset: 3e-3)")
    add_flag(p, "--seq-len", int, ge=1, help="tokens per document (preset: 128)")
    add_flag(p, "--vocab-size", int, ge=1, help="tokenizer vocabulary (preset: 1024, quick 512)")
    add_flag(p, "--attr-docs", int, ge=1,
             help="training documents to score, a prefix of the pool (preset: all)")
    add_flag(p, "--proj-dim", int, ge=1, help="Kronecker projection size per layer")
    add_flag(p, "--queries-per-target", int, ge=1, default=3,
             help="queries taken evenly spaced from each target file")
    add_flag(p, "--top-k", int, ge=1, default=10, help="k of the top/bottom lists and precision@k")
    add_flag(p, "--log-every", int, ge=1, help="print the training loss every N steps")
    p.add_argument("--model-config", default=str(ROOT / "configs" / "model_gpt2_tiny.json"))
    p.add_argument("--cache-dir", default=None,
                   help="tokenizer cache (default $DATTRI_DS_CACHE or ~/.cache/dattri_ds)")
    add_flag(p, "--seed", int, ge=0, default=0)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for k, v in PRESETS["quick" if args.quick else "default"].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


def evenly_spaced(docs: list[Document], k: int) -> list[Document]:
    """``k`` documents at evenly spaced positions (first and last included)."""
    if k >= len(docs):
        return list(docs)
    if k == 1:
        return [docs[len(docs) // 2]]
    return [docs[round(i * (len(docs) - 1) / (k - 1))] for i in range(k)]


def load_queries(args: argparse.Namespace) -> tuple[list[Document], list[str]]:
    """Queries and their target-set names (hamlet, trivia, code)."""
    files = {"hamlet": ROOT / args.hamlet, "trivia": ROOT / "data/target/trivia.jsonl",
             "code": ROOT / "data/target/code.jsonl"}
    queries, sets = [], []
    for name, path in files.items():
        chosen = evenly_spaced(load_documents(path), args.queries_per_target)
        queries += chosen
        sets += [name] * len(chosen)
    return queries, sets


@torch.no_grad()
def mean_loss(model: torch.nn.Module, ds: TokenizedDocuments, batch_size: int = 64) -> float:
    """Token-mean loss over a dataset."""
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(ds), batch_size):
        b = ds.batch(slice(s, s + batch_size))
        n = int((b["labels"][:, 1:] != -100).sum())
        total += float(model(**b).loss) * n
        count += n
    return total / max(count, 1)


def run_configs(args: argparse.Namespace):
    """``(DeepSpeed dict, RunConfig)`` of the demo's training run on the shipped loop
    (``--backend torch``): AdamW (betas 0.9/0.95, weight decay 0.1), DeepSpeed
    WarmupCosineLR (linear warm-up over 10% of the steps, cosine to 10% of the peak),
    clipping 1.0, ``batch_size`` examples per step."""
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95],
                                                  "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": args.steps, "warmup_num_steps": max(2, args.steps // 10),
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1, "warmup_type": "linear"}}}
    train = TrainConfig(model_config=str(args.model_config), steps=args.steps, seed=args.seed,
                        seq_len=args.seq_len, vocab_size=args.vocab_size,
                        log_every=args.log_every)
    return ds_config, RunConfig(train=train, engine=EngineConfig(backend="torch"))


def train(ds: TokenizedDocuments, tok, args: argparse.Namespace, out: Path):
    """Train with the shipped loop (``train_in_process``) into ``out``; returns the model
    and ``[[step, mean loss since the previous log step], ...]``."""
    ds_config, cfg = run_configs(args)
    _, backend = train_in_process(ds_config, cfg, ds, tok, out)
    lrs = json.loads((out / "trajectory.json").read_text())["lrs"]
    history, last = [], 0
    for e in lrs:
        n = e["step"] + 1
        if n % args.log_every == 0 or n == args.steps:
            losses = [x["loss"] for x in lrs[last:n]]
            history.append([n, round(sum(losses) / len(losses), 4)])
            last = n
    return backend.model, history


def capture(model: torch.nn.Module, ds: TokenizedDocuments, proj: ProjectionConfig,
            batch_size: int = 50) -> list[dattri_ds.GradBatch]:
    """Projected per-example gradients of every row of ``ds``, in row order."""
    model.eval()  # no dropout: the gradient of each document is deterministic
    starts = range(0, len(ds), batch_size)
    return list(dattri_ds.collect(model, (ds.batch(slice(s, s + batch_size)) for s in starts),
                                  CaptureConfig(projection=proj),
                                  user_ids=(ds.ids[s:s + batch_size] for s in starts)))


def entry(doc: Document, score: float, rank: int) -> dict:
    return {"rank": rank, "id": doc.id, "source": doc.source, "title": doc.title,
            "score": round(score, 5), "text": doc.preview(100)}


def summarize(scores: torch.Tensor, train_docs: tuple[Document, ...], queries: list[Document],
              sets: list[str], k: int) -> dict:
    """Per query: top/bottom-k documents, source histogram of the top-k, precision@k."""
    pool = source_counts(train_docs)
    n = len(train_docs)
    per_query, by_set = [], {}
    for q, (doc, tset) in enumerate(zip(queries, sets)):
        col = scores[:, q]
        order = torch.argsort(col, descending=True, stable=True).tolist()
        top, bottom = order[:k], order[::-1][:k]
        top_sources = Counter(train_docs[i].source for i in top)
        mean_by_source = {s: round(float(col[[i for i, d in enumerate(train_docs)
                                              if d.source == s]].mean()), 5) for s in pool}
        expected = EXPECTED_SOURCE.get(tset)
        item = {
            "query_id": doc.id, "target_set": tset, "source": doc.source, "text": doc.preview(100),
            "expected_source": expected,
            "top": [entry(train_docs[i], float(col[i]), r + 1) for r, i in enumerate(top)],
            "bottom": [entry(train_docs[i], float(col[i]), n - r) for r, i in enumerate(bottom)],
            "top_k_sources": dict(top_sources.most_common()),
            "mean_score_by_source": mean_by_source,
            "score_std": round(float(col.std()), 6),
        }
        if expected is not None:
            item["precision_at_k"] = top_sources.get(expected, 0) / len(top)
            item["chance"] = pool.get(expected, 0) / n
            by_set.setdefault(tset, []).append(item["precision_at_k"])
        per_query.append(item)
    mean_p = {s: {"expected_source": EXPECTED_SOURCE[s], "precision_at_k": sum(v) / len(v),
                  "chance": pool.get(EXPECTED_SOURCE[s], 0) / n} for s, v in by_set.items()}
    by_target = {}
    for tset in dict.fromkeys(sets):
        items = [q for q in per_query if q["target_set"] == tset]
        by_target[tset] = {src: round(sum(q["mean_score_by_source"][src] for q in items)
                                      / len(items), 5) for src in pool}
    return {"k": k, "pool_sources": pool, "queries": per_query, "precision_at_k_by_target": mean_p,
            "mean_score_by_source_by_target": by_target}


def print_results(summary: dict) -> None:
    k = summary["k"]
    for item in summary["queries"]:
        print(f"\n=== query {item['query_id']} ({item['target_set']}): {item['text']!r}")
        for title, rows in (("most helpful", item["top"][:5]), ("least helpful", item["bottom"][:3])):
            print(f"  {title}:")
            for e in rows:
                print(f"    #{e['rank']:<5d} {e['score']:+.4f}  {e['id']:<16s} {e['source']:<12s} "
                      f"{e['text'][:70]!r}")
        extra = (f"  precision@{k} ({item['expected_source']}): {item['precision_at_k']:.2f} "
                 f"(chance {item['chance']:.2f})" if "precision_at_k" in item else "")
        print(f"  top-{k} sources: {item['top_k_sources']}{extra}")
    print("\nmean score by training source (rows: target set, mean over its queries):")
    table = summary["mean_score_by_source_by_target"]
    srcs = list(summary["pool_sources"])
    print("  " + " " * 8 + "".join(f"{src[:11]:>12s}" for src in srcs))
    for tset, row in table.items():
        print(f"  {tset:<8s}" + "".join(f"{row[src]:>+12.4f}" for src in srcs))
    print(f"\nprecision@{k} by target set (mean over its queries):")
    for s, v in summary["precision_at_k_by_target"].items():
        print(f"  {s:<8s} -> {v['expected_source']:<12s} {v['precision_at_k']:.2f} "
              f"(chance {v['chance']:.2f})")


def query_losses(model: torch.nn.Module, qds: TokenizedDocuments, sets: list[str]) -> dict:
    """Mean token loss of each target set's queries."""
    return {s: round(mean_loss(model, qds.subset([i for i, t in enumerate(sets) if t == s])), 4)
            for s in dict.fromkeys(sets)}


def attribute(model: torch.nn.Module, train_ds: TokenizedDocuments, qds: TokenizedDocuments,
              proj: ProjectionConfig) -> tuple[torch.Tensor, list[str]]:
    """``[N, Q]`` cosine scores of projected per-example gradients, and the layer names."""
    train_grads = capture(model, train_ds, proj)
    query_grads = capture(model, qds, proj)
    scores = torch.cat([torch.cat([dattri_ds.cosine(gb, qb) for qb in query_grads], 1)
                        for gb in train_grads])
    return scores, list(query_grads[0].layers)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    quiet_third_party()  # DeepSpeed's scheduler warnings are not the tour's
    torch.manual_seed(args.seed)
    torch.set_flush_denormal(True)  # denormal floats are slow on CPUs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    times, t0 = {}, time.time()

    docs = load_documents(ROOT / args.train)
    queries, sets = load_queries(args)
    tok = train_tokenizer([d.text for d in docs], vocab_size=args.vocab_size,
                          cache_dir=args.cache_dir)
    ds = tokenize_documents(docs, tok, args.seq_len)
    qds = tokenize_documents(queries, tok, args.seq_len)
    times["data_s"] = time.time() - t0
    logger.info("%d training documents %s, %d queries; tokenizer %s; %.0f%% truncated at T=%d",
                len(docs), source_counts(docs), len(queries), tok.fingerprint,
                100 * float(ds.truncated.float().mean()), args.seq_len)

    model = build_model(args.model_config, tokenizer=tok, seed=args.seed)  # the loop's init
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model %s, %.2fM parameters", type(model).__name__, n_params / 1e6)
    q_before = query_losses(model, qds, sets)
    t1 = time.time()
    model, history = train(ds, tok, args, out / "run")
    times["train_s"] = time.time() - t1
    logger.info("trained %d steps in %.1f s (run folder %s)", args.steps, times["train_s"],
                out / "run")
    q_after = query_losses(model, qds, sets)
    logger.info("query loss before -> after training: %s", ", ".join(
        f"{s} {q_before[s]:.2f} -> {q_after[s]:.2f}" for s in q_before))

    t2 = time.time()
    proj = ProjectionConfig(kind="kronecker", dim=args.proj_dim, seed=args.seed)
    train_ds = ds.subset(range(min(args.attr_docs, len(ds))))
    scores, layers = attribute(model, train_ds, qds, proj)
    times["attribution_s"] = time.time() - t2
    logger.info("scored %d training documents x %d queries (%s, %d layers) in %.1f s",
                scores.shape[0], scores.shape[1], proj.tag, len(layers), times["attribution_s"])

    summary = summarize(scores, train_ds.docs, queries, sets, args.top_k)
    print_results(summary)
    times["total_s"] = time.time() - t0
    report = {
        "args": vars(args),
        "sign_convention": "score = cos(g_train, g_query); positive = training on the document "
                           "lowers the query loss to first order (helpful), negative = raises it",
        "tokenizer": {"fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                      "path": str(tok.path)},
        "model": {"class": type(model).__name__, "parameters": n_params,
                  "config": model.config.to_dict()},
        "train": {"documents": len(ds), "losses": history,
                  "query_loss_before": q_before, "query_loss_after": q_after},
        "attribution": {"score": "cosine", "projection": proj.tag, "layers": layers,
                        "n_train": scores.shape[0], "n_query": scores.shape[1], **summary},
        "runtime_s": {k: round(v, 2) for k, v in times.items()},
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    torch.save({"scores": scores, "train_ids": train_ds.ids, "query_ids": [q.id for q in queries]},
               out / "scores.pt")
    logger.info("\nreport: %s  (total %.1f s)", out / "report.json", times["total_s"])
    return report


if __name__ == "__main__":
    sys.exit(cli.run(main))
