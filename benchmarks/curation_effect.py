"""Does an offline-curated subset train better than random, DSIR and the full pool? (LESS workflow)

    python benchmarks/curation_effect.py --name main --results-dir runs/curation_<date> \
        --work-dir /tmp/curation --seeds 0 1 2 3 4 --targets hamlet code carve:python_docs \
        hamlet@noise0.3 --fractions 0.05 0.1 0.25 --methods combined adam-cosine \
        --pool-docs 400 --warmup-steps 40 --steps 60 --order pool
    python benchmarks/curation_effect.py --name main --results-dir ... --summarize   # tables

Per seed and pool: (1) warm up a model with the shipped loop (``train_in_process``:
launch/loop.py on ``--backend torch``) for ``--warmup-steps`` on the pool and save the
checkpoint (with Adam state); (2) collect the pool's projected gradients from it
(``tools/collect.py``); (3) train a fresh model (same init seed) for ``--steps`` on the full
pool and on a seeded random subset of each fraction; (4) per target, select subsets at each
fraction with ``tools/curate.py`` (``dattri-ds curate``) for every ``--methods`` entry and
the content prior alone (``--method content``: DSIR), and train on each for ``--steps``;
(5) record the held-out target loss (documents never scored against) and the
general-corpus loss (the last 20 documents of every corpus source, never in a pool).
Targets that share a pool (the shipped ones) share its warm-up, store, full-pool and random
runs. The tools run in this process (``dattri_ds.cli.exits.run``: their exit codes, no new
interpreter per call).

Targets: a shipped target (``hamlet``, ``trivia``, ``code``: the first ``--target-docs`` of
its first half scored, 64 of its second half held out) or ``carve:<source>`` (64 documents
of one corpus source scored, 64 more held out, all 128 removed from the pool); a suffix
``@noise<F>`` (``hamlet@noise0.3``) replaces a share F of that target's pool texts by
shuffled-word copies (a noisy pool, drawn per seed). ``--pool-docs N``: the first N pool
documents in round-robin source order (every source equally; the same N for every seed).
``--oracle-only`` trains only on each target's own scored documents (a diagnostic: the best
in-distribution data of that size). ``--tag T`` is a screening pass: each ``--methods`` entry
(with ``--select-args``, e.g. ``--content-weight 2``) is recorded as ``<method>+T`` against the
untagged pass's random, DSIR and full-pool runs. The method ``cascade`` (benchmark only) takes
the content prior's first ``--shortlist`` budgets of rows and keeps the budget that the
gradient cosine ranks first among them. One jsonl line per trained run goes to
``<results-dir>/<name>/runs.jsonl``, and every invocation to ``invocations.jsonl``; a
restarted run skips the runs already recorded (same steps). ``--summarize`` prints, per
target and fraction, each variant's mean target and general loss and the paired differences
(variant - baseline, mean +- s.e. over seeds, wins = seeds with a lower loss) against random,
DSIR and the full pool. The issue's goal: at 10% ahead of random and DSIR by > 2 s.e. on
every target; at 5% no worse than the full pool.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
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
    p.add_argument("--results-dir", default=str(ROOT.parent / "results"),
                   help="runs.jsonl and config.json go to <results-dir>/<name>/")
    p.add_argument("--work-dir", default=None,
                   help="checkpoints, stores and subsets (default: <results-dir>/<name>/work)")
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
                   help="use the first N pool documents in round-robin source order "
                        "(default: all)")
    p.add_argument("--target-docs", type=int, default=32, help="target documents scored")
    p.add_argument("--projection-dim", type=int, default=256)
    p.add_argument("--select-args", nargs=argparse.REMAINDER, default=[],
                   help="extra flags for every select call (last on the line)")
    p.add_argument("--tag", default=None,
                   help="a screening pass: record each method as <method>+<tag> (its own "
                        "selections and runs; --select-args says what the tag changes) and "
                        "train no DSIR subset (the untagged pass's is the baseline)")
    p.add_argument("--shortlist", type=float, default=2.0,
                   help="method 'cascade': the DSIR shortlist's size, in budgets")
    p.add_argument("--baselines-at", type=float, nargs="+", default=None,
                   help="fractions at which the random and DSIR subsets are trained "
                        "(default: every --fractions entry)")
    p.add_argument("--order", choices=["seed", "pool"], default="seed",
                   help="seed: every pool per seed; pool: every seed of one pool's targets "
                        "before the next pool (a cut-short run leaves whole targets)")
    p.add_argument("--oracle-only", action="store_true",
                   help="diagnostic: train only on each target's scored documents")
    p.add_argument("--oracle-docs", type=int, default=None,
                   help="with --oracle-only: only the first N scored documents (variant "
                        "oracle<N>, logged at fraction N / pool)")
    return p.parse_args(argv)


def _tool(main, argv: list[str]) -> float:
    """Run a tool's ``main`` in this process (``dattri_ds.cli.exits.run``: the same exit codes as
    the command line, without a fresh interpreter per call); its wall seconds."""
    from dattri_ds.cli.exits import run

    t0 = time.perf_counter()
    if run(main, argv) != 0:
        raise SystemExit(f"failed: {main.__module__} {' '.join(argv)}")
    return round(time.perf_counter() - t0, 1)


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


def _interleave(docs) -> list:
    """The pool in round-robin source order (source 1's first document, source 2's first,
    ..., then every source's second ...), so that its first N documents hold every source
    equally (Setup lists the pool source by source)."""
    by: dict[str, list] = {}
    for d in docs:
        by.setdefault(d.source, []).append(d)
    out, i = [], 0
    while len(out) < len(docs):
        out += [v[i] for v in by.values() if i < len(v)]
        i += 1
    return out


def parse_target(spec: str) -> tuple[str, float]:
    """``"hamlet"`` -> ("hamlet", 0); ``"hamlet@noise0.3"`` -> ("hamlet", 0.3): the target
    with a pool whose texts are shuffled-word copies with probability 0.3 (per seed)."""
    base, _, rest = spec.partition("@")
    if rest and not rest.startswith("noise"):
        raise SystemExit(f"target '{spec}': expected <target>[@noise<share>]")
    return base, float(rest[5:]) if rest else 0.0


def _train(setups: dict, docs, seed: int, steps: int, args, out: Path,
           save: bool = False) -> dict:
    """One run of the shipped loop on ``docs``; per target label, its held-out target loss
    and the general-corpus loss (every setup shares the tokenizer and general set)."""
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
    if not save and out.exists():
        shutil.rmtree(out)  # a run cut short by a restart
    first = next(iter(setups.values()))
    data = tokenize_documents(list(docs), first.tok, args.seq_len)
    t0 = time.perf_counter()
    _, backend = train_in_process(ds, cfg, data, first.tok, out)
    general = mean_loss(backend.model, first.general)
    secs = round(time.perf_counter() - t0, 1)
    return {label: {"target_loss": mean_loss(backend.model, st.eval), "general_loss": general,
                    "examples": len(docs), "seconds": secs} for label, st in setups.items()}


def _pool_key(spec: str) -> tuple[str, float]:
    """Targets with the same key train on the same pool (shipped targets share the corpus
    minus the general set; a carved target removes its own documents)."""
    base, noise = parse_target(spec)
    return (base if base.startswith("carve:") else "shipped", noise)


_SETUPS: dict = {}  # target label -> Setup (seed-independent: built once per process)


def run_group(args, seed: int, specs: list[str], log, done: set) -> None:
    """Warm up, collect, full pool and random subsets once for targets sharing a pool; then
    each target's selections (DSIR and ``--methods``) at every fraction."""
    from dattri_ds.tools.collect import main as collect
    from benchmarks.selection_effect import Setup
    from dattri_ds.tools.curate import main as select

    for s in specs:
        if s not in _SETUPS:
            _SETUPS[s] = Setup(parse_target(s)[0], args.seq_len, args.target_docs)
    setups = {s: _SETUPS[s] for s in specs}
    setup = setups[specs[0]]
    key = _pool_key(specs[0])
    root = Path(args.work_dir) if args.work_dir else Path(args.results_dir) / args.name / "work"
    work = root / f"{key[0].replace(':', '-')}-noise{key[1]}-s{seed}"
    work.mkdir(parents=True, exist_ok=True)
    pool = _interleave(setup.docs)[:args.pool_docs] if args.pool_docs else list(setup.docs)
    if key[1]:
        pool = _noisy(pool, key[1], seed)
    pool_file = _write(work / "pool.jsonl", pool)
    base = {"seed": seed, "pool": len(pool), "steps": args.steps,
            "warmup_steps": args.warmup_steps}

    def emit(res: dict, **kw) -> None:
        for label, r in res.items():
            log({**base, "target": label, "noise": parse_target(label)[1], **kw, **r})

    def todo(variant: str, fraction: float, labels=tuple(specs)) -> bool:
        """Whether a run is still missing from runs.jsonl (a restarted benchmark resumes)."""
        return any((lab, fraction, variant, seed) not in done for lab in labels)

    if args.oracle_only:  # diagnostic: train on the target's own scored documents
        n = args.oracle_docs
        variant = "oracle" if n is None else f"oracle{n}"
        for s, st in setups.items():
            docs = list(st.score.docs)[:n]
            if todo(variant, len(docs) / len(pool), (s,)):
                emit(_train({s: st}, docs, seed, args.steps, args,
                            work / f"train-{variant}-{s.replace(':', '-')}"),
                     variant=variant, fraction=len(docs) / len(pool))
        return
    warm = work / "warm"
    t0 = time.perf_counter()
    if not (warm / "trajectory.json").exists():
        _train(setups, pool, seed, args.warmup_steps, args, warm, save=True)
        setup.tok.save(warm)  # warm/tokenizer.model
    grads = work / "grads"
    if not (grads / "collect_config.json").exists():
        _tool(collect, ["--run-dir", str(warm), "--data", str(pool_file), "--checkpoints",
                        "last", "--out", str(grads), "--projection", "sparse",
                        "--projection-dim", str(args.projection_dim), "--batch-size", "16"])
    print(f"# seed {seed} {key}: warm-up + collect {time.perf_counter() - t0:.1f} s",
          flush=True)
    if todo("full", 1.0):
        emit(_train(setups, pool, seed, args.steps, args, work / "train-full"),
             variant="full", fraction=1.0)
    by_id = {d.id: d for d in pool}
    baselines = args.fractions if args.baselines_at is None else args.baselines_at
    for f in args.fractions:
        k = max(1, round(f * len(pool)))
        rnd = random.Random(seed).sample(pool, k)
        if todo("random", f) and f in baselines:
            emit(_train(setups, rnd, seed, args.steps, args, work / f"train-random-{f}"),
                 variant="random", fraction=f)
    for s, st in setups.items():
        tdir = work / s.replace(":", "-")
        tdir.mkdir(exist_ok=True)
        target_file = _write(tdir / "target.jsonl", st.score.docs)
        for f in args.fractions:
            methods = ["content", *args.methods] if f in baselines and not args.tag else \
                args.methods
            for method in methods:
                variant = "dsir" if method == "content" else \
                    method if not args.tag else f"{method}+{args.tag}"
                if not todo(variant, f, (s,)):
                    continue
                sel = tdir / f"select-{variant}-{f}"

                def select_with(m: str, out: Path, extra=()) -> float:
                    return _tool(select, [
                        "--run-dir", str(warm), "--store", str(grads), "--pool",
                        str(pool_file), "--target", str(target_file), "--method", m,
                        "--fraction", str(f), "--out", str(out), "--force", *extra])

                if method == "cascade":
                    secs = select_with("content", tdir / f"cascade-content-{f}") + \
                        select_with("cosine", sel, args.select_args)
                    ids = cascade(tdir / f"cascade-content-{f}", sel,
                                  max(1, round(f * len(pool))), args.shortlist)
                else:
                    secs = select_with(method, sel, args.select_args)
                    ids = [json.loads(x)["id"]
                           for x in (sel / "subset.jsonl").read_text().splitlines()]
                res = _train({s: st}, [by_id[i] for i in ids], seed, args.steps, args,
                             tdir / f"train-{variant}-{f}")
                emit(res, variant=variant, fraction=f, select_seconds=secs)


def cascade(prior: Path, grad: Path, k: int, shortlist: float) -> list[str]:
    """Method ``cascade`` (a screening variant, benchmark only): the ``round(shortlist k)``
    rows the content prior ranks first (``prior/scores.npy``), re-ranked by the gradient
    score (``grad/scores.npy``, same store order); the first ``k`` document ids."""
    import numpy as np
    from dattri_ds.sample_id import SampleId

    ids = json.loads((prior / "ids.json").read_text())
    if ids != json.loads((grad / "ids.json").read_text()):
        raise SystemExit(f"cascade: {prior} and {grad} score different rows")
    c, g = np.load(prior / "scores.npy"), np.load(grad / "scores.npy")
    short = np.argsort(-c, kind="stable")[:max(k, round(shortlist * k))]
    keep = short[np.argsort(-g[short], kind="stable")][:k]
    return [SampleId.parse(ids[r]).doc for r in keep.tolist()]


def _se(xs: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def _cell(d: list[float]) -> str:
    """``mean +- s.e. (wins/n)``: a paired difference, wins = seeds where it is < 0."""
    if not d:
        return ""
    return f"{sum(d) / len(d):+.3f} +- {_se(d):.3f} ({sum(x < 0 for x in d)}/{len(d)})"


def summarize(path: Path) -> str:
    """Paired tables: per target and fraction, each variant's mean target / general loss and
    its paired difference (variant - baseline; negative = lower loss) against random, DSIR
    and the full pool, mean +- s.e. over the seeds both have, with the wins (seeds where
    the variant's loss is lower)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    by = {(r["target"], r["fraction"], r["variant"], r["seed"]): r for r in rows}
    full = {(r["target"], r["seed"]): r for r in rows if r["variant"] == "full"}
    lines = []
    for target in sorted({r["target"] for r in rows}):
        fracs = sorted({r["fraction"] for r in rows if r["target"] == target
                        and r["variant"] not in ("full", "oracle")})
        oracle = sorted({r["fraction"] for r in rows if r["target"] == target
                         and r["variant"] == "oracle"})
        for f in fracs + oracle:
            title = f"{f:.0%} of the pool" if f not in oracle else "the target's scored docs"
            lines += [f"\n### {target}, {title}", "",
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
                    cells.append("" if v == ref else _cell(d))
                lines.append(f"| {v} | {len(seeds)} | {sum(tl) / len(tl):.3f} | "
                             f"{sum(gl) / len(gl):.3f} | " + " | ".join(cells) + " |")
        fl = [r for r in rows if r["target"] == target and r["variant"] == "full"]
        if fl:
            lines.append(f"\nfull pool ({len(fl)} seeds): target loss "
                         f"{sum(r['target_loss'] for r in fl) / len(fl):.3f}, general loss "
                         f"{sum(r['general_loss'] for r in fl) / len(fl):.3f}")
    return "\n".join(lines)


def goals(path: Path, method: str = "combined") -> str:
    """The issue's goals per target for ``method``: at 10% ahead of random and of DSIR by
    more than 2 s.e. (paired target-loss difference < -2 s.e.), at 5% no worse than the full
    pool (difference <= 0, or within 2 s.e. of 0)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    by = {(r["target"], r["fraction"], r["variant"], r["seed"]): r["target_loss"] for r in rows}
    lines = [f"\n### Goals ({method})", "",
             "| target | 10%: - random | 10%: - dsir | 5%: - full | met |",
             "|---|---|---|---|---|"]

    def diff(t, f, ref, fref):
        return [by[(t, f, method, s)] - by[(t, fref, ref, s)] for (tt, ff, v, s) in by
                if (tt, ff, v) == (t, f, method) and (t, fref, ref, s) in by]

    for t in sorted({r["target"] for r in rows}):
        d = [diff(t, 0.1, "random", 0.1), diff(t, 0.1, "dsir", 0.1), diff(t, 0.05, "full", 1.0)]
        ok = [bool(x) and len(x) > 1 and sum(x) / len(x) < -2 * _se(x) for x in d[:2]]
        ok.append(bool(d[2]) and len(d[2]) > 1 and sum(d[2]) / len(d[2]) <= 2 * _se(d[2]))
        lines.append(f"| {t} | " + " | ".join(_cell(x) for x in d) + " | "
                     + ", ".join(n for n, o in zip(("random", "dsir", "full"), ok) if o)
                     + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse(argv)
    out = Path(args.results_dir) / args.name
    out.mkdir(parents=True, exist_ok=True)
    runs = out / "runs.jsonl"
    if args.summarize:
        print(summarize(runs))
        for m in args.methods:
            print(goals(runs, m))
        return
    with open(out / "invocations.jsonl", "a") as fh:  # every (re)start, resumed or not
        fh.write(json.dumps({**vars(args), "argv": sys.argv,
                             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
                 + "\n")

    def log(rec: dict) -> None:
        with open(runs, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)

    done = set()
    if runs.exists():  # resume: runs already recorded (same steps and pool) are kept
        for x in runs.read_text().splitlines():
            r = json.loads(x)
            if r["steps"] == args.steps and r["warmup_steps"] == args.warmup_steps:
                done.add((r["target"], r["fraction"], r["variant"], r["seed"]))
    groups: dict[tuple, list[str]] = {}
    for spec in args.targets:
        groups.setdefault(_pool_key(spec), []).append(spec)
    order = ([(seed, specs) for seed in args.seeds for specs in groups.values()]
             if args.order == "seed" else
             [(seed, specs) for specs in groups.values() for seed in args.seeds])
    for seed, specs in order:
        run_group(args, seed, specs, log, done)
    print(summarize(runs))


if __name__ == "__main__":
    main()
