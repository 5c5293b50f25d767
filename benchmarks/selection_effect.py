"""Does online selection help, at equal data and at equal compute? Paired seeds vs uniform choice.

    python benchmarks/selection_effect.py --targets hamlet trivia code --multiples 4 2 \\
        --seeds 5 --steps 200 --variants default random [--log /work/notes/sel-bench.txt]
    python benchmarks/selection_effect.py --targets carve:austen noisy:trivia:all \\
        --seeds 3 --steps 100 --eval-every 20 --random-steps 300 \\
        --variants random content=score:content default grad=content_weight:0 --results F
    python benchmarks/selection_effect.py --summarize F [G ...]

One process, one thread (the effect of the choice does not depend on ZeRO), trained by the
shipped loop (``launch.train.train_in_process``: launch/loop.py on ``--backend torch``,
the selector of launch/train.py, forward reuse as configured): tiny GPT-2
(configs/model_gpt2_tiny.json), the optimizer, lr schedule and clipping of
configs/zero3_cpu.json (AdamW lr 2e-3, DeepSpeed WarmupCosineLR: 20 log-warmup steps then
cosine to 0.1 at step 300, then flat; gradient clipping 1.0), micro-batch 8 x 2
accumulation = 16 trained examples per step, seq_len 64. The pool is prepared as launch
prepares ``--train-data`` (``dattri-ds prepare`` with the shipped SentencePiece BPE 1024,
cached under runs/cache/pools/) and trained on as ``PackedDataset`` windows of seq_len
tokens over the packed documents; the scoring, evaluation and general sets stay one
example per document (what the launch's target and evaluator read). Every variant of a
seed starts from the same initialization and sees the same candidate stream.

Targets: ``hamlet``, ``trivia``, ``code`` (data/target/*.jsonl: first half = the scoring
set selection sees, second half = the held-out evaluation set) or ``carve:SOURCE`` (one
source of data/corpus/train.jsonl; 64 of its documents score, 64 others evaluate, both
removed from the pool, the source's other documents stay in it, ~11% of the pool), or
``noisy:<target>:<kinds>`` (benchmarks/_noisy_pools.py: ``<target>``'s pool plus junk
built from its non-evaluation text, ``--junk-per-kind`` documents of each kind: near-
duplicates, boilerplate, shuffled words, garbled characters, corrupted words, QA pairs
with wrong answers, code that does not parse; ``tune``/``heldout``/``all`` or a comma
list; the ``heldout`` kinds are reported apart and no setting may be tuned on them). 20
documents per source never enter the pool: the *general* held-out set, which shows what
selection costs on everything else.

Variants: ``name=key:value,key:value`` overrides of the default SelectionConfig
(``default`` = the shipped default, ``random`` = uniform choice from the same candidates,
``domain`` = a label oracle, not a method: half of each micro-batch drawn uniformly from
the candidates of the target's own corpus source, the rest uniformly; it shows what a
perfect *domain-level* choice gains, blind to which examples of the domain; ``ngram`` =
a model-free content baseline in the manner of DSIR: half of each micro-batch the
candidates with the highest mean log-ratio of hashed unigram/bigram frequencies, target
scoring set vs every candidate seen so far, the rest uniformly).

Compute: every evaluation point records ``cpu_s``, the training process's CPU-seconds
(``time.process_time``, one thread) since the step-0 evaluation, evaluations excluded (the
process's first steps are paid by a discarded warm-up run). ``--random-steps N`` trains
the random arm N steps (same lr schedule, so its first ``--steps`` are exactly the short
run): benchmarks/_compute.py reads its curve at each variant's CPU-seconds.

Prints, per target and candidate multiple, for every variant against random: the final
gain (random's target loss - the variant's), the mean gain over evaluations after warm-up
(step > 50), both with standard errors over paired seeds; data efficiency (trained
examples the variant needs to reach random's final target loss / random's; > 1: never);
general-corpus loss of both; at equal compute: the gain against random read at the
variant's CPU-seconds, the gain of the variant read at random's CPU-seconds, and the
CPU-seconds each needs to reach random's final loss (ratio variant / random); the junk
share of trained examples per kind (noisy pools, held-out kinds apart); per-step
diagnostics (chosen sources, repeats, gradient norm before clipping, clipped steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _noisy_pools as noisy  # noqa: E402
from benchmarks._common import loop_configs  # noqa: E402
from benchmarks._compute import compare, details, fmt, summarize, truncate  # noqa: E402
from dattri_ds.data import load_documents, tokenize_documents, train_tokenizer  # noqa: E402
from dattri_ds.selection import SelectionConfig  # noqa: E402
from dattri_ds.selection.policy import fill_uniform  # noqa: E402
from dattri_ds.selection.content import ContentPrior  # noqa: E402

SHIPPED = {"hamlet": "data/target/hamlet.jsonl", "trivia": "data/target/trivia.jsonl",
           "code": "data/target/code.jsonl"}
#: the corpus source a shipped target comes from (the ``domain`` diagnostic variant)
OWN_SOURCE = {"hamlet": "shakespeare", "code": "python_code"}
GENERAL_PER_SOURCE = 20
CARVED_DOCS = 64


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


def prepared_pool(docs: list, tokenizer_model: Path, seq_len: int, packing: str = "windows"):
    """The pool as launch trains on it: written as jsonl, prepared once with the shipped
    tokenizer (cached by content under runs/cache/pools/), opened as ``seq_len`` windows
    (``packing``: launch's ``--packing``)."""
    import hashlib

    from dattri_ds.data.packed import PackedDataset
    from dattri_ds.data.prepare import PrepareConfig, prepare

    lines = "".join(json.dumps(d.to_dict()) + "\n" for d in docs)
    key = hashlib.blake2b(lines.encode(), digest_size=8).hexdigest()
    folder = ROOT / "runs/cache/pools"
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"{key}.jsonl"
    if not src.exists():
        src.write_text(lines, encoding="utf-8")
    prepare(PrepareConfig(input=(str(src),), output_prefix=str(folder / key),
                          tokenizer=str(tokenizer_model), workers=1))
    return PackedDataset(str(folder / key), seq_len, packing=packing)


class Setup:
    """Prepared pool (windows), target scoring/eval sets and the general held-out set of one
    target (one example per document)."""

    def __init__(self, target: str, seq_len: int, target_docs: int,
                 per_kind: int = noisy.PER_KIND, packing: str = "windows") -> None:
        kinds: tuple[str, ...] = ()
        if target.startswith("noisy:"):
            target, kinds = noisy.parse_noisy(target)
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
            extra = []
            held = {d.id for d in score + evald}
            pool = [d for docs in by_src.values() for d in docs[:-GENERAL_PER_SOURCE]
                    if d.id not in held]
        else:
            score, extra, evald = noisy.shipped_split(
                load_documents(str(ROOT / SHIPPED[target])), target_docs, CARVED_DOCS)
            pool = [d for docs in by_src.values() for d in docs[:-GENERAL_PER_SOURCE]]
        if kinds:  # junk made of the scoring + leftover first-half docs, never of evald
            pool += noisy.clean_extra(target, extra) + noisy.build_junk(
                target, kinds, score + extra, per_kind)
        from dattri_ds.data.tokenizers import open_tokenizer

        tok = open_tokenizer(tok.path)  # the corpus tokenizer: documents as prepare stores them
        self.tok, self.seq_len, self.docs = tok, seq_len, pool
        self.pool = prepared_pool(pool, tok.source, seq_len, packing)
        self.score = tokenize_documents(score, tok, seq_len)
        self.eval = tokenize_documents(evald, tok, seq_len)
        self.general = tokenize_documents(general, tok, seq_len)
        self.general_by_source = {src: tokenize_documents(docs[-GENERAL_PER_SOURCE:], tok,
                                                          seq_len)
                                  for src, docs in by_src.items()}
        examples = [self.pool.docs[i] for i in range(len(self.pool))]
        self.sources = [e.source for e in examples]  # a window's: its first document's
        self.source_of = {e.id: e.source for e in examples}


@torch.no_grad()
def loss_sum(model, data, bs: int = 32, params: dict | None = None) -> tuple[float, float]:
    """(summed token loss, tokens) of ``model`` on ``data`` (with ``params`` in place of its
    own parameters, by ``torch.func.functional_call``, when given)."""
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
    return tot, n


def mean_loss(model, data, bs: int = 32, params: dict | None = None) -> float:
    """Token-mean loss of ``model`` on ``data`` (``loss_sum``'s ratio)."""
    tot, n = loss_sum(model, data, bs, params)
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
    """How this micro-batch's scores relate to the candidates' losses (and gradient norms,
    for a gradient score), and how the chosen compare with all candidates (scored again: the
    training is unchanged). The uniform and content arms probe no gradient: losses only."""
    from dattri_ds.ops import norms

    loss = example_losses(model, batch).cpu().double()
    out = {"loss_ratio": float(loss[chosen].mean() / loss.mean())}
    if selector.config.random:
        return out
    grads, scores = selector.score(batch, step, ids)
    scores = scores.detach().cpu().double()
    out["rho_loss"] = spearman(scores, loss)
    if grads.layers:
        gn = norms(grads).cpu().double()
        out.update(norm_ratio=float(gn[chosen].mean() / gn.mean()),
                   rho_norm=spearman(scores, gn))
    return out


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

    def __getattr__(self, name: str):  # the rest of the selector (state_dict, ...) as is
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

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
        domain: str | None = None, ngram: bool = False, general_every: int = 0) -> dict:
    """Train once with the shipped loop (``train_in_process``, ``--backend torch``); return
    the eval curve and diagnostics. ``domain``: instead of the selector's choice, the label
    oracle ``domain_choice`` for that corpus source; ``ngram``: the content baseline
    ``ngram_choice``; ``general_every``: evaluate the general held-out set at the multiples of
    this step (0: at the last step only)."""
    import tempfile

    from dattri_ds.launch.train import train_in_process

    ds, cfg = loop_configs(steps=steps, seed=seed, seq_len=setup.seq_len,
                           eval_every=eval_every, selection=sc, micro=micro, gas=gas)
    content = ContentPrior(setup.score.batch(slice(None))) if ngram else None
    seen: dict = {"eval_cpu": 0.0, "calls": 0}
    # the steps RunLog evaluates at: 0, every eval_every-th, the last
    at = [0] + [n for n in range(1, steps + 1) if n % eval_every == 0 or n == steps]

    def observe(selector, backend) -> Observed:
        seen["obs"] = Observed(selector, setup, sc, seed, backend.model, diagnose_every,
                               domain, content)
        seen["model"] = backend.model
        return seen["obs"]

    def evaluate() -> dict:
        """Target loss; the general set (by source) at multiples of ``general_every`` only;
        ``cpu_s``: training CPU-seconds since the step-0 evaluation, evaluations excluded
        (the set-up before it is the same for every arm)."""
        start = time.process_time()
        seen.setdefault("t0", start)
        step = at[min(seen["calls"], len(at) - 1)]
        seen["calls"] += 1
        model = seen["model"]
        out = {"target_loss": mean_loss(model, setup.eval),
               "cpu_s": start - seen["t0"] - seen["eval_cpu"]}
        if step and step % (general_every or steps) == 0:
            parts = {src: loss_sum(model, d) for src, d in setup.general_by_source.items()}
            out["general_loss"] = sum(t for t, _ in parts.values()) / sum(
                n for _, n in parts.values())
            out["by_source"] = {src: round(t / n, 4) for src, (t, n) in parts.items()}
        seen["eval_cpu"] += time.process_time() - start
        return out

    with tempfile.TemporaryDirectory(prefix="selection_effect_") as out:
        summary, backend = train_in_process(ds, cfg, setup.pool, setup.tok, Path(out),
                                            target=setup.score.batch(slice(None)),
                                            evaluator=evaluate, wrap_selector=observe)
    obs, norms = seen["obs"], backend.grad_norms
    curve = [{"step": e["step"], "examples": e["examples"], "target": e["target_loss"],
              "general": e.get("general_loss"), "by_source": e.get("by_source"),
              "cpu_s": round(e["cpu_s"], 3)} for e in summary["eval"]]
    v = [st["exp_avg_sq"].mean().item() for st in backend.optimizer.state.values()]
    total = sum(obs.sources.values())
    return {"curve": curve,
            "sources": {s: round(c / total, 3) for s, c in obs.sources.most_common()},
            "max_repeat": max(obs.repeats.values()), "distinct": len(obs.repeats),
            "grad_norm": statistics.mean(norms),
            "clip_frac": sum(n > backend.clip for n in norms) / steps,
            "adam_v": statistics.mean(v), "diagnostics": obs.diags,
            "mean_chosen_score": summary["selection"]["mean_chosen_score"],
            "mean_candidate_score": summary["selection"]["mean_candidate_score"],
            "selection_config": _jsonable(asdict(sc)),
            "selection_summary": _jsonable(summary["selection"])}


def _jsonable(x):
    """``x`` with tensors and other non-JSON leaves as numbers or strings."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x if isinstance(x, (int, float, str, bool, type(None))) else str(x)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=["hamlet", "trivia", "code"])
    p.add_argument("--multiples", nargs="+", type=float, default=[4.0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed-offset", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--packing", default="windows", choices=("windows", "documents"),
                   help="the pool's examples, as launch's --packing")
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
    p.add_argument("--random-steps", type=int, default=None,
                   help="train the random arm this many steps (default --steps): its curve "
                   "up to --steps gives the equal-examples columns, beyond them the "
                   "equal-compute ones (random read at each variant's CPU-seconds)")
    p.add_argument("--junk-per-kind", type=int, default=noisy.PER_KIND,
                   help="junk documents per kind in a noisy:<target>:<kinds> pool")
    p.add_argument("--markdown", action="store_true",
                   help="with --summarize: print the tables as markdown")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--diagnose-every", type=int, default=0,
                   help="every N steps, also record how the candidates' scores correlate "
                   "with their gradient norms and losses, and the chosen/candidate mean "
                   "gradient-norm and loss ratios (one extra probe; training unchanged)")
    args = p.parse_args(argv)
    if args.summarize:
        summarize(args.summarize, markdown=args.markdown)
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
    warmed = False
    for target in args.targets:
        setup = Setup(target, args.seq_len, args.target_docs, args.junk_per_kind, args.packing)
        if not warmed:  # the process's first steps pay one-off costs: not in any arm's CPU
            run(setup, SelectionConfig(enabled=True, target_data="<benchmark>", random=True),
                10**6, 3, 3)
            warmed = True
        for mult in args.multiples:
            runs: dict[str, list[dict]] = {n: [] for n in variants}
            for seed in range(args.seed_offset, args.seed_offset + args.seeds):
                for name, over in variants.items():
                    sc = SelectionConfig(enabled=True, target_data="<benchmark>",
                                         candidate_multiple=mult, **over)
                    t0 = time.process_time()
                    base = noisy.parse_noisy(target)[0] if target.startswith("noisy:") \
                        else target
                    own = OWN_SOURCE.get(base, base.partition(":")[2] or None)
                    steps = (args.random_steps or args.steps) if name == "random" \
                        else args.steps
                    if name == "domain" and own is None:
                        raise SystemExit(f"the 'domain' variant needs a target with a corpus "
                                         f"source (hamlet, code, carve:SOURCE), not {target}")
                    r = run(setup, sc, seed, steps, args.eval_every,
                            diagnose_every=args.diagnose_every, general_every=args.steps,
                            domain=own if name == "domain" else None,
                            ngram=name == "ngram")
                    r["cpu_s"] = time.process_time() - t0
                    runs[name].append(r)
                    if results:
                        results.write(json.dumps({"target": target, "multiple": mult,
                                                  "seed": seed, "variant": name,
                                                  "steps": steps, **r}) + "\n")
                        results.flush()
                    c = truncate(r["curve"], args.steps)[-1]
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
                f"{statistics.mean(truncate(r['curve'], args.steps)[-1]['target'] for r in runs['random']):.4f})")
            for name in variants:
                if name != "random" and "random" in runs:
                    out(fmt(name, compare(runs, name, args.steps)))
                    out("      " + details(runs, name))
    for f in (log, results):
        if f:
            f.close()


if __name__ == "__main__":
    main()
