"""Does an offline-curated subset train better than random, DSIR and the full pool? (LESS workflow)

    python benchmarks/curation_effect.py --name main --seeds 0 1 2 3 4 --targets hamlet code \
        carve:python_docs --fractions 0.05 0.1 0.25 --warmup-steps 40 --steps 120
    python benchmarks/curation_effect.py --name main --summarize      # paired tables

Per seed and target: (1) warm up a model with the shipped loop (``train_in_process``:
launch/loop.py on ``--backend torch``) for ``--warmup-steps`` on the pool and save the
checkpoint (with Adam state); (2) collect the pool's projected gradients from it
(``tools/collect.py``); (3) select subsets at each fraction with ``tools/curate.py``
(``dattri-ds select``) for every ``--methods`` entry, plus a seeded random subset of the
same size and the content prior's subset (``--method content``: DSIR); (4) train a fresh
model (same init seed) for ``--steps`` on each subset and on the full pool; (5) record the
held-out target loss (documents never scored against) and the general-corpus loss.

Targets: a shipped target (``hamlet``, ``trivia``, ``code``: first half scored, second
half held out) or ``carve:<source>`` (documents of one corpus source, held out of the pool).
``--noise F`` replaces a share F of the pool's texts by shuffled-word copies (a noisy pool).
One jsonl line per trained run goes to ``<results-dir>/<name>/runs.jsonl`` (outside the code
tree); ``--summarize`` prints, per target and fraction, each variant's mean target loss and
the paired differences (variant - baseline, mean +- s.e. over seeds) against random, DSIR
and the full pool. The issue's goal: at 10% ahead of random and DSIR by > 2 s.e. on every
target; at 5% no worse than the full pool.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PY = sys.executable
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "DS_ACCELERATOR": "cpu"}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="curation")
    p.add_argument("--results-dir", default=str(ROOT.parent / "results"))
    p.add_argument("--summarize", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--targets", nargs="+", default=["hamlet", "code", "carve:python_docs"])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.05, 0.1, 0.25])
    p.add_argument("--methods", nargs="+", default=["cosine", "adam-cosine", "combined"])
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--pool-docs", type=int, default=None,
                   help="use the first N pool documents (default: all)")
    p.add_argument("--target-docs", type=int, default=32, help="target documents scored")
    p.add_argument("--projection-dim", type=int, default=256)
    p.add_argument("--noise", type=float, default=0.0)
    return p.parse_args(argv)


def _sh(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")


def _write(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps(d.to_dict()) + "\n" for d in docs))
    return path


def _noisy(docs, share: float, seed: int):
    from dattri_ds.data.corpus import Document

    g = random.Random(seed)
    out = []
    for d in docs:
        if g.random() < share:
            words = d.text.split()
            g.shuffle(words)
            d = Document(d.id, d.source, d.title, " ".join(words) or d.text)
        out.append(d)
    return out


def _train(setup, docs, seed: int, steps: int, args, out: Path, save: bool = False) -> dict:
    """One run of the shipped loop on ``docs``; the held-out target and general losses."""
    from benchmarks._common import loop_configs
    from benchmarks.selection_effect import mean_loss
    from dattri_ds.data import tokenize_documents
    from dattri_ds.launch.train import train_in_process
    from dattri_ds.selection.config import SelectionConfig

    ds, cfg = loop_configs(steps=steps, seed=seed, seq_len=args.seq_len, eval_every=0,
                           selection=SelectionConfig(), micro=args.micro, gas=1)
    if save:
        from dataclasses import replace
        cfg = replace(cfg, train=replace(cfg.train, save_every=steps))
    data = tokenize_documents(list(docs), setup.tok, args.seq_len)
    t0 = time.perf_counter()
    _, backend = train_in_process(ds, cfg, data, setup.tok, out)
    return {"target_loss": mean_loss(backend.model, setup.eval),
            "general_loss": mean_loss(backend.model, setup.general),
            "examples": len(docs), "seconds": round(time.perf_counter() - t0, 1)}


def run_one(args, seed: int, target: str, log) -> None:
    from benchmarks.selection_effect import Setup

    setup = Setup(target, args.seq_len, args.target_docs)
    work = Path(args.results_dir) / args.name / "work" / f"{target.replace(':', '-')}-s{seed}"
    work.mkdir(parents=True, exist_ok=True)
    pool = list(setup.pool.docs)[:args.pool_docs] if args.pool_docs else list(setup.pool.docs)
    if args.noise:
        pool = _noisy(pool, args.noise, seed)
    pool_file = _write(work / "pool.jsonl", pool)
    target_file = _write(work / "target.jsonl", setup.score.docs)
    warm = work / "warm"
    if not (warm / "trajectory.json").exists():
        _train(setup, pool, seed, args.warmup_steps, args, warm, save=True)
        setup.tok.save(warm / "tokenizer.model")
    grads = work / "grads"
    if not (grads / "collect_config.json").exists():
        _sh([PY, "tools/collect.py", "--run-dir", str(warm), "--data", str(pool_file),
             "--checkpoints", "last", "--out", str(grads), "--projection", "sparse",
             "--projection-dim", str(args.projection_dim), "--batch-size", "16"])
    base = {"seed": seed, "target": target, "pool": len(pool), "noise": args.noise,
            "steps": args.steps, "warmup_steps": args.warmup_steps}
    log({**base, "variant": "full", "fraction": 1.0,
         **_train(setup, pool, seed, args.steps, args, work / "train-full")})
    by_id = {d.id: d for d in pool}
    for f in args.fractions:
        k = max(1, round(f * len(pool)))
        rnd = random.Random(seed).sample(pool, k)
        log({**base, "variant": "random", "fraction": f,
             **_train(setup, rnd, seed, args.steps, args, work / f"train-random-{f}")})
        for method in ["content", *args.methods]:
            sel = work / f"select-{method}-{f}"
            _sh([PY, "tools/curate.py", "--run-dir", str(warm), "--store", str(grads),
                 "--pool", str(pool_file), "--target", str(target_file), "--method", method,
                 "--fraction", str(f), "--out", str(sel), "--force"])
            ids = [json.loads(x)["id"] for x in (sel / "subset.jsonl").read_text().splitlines()]
            variant = "dsir" if method == "content" else method
            log({**base, "variant": variant, "fraction": f,
                 **_train(setup, [by_id[i] for i in ids], seed, args.steps, args,
                          work / f"train-{method}-{f}")})


def _se(xs: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def summarize(path: Path) -> str:
    """Paired tables: per target and fraction, each variant's mean target / general loss and
    its paired difference (variant - baseline; negative = lower loss) against random, DSIR
    and the full pool, mean +- s.e. over the seeds both have."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    by = {(r["target"], r["fraction"], r["variant"], r["seed"]): r for r in rows}
    full = {(r["target"], r["seed"]): r for r in rows if r["variant"] == "full"}
    lines = []
    for target in sorted({r["target"] for r in rows}):
        for f in sorted({r["fraction"] for r in rows if r["fraction"] < 1}):
            lines += [f"\n## {target}, {f:.0%} of the pool", "",
                      "| variant | seeds | target loss | general loss | - random | - dsir "
                      "| - full |", "|---|---|---|---|---|---|---|"]
            variants = sorted({r["variant"] for r in rows if r["target"] == target
                               and r["fraction"] == f})
            for v in variants:
                seeds = sorted(s for (t, ff, vv, s) in by if (t, ff, vv) == (target, f, v))
                tl = [by[(target, f, v, s)]["target_loss"] for s in seeds]
                gl = [by[(target, f, v, s)]["general_loss"] for s in seeds]
                cells = []
                for ref in ("random", "dsir", "full"):
                    d = [by[(target, f, v, s)]["target_loss"] - (
                        full[(target, s)] if ref == "full" else by.get((target, f, ref, s),
                                                                      {}))["target_loss"]
                         for s in seeds if (ref == "full" and (target, s) in full)
                         or (target, f, ref, s) in by]
                    cells.append("" if not d or v == ref else
                                 f"{sum(d) / len(d):+.4f} +- {_se(d):.4f}")
                lines.append(f"| {v} | {len(seeds)} | {sum(tl) / len(tl):.4f} | "
                             f"{sum(gl) / len(gl):.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse(argv)
    out = Path(args.results_dir) / args.name
    out.mkdir(parents=True, exist_ok=True)
    runs = out / "runs.jsonl"
    if args.summarize:
        print(summarize(runs))
        return
    (out / "config.json").write_text(json.dumps(vars(args), indent=1) + "\n")

    def log(rec: dict) -> None:
        with open(runs, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)

    for seed in args.seeds:
        for target in args.targets:
            run_one(args, seed, target, log)
    print(summarize(runs))


if __name__ == "__main__":
    main()
