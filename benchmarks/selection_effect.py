"""Does online selection help? Paired seeds, selection variants vs uniform choice.

    python benchmarks/selection_effect.py --targets hamlet trivia code --multiples 4 2 \\
        --seeds 5 --steps 200 --variants default random [--log /work/notes/sel-bench.txt]
    python benchmarks/selection_effect.py --targets carve:austen carve:kjv --seeds 3 \\
        --variants random topk=policy:topk cos=normalize:1,per_token:1

One process, one thread (the effect of the choice does not depend on ZeRO), trained by the
shipped loop (``launch.train.train_in_process``: launch/loop.py on ``--backend torch``,
the selector of launch/train.py, forward reuse as configured): tiny GPT-2
(configs/model_gpt2_tiny.json), the optimizer, lr schedule and clipping of
configs/zero3_cpu.json (AdamW lr 2e-3, DeepSpeed WarmupCosineLR: 20 log-warmup steps then
cosine to 0.1 at step 300, gradient clipping 1.0), micro-batch 8 x 2 accumulation = 16
trained examples per step, seq_len 64. Every variant of a seed starts from the same
initialization and sees the same candidate stream.

Targets: ``hamlet``, ``trivia``, ``code`` (data/target/*.jsonl: first half = the scoring
set selection sees, second half = the held-out evaluation set) or ``carve:SOURCE`` (one
source of data/corpus/train.jsonl; 64 of its documents score, 64 others evaluate, both
removed from the pool, the source's other documents stay in it, ~11% of the pool). 20
documents per source never enter the pool: the *general* held-out
set, which shows what selection costs on everything else.

Variants: ``name=key:value,key:value`` overrides of the default SelectionConfig
(``default`` = the shipped default, ``random`` = uniform choice from the same candidates,
``domain`` = a label oracle, not a method: half of each micro-batch drawn uniformly from
the candidates of the target's own corpus source, the rest uniformly; it shows what a
perfect *domain-level* choice gains, blind to which examples of the domain; ``ngram`` =
a model-free content baseline in the manner of DSIR: half of each micro-batch the
candidates with the highest mean log-ratio of hashed unigram/bigram frequencies, target
scoring set vs every candidate seen so far, the rest uniformly).

Prints, per target and candidate multiple, for every variant against random: the final
gain (random's target loss - the variant's), the mean gain over evaluations after warm-up
(step > 50), both with standard errors over paired seeds; data efficiency (trained
examples the variant needs to reach random's final target loss / random's; > 1: never);
general-corpus loss of both; per-step diagnostics (chosen sources, repeats, gradient norm
before clipping, clipped steps).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import loop_configs  # noqa: E402
from dattri_ds.data import load_documents, tokenize_documents, train_tokenizer  # noqa: E402
from dattri_ds.selection import OnlineSelector, SelectionConfig  # noqa: E402
from dattri_ds.selection.policy import fill_uniform  # noqa: E402
from dattri_ds.selection.content import ContentPrior  # noqa: E402

SHIPPED = {"hamlet": "data/target/hamlet.jsonl", "trivia": "data/target/trivia.jsonl",
           "code": "data/target/code.jsonl"}
#: the corpus source a shipped target comes from (the ``domain`` diagnostic variant)
OWN_SOURCE = {"hamlet": "shakespeare", "code": "python_code"}
GENERAL_PER_SOURCE = 20
CARVED_DOCS = 64
WARMUP_EVAL = 50


def parse_variant(spec: str) -> tuple[str, dict]:
    """``name`` or ``name=key:value,...`` -> (name, SelectionConfig overrides)."""
    name, _, rest = spec.partition("=")
    if name in ("random", "domain", "ngram"):
        return name, {"random": True}
    over = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition(":")
        try:
            over[k] = json.loads(v)
        except json.JSONDecodeError:
            over[k] = v
    return name, over


class Setup:
    """Tokenized pool, target scoring/eval sets and the general held-out set of one target."""

    def __init__(self, target: str, seq_len: int, target_docs: int) -> None:
        corpus = load_documents(str(ROOT / "data/corpus/train.jsonl"))
        tok = train_tokenizer([d.text for d in corpus], vocab_size=1024,
                              cache_dir=str(ROOT / "runs/cache"))
        by_src: dict[str, list] = {}
        for d in corpus:
            by_src.setdefault(d.source, []).append(d)
        general = [d for docs in by_src.values() for d in docs[-GENERAL_PER_SOURCE:]]
        if target.startswith("carve:"):
            src = target.split(":", 1)[1]
            if src not in by_src:
                raise SystemExit(f"unknown source '{src}'; known: {sorted(by_src)}")
            own = by_src[src][:-GENERAL_PER_SOURCE]
            score, evald = own[:CARVED_DOCS], own[CARVED_DOCS:2 * CARVED_DOCS]
            held = {d.id for d in score + evald}
            pool = [d for docs in by_src.values() for d in docs[:-GENERAL_PER_SOURCE]
                    if d.id not in held]
        else:
            docs = load_documents(str(ROOT / SHIPPED[target]))
            half = len(docs) // 2
            score, evald = docs[:half][:target_docs], docs[half:][:CARVED_DOCS]
            pool = [d for docs in by_src.values() for d in docs[:-GENERAL_PER_SOURCE]]
        self.tok, self.seq_len = tok, seq_len
        self.pool = tokenize_documents(pool, tok, seq_len)
        self.score = tokenize_documents(score, tok, seq_len)
        self.eval = tokenize_documents(evald, tok, seq_len)
        self.general = tokenize_documents(general, tok, seq_len)
        self.general_by_source = {src: tokenize_documents(docs[-GENERAL_PER_SOURCE:], tok,
                                                          seq_len)
                                  for src, docs in by_src.items()}
        self.sources = [d.source for d in pool]
        self.source_of = {d.id: d.source for d in pool}


@torch.no_grad()
def mean_loss(model, data, bs: int = 32, params: dict | None = None) -> float:
    """Token-mean loss of ``model`` on ``data`` (with ``params`` in place of its own
    parameters, by ``torch.func.functional_call``, when given)."""
    forward = model if params is None else (
        lambda **b: torch.func.functional_call(model, params, (), b))
    model.eval()
    tot = n = 0.0
    for i in range(0, len(data), bs):
        b = data.batch(slice(i, i + bs))
        cnt = float((b["labels"][:, 1:] != -100).sum())
        tot += float(forward(**b).loss) * cnt
        n += cnt
    model.train()
    return tot / max(n, 1)


@torch.no_grad()
def example_losses(model, batch) -> torch.Tensor:
    """``[B]`` mean token loss of every example (no dropout in this model: no RNG used)."""
    model.eval()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    model.train()
    labels = batch["labels"][:, 1:]
    tok = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels,
                                            ignore_index=-100, reduction="none")
    valid = (labels != -100).sum(1).clamp_min(1)
    return tok.sum(1) / valid


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    rx, ry = x.argsort().argsort().double(), y.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])


def diagnose(selector, model, batch, ids, step: int, chosen: torch.Tensor | None) -> dict:
    """How this micro-batch's scores relate to the candidates' gradient norms and losses, and
    how the chosen compare with all candidates (scored again: the training is unchanged)."""
    from dattri_ds.ops import norms

    grads, scores = selector.score(batch, step, ids)
    gn, loss = norms(grads).cpu().double(), example_losses(model, batch).cpu().double()
    out = {"norm_ratio": float(gn[chosen].mean() / gn.mean()),
           "loss_ratio": float(loss[chosen].mean() / loss.mean())}
    if selector.config.random:
        return out
    scores = scores.detach().cpu().double()
    return {**out, "rho_norm": spearman(scores, gn), "rho_loss": spearman(scores, loss)}


def domain_choice(sources: list[str], own: str, k: int, mix: float,
                  gen: torch.Generator) -> torch.Tensor:
    """Label oracle (diagnostic, not a method): ``k - round(mix * k)`` candidates drawn
    uniformly from those of source ``own`` (as many as there are), the rest uniformly from
    the others: a domain-level choice at selection's share, blind to which examples."""
    inside = torch.tensor([i for i, s in enumerate(sources) if s == own], dtype=torch.long)
    take = inside[torch.randperm(inside.numel(), generator=gen)[:k - round(mix * k)]]
    return fill_uniform(take, len(sources), k, gen)


def ngram_choice(prior: ContentPrior, batch: dict, k: int, mix: float,
                 gen: torch.Generator) -> torch.Tensor:
    """``k - round(mix * k)`` candidates of the highest content score (the library's
    ``ContentPrior``, alone: no gradient), the rest uniformly (selection's mix)."""
    s = prior.scores(batch["input_ids"], batch.get("attention_mask"))
    return fill_uniform(s.topk(k - round(mix * k)).indices, s.numel(), k, gen)


class Observed:
    """The selector ``loop.train`` calls, observed (and, for the diagnostic variants,
    overridden) by the benchmark: chosen sources and repeats, ``--diagnose-every``
    correlations, the ``domain`` / ``ngram`` choice in place of the selector's."""

    def __init__(self, selector, setup: Setup, sc: SelectionConfig, seed: int, model,
                 diagnose_every: int, domain: str | None, content: ContentPrior | None) -> None:
        self.inner, self.setup, self.sc, self.seed, self.model = selector, setup, sc, seed, model
        self.diagnose_every, self.domain, self.content = diagnose_every, domain, content
        self.sources, self.repeats, self.diags = Counter(), Counter(), []
        self._step, self._mb = -1, 0

    def num_candidates(self, micro: int) -> int:
        return self.inner.num_candidates(micro)

    def select(self, batch: dict, micro: int, step: int, *, user_ids, train_loss: bool):
        self._mb = self._mb + 1 if step == self._step else 0
        self._step, mb, src = step, self._mb, self.setup.source_of
        override = self.domain is not None or self.content is not None
        sel = self.inner.select(batch, micro, step, user_ids=user_ids,
                                train_loss=train_loss and not override)
        if override:  # a diagnostic replaces the choice (the loop forwards it)
            gen = torch.Generator().manual_seed(self.seed * 100003 + step * 7 + mb)
            pick = domain_choice([src[d] for d in user_ids], self.domain, micro,
                                 self.sc.uniform_mix, gen) if self.domain is not None else \
                ngram_choice(self.content, batch, micro, self.sc.uniform_mix, gen)
            sel = replace(sel, indices=pick, batch={n: v[pick] for n, v in batch.items()},
                          chosen_ids=tuple(user_ids[j] for j in pick.tolist()), loss=None)
        if self.diagnose_every and mb == 0 and step % self.diagnose_every == 0:
            self.diags.append({"step": step, **diagnose(self.inner, self.model, batch,
                                                        list(user_ids), step, sel.indices)})
        for j in sel.indices.tolist():
            self.sources[src[user_ids[j]]] += 1
            self.repeats[user_ids[j]] += 1
        return sel

    def summary(self) -> dict:
        return self.inner.summary()

    def close(self) -> None:
        self.inner.close()


def run(setup: Setup, sc: SelectionConfig, seed: int, steps: int, eval_every: int,
        micro: int = 8, gas: int = 2, diagnose_every: int = 0,
        domain: str | None = None, ngram: bool = False) -> dict:
    """Train once with the shipped loop (``train_in_process``, ``--backend torch``); return
    the eval curve and diagnostics. ``domain``: instead of the selector's choice, the label
    oracle ``domain_choice`` for that corpus source; ``ngram``: the content baseline
    ``ngram_choice``."""
    import tempfile

    from dattri_ds.launch.train import train_in_process

    ds, cfg = loop_configs(steps=steps, seed=seed, seq_len=setup.seq_len,
                           eval_every=eval_every, selection=sc, micro=micro, gas=gas)
    content = ContentPrior(setup.score.batch(slice(None))) if ngram else None
    seen: dict = {}

    def observe(selector, backend) -> Observed:
        seen["obs"] = Observed(selector, setup, sc, seed, backend.model, diagnose_every,
                               domain, content)
        seen["model"] = backend.model
        return seen["obs"]

    def evaluate() -> dict:
        model = seen["model"]
        return {"target_loss": mean_loss(model, setup.eval),
                "general_loss": mean_loss(model, setup.general),
                "by_source": {src: round(mean_loss(model, d), 4)
                              for src, d in setup.general_by_source.items()}}

    with tempfile.TemporaryDirectory(prefix="selection_effect_") as out:
        summary, backend = train_in_process(ds, cfg, setup.pool, setup.tok, Path(out),
                                            target=setup.score.batch(slice(None)),
                                            evaluator=evaluate, wrap_selector=observe)
    obs, norms = seen["obs"], backend.grad_norms
    curve = [{"step": e["step"], "examples": e["examples"], "target": e["target_loss"],
              "general": e["general_loss"], "by_source": e["by_source"]}
             for e in summary["eval"]]
    v = [st["exp_avg_sq"].mean().item() for st in backend.optimizer.state.values()]
    total = sum(obs.sources.values())
    return {"curve": curve,
            "sources": {s: round(c / total, 3) for s, c in obs.sources.most_common()},
            "max_repeat": max(obs.repeats.values()), "distinct": len(obs.repeats),
            "grad_norm": statistics.mean(norms),
            "clip_frac": sum(n > backend.clip for n in norms) / steps,
            "adam_v": statistics.mean(v), "diagnostics": obs.diags,
            "mean_chosen_score": summary["selection"]["mean_chosen_score"],
            "mean_candidate_score": summary["selection"]["mean_candidate_score"]}


def interp_examples(curve: list[dict], level: float) -> float:
    """Trained examples at which ``curve`` (linear between evals) first reaches ``level``."""
    for a, b in zip(curve, curve[1:]):
        if b["target"] <= level:
            if a["target"] == b["target"]:
                return b["examples"]
            f = (a["target"] - level) / (a["target"] - b["target"])
            return a["examples"] + max(0.0, f) * (b["examples"] - a["examples"])
    return float("inf")


def se(xs: list[float]) -> float:
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def compare(runs: dict[str, list[dict]], name: str) -> dict:
    """Paired statistics of variant ``name`` against ``random`` (lists in seed order)."""
    final, after, eff, gen = [], [], [], []
    for r, v in zip(runs["random"], runs[name]):
        final.append(r["curve"][-1]["target"] - v["curve"][-1]["target"])
        pts = [(a["target"] - b["target"]) for a, b in zip(r["curve"], v["curve"])
               if a["step"] > WARMUP_EVAL]
        after.append(statistics.mean(pts) if pts else float("nan"))
        eff.append(interp_examples(v["curve"], r["curve"][-1]["target"])
                   / r["curve"][-1]["examples"])
        gen.append(v["curve"][-1]["general"] - r["curve"][-1]["general"])
    finite = [e for e in eff if math.isfinite(e)]
    return {"n": len(final), "final": statistics.mean(final), "final_se": se(final),
            "after": statistics.mean(after), "after_se": se(after),
            "eff_median": statistics.median(eff) if eff else float("nan"),
            "eff_reached": f"{len(finite)}/{len(eff)}",
            "general_cost": statistics.mean(gen), "general_cost_se": se(gen),
            "random_general": statistics.mean(r["curve"][-1]["general"]
                                              for r in runs["random"]),
            "wins": sum(f > 0 for f in final)}


def fmt(name: str, c: dict) -> str:
    return (f"  {name:<12} final gain {c['final']:+.4f} +- {c['final_se']:.4f} "
            f"(wins {c['wins']}/{c['n']}) | gain after warm-up {c['after']:+.4f} +- "
            f"{c['after_se']:.4f} | data efficiency median {c['eff_median']:.2f} "
            f"(reached {c['eff_reached']}) | general loss {c['general_cost']:+.4f} +- "
            f"{c['general_cost_se']:.4f} vs random's {c['random_general']:.4f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=["hamlet", "trivia", "code"])
    p.add_argument("--multiples", nargs="+", type=float, default=[4.0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed-offset", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--target-docs", type=int, default=64,
                   help="scoring documents of a shipped target (its first half, capped)")
    p.add_argument("--variants", nargs="+", default=["default", "random"])
    p.add_argument("--log", help="append per-seed results and summaries to this file")
    p.add_argument("--results", help="append one JSON record per run to this jsonl file "
                   "(target, multiple, seed, variant, curve, diagnostics), so a benchmark "
                   "split over processes (--seed-offset, --targets) can be summarized at once")
    p.add_argument("--summarize", nargs="+", metavar="JSONL",
                   help="print the paired tables of these --results files and exit (every "
                   "variant against random on the seeds both ran; nothing is trained)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--diagnose-every", type=int, default=0,
                   help="every N steps, also record how the candidates' scores correlate "
                   "with their gradient norms and losses, and the chosen/candidate mean "
                   "gradient-norm and loss ratios (one extra probe; training unchanged)")
    args = p.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return
    torch.set_num_threads(args.threads)
    variants = dict(parse_variant(v) for v in args.variants)
    log = open(args.log, "a", encoding="utf-8") if args.log else None
    results = open(args.results, "a", encoding="utf-8") if args.results else None

    def out(line: str) -> None:
        print(line, flush=True)
        if log:
            log.write(line + "\n")
            log.flush()

    out(f"# {time.strftime('%H:%M:%S')} selection_effect {' '.join(sys.argv[1:])}")
    for target in args.targets:
        setup = Setup(target, args.seq_len, args.target_docs)
        for mult in args.multiples:
            runs: dict[str, list[dict]] = {n: [] for n in variants}
            for seed in range(args.seed_offset, args.seed_offset + args.seeds):
                for name, over in variants.items():
                    sc = replace(SelectionConfig(enabled=True, target_data="<benchmark>"),
                                 candidate_multiple=mult, **over)
                    t0 = time.process_time()
                    own = OWN_SOURCE.get(target, target.partition(":")[2] or None)
                    if name == "domain" and own is None:
                        raise SystemExit(f"the 'domain' variant needs a target with a corpus "
                                         f"source (hamlet, code, carve:SOURCE), not {target}")
                    r = run(setup, sc, seed, args.steps, args.eval_every,
                            diagnose_every=args.diagnose_every,
                            domain=own if name == "domain" else None,
                            ngram=name == "ngram")
                    r["cpu_s"] = time.process_time() - t0
                    runs[name].append(r)
                    if results:
                        results.write(json.dumps({"target": target, "multiple": mult,
                                                  "seed": seed, "variant": name,
                                                  "steps": args.steps, **r}) + "\n")
                        results.flush()
                    c = r["curve"][-1]
                    out(f"{target} x{mult:g} seed {seed} {name:<12} target {c['target']:.4f} "
                        f"general {c['general']:.4f} cpu {r['cpu_s']:.0f}s | "
                        f"grad_norm {r['grad_norm']:.2f} clip {r['clip_frac']:.2f} "
                        f"adam_v {r['adam_v']:.2e} repeat<= {r['max_repeat']} "
                        f"distinct {r['distinct']} score chosen/cand "
                        f"{r['mean_chosen_score']:.3g}/{r['mean_candidate_score']:.3g} | "
                        f"{json.dumps(r['sources'])} | curve "
                        f"{[round(x['target'], 3) for x in r['curve']]}")
            if "random" not in runs:
                continue  # nothing to pair with here (--summarize pairs across files)
            out(f"== {target} x{mult:g}, {args.seeds} paired seeds, {args.steps} steps "
                f"(random final target loss "
                f"{statistics.mean(r['curve'][-1]['target'] for r in runs['random']):.4f})")
            for name in variants:
                if name != "random" and "random" in runs:
                    out(fmt(name, compare(runs, name)))
    for f in (log, results):
        if f:
            f.close()


def details(runs: dict[str, list[dict]], name: str) -> str:
    """Diagnostics of ``name`` vs random: in-domain/source shares, per-source general loss
    at the end (variant - random, mean over seeds), score correlations (--diagnose-every)."""
    def mean_share(rs):
        keys = {k for r in rs for k in r["sources"]}
        return {k: statistics.mean(r["sources"].get(k, 0.0) for r in rs) for k in keys}

    share, rshare = mean_share(runs[name]), mean_share(runs["random"])
    top = sorted(share, key=lambda k: share[k] - rshare.get(k, 0.0), reverse=True)[:2]
    parts = [f"most enriched: " + ", ".join(f"{k} {share[k]:.0%} (random {rshare.get(k, 0):.0%})"
                                            for k in top)]
    pairs = [(r["curve"][-1].get("by_source"), v["curve"][-1].get("by_source"))
             for r, v in zip(runs["random"], runs[name])]
    if all(a and b for a, b in pairs):
        srcs = sorted(pairs[0][0])
        d = {k: statistics.mean(b[k] - a[k] for a, b in pairs) for k in srcs}
        parts.append("general loss by source vs random: " +
                     " ".join(f"{k} {v:+.3f}" for k, v in d.items()))
    diags = [x for r in runs[name] for x in r.get("diagnostics", [])]
    if diags and "rho_norm" in diags[0]:
        m = {k: statistics.mean(x[k] for x in diags)
             for k in ("rho_norm", "rho_loss", "norm_ratio", "loss_ratio")}
        parts.append(f"spearman(score, |g|) {m['rho_norm']:+.2f}, (score, loss) "
                     f"{m['rho_loss']:+.2f}; chosen/candidates |g| {m['norm_ratio']:.2f}, "
                     f"loss {m['loss_ratio']:.2f} ({len(diags)} micro-batches)")
    parts.append(f"adam v {statistics.mean(r['adam_v'] for r in runs[name]):.2e} (random "
                 f"{statistics.mean(r['adam_v'] for r in runs['random']):.2e}), clipped "
                 f"{statistics.mean(r['clip_frac'] for r in runs[name]):.2f} (random "
                 f"{statistics.mean(r['clip_frac'] for r in runs['random']):.2f})")
    return " | ".join(parts)


def summarize(paths: list[str]) -> None:
    """Paired tables from ``--results`` files: per target and multiple, every variant against
    random over the seeds both ran (a later record of the same run replaces an earlier one)."""
    recs: dict[tuple, dict] = {}
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                recs[(r["target"], r["multiple"], r["steps"], r["variant"], r["seed"])] = r
    groups = sorted({k[:3] for k in recs}, key=str)
    for target, mult, steps in groups:
        names = sorted({k[3] for k in recs if k[:3] == (target, mult, steps)})
        if "random" not in names:
            print(f"== {target} x{mult:g}, {steps} steps: no random runs to pair with")
            continue
        rnd = {k[4] for k in recs if k[:4] == (target, mult, steps, "random")}
        print(f"== {target} x{mult:g}, {steps} steps")
        for name in names:
            if name == "random":
                continue
            seeds = sorted(rnd & {k[4] for k in recs if k[:4] == (target, mult, steps, name)})
            if not seeds:
                continue
            runs = {n: [recs[(target, mult, steps, n, s)] for s in seeds]
                    for n in ("random", name)}
            cpu = statistics.mean(r["cpu_s"] for r in runs[name])
            rcpu = statistics.mean(r["cpu_s"] for r in runs["random"])
            print(fmt(name, compare(runs, name)) + f" | seeds {seeds} | cpu {cpu:.0f}s "
                  f"(random {rcpu:.0f}s)")
            print("      " + details(runs, name))


if __name__ == "__main__":
    main()
