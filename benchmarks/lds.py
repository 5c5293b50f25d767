"""Built-in LDS benchmark: attribution methods scored against retraining on random subsets.

A tiny GPT-2 (2 layers, n_embd 64, T = 64, SentencePiece vocabulary 512) is trained on N
documents of ``data/tiny/train.jsonl`` (its first N; ``--train-data``: another pool, drawn
round-robin over its sources, e.g. ``data/corpus/train.jsonl --exclude-data
data/tiny/train.jsonl``; ``--model-config``: another architecture, e.g. a Llama;
``--tokenizer char``: a character-level vocabulary, about 107 pieces, at T = 128, which
holds about as much text as T = 64 BPE tokens); the queries are Hamlet chunks of
``data/tiny/target.jsonl`` and a few ``data/target/code.jsonl`` functions (``--queries
heldout``: documents of the same pool that are not trained on). Every method
(``graddot``, ``gradcos``, ``tracin`` and ``kfac-trajectory`` / ``ekfac-trajectory`` over
checkpoints of the full run, ``kfac``, ``ekfac`` on the final model; all through
``make_attributor``) scores the N documents against the queries with ``GradientCapture``
per-example gradients, under every ``--projections`` setting: ``exact`` (factorized,
unprojected), ``dense:k`` / ``sparse:k`` / ``kronecker:k`` (training rows projected per
layer to k, as a store holds them; curvature factors stay exact and the query is
preconditioned exactly, then projected), ``logra:k`` (Kronecker projection with the factors
fitted in the projected space), ``whitened-<kind>:k`` (rows whitened by the curvature
factors, then projected: what ``collect --whiten`` stores). Curvature methods run at each
``--dampings`` x ``--powers`` value on the exact setting (projected settings at the
first of each). ``tfidf``
(TF-IDF of character n-grams of the text each row holds, ``dattri_ds.eval.tfidf_scores``)
is the model-free text-overlap baseline of the issue-14 benchmark. ``--hybrid-weights``
adds, for every exact-setting row of a method m, the rows ``m+<w>*tfidf``: per query
``z(m) + w z(tfidf)`` with ``z`` the standardization over the training rows (``add_hybrids``).
The same model is then retrained from the same initialization on S random half subsets,
and each method's Linear Datamodeling Score is the mean over queries of the Spearman
correlation between ``-(mask @ scores)`` and the retrained query losses
(``dattri_ds.eval.lds``).

Usage::

    python benchmarks/lds.py [--quick] [--out runs/lds] [--seed 1] [--dampings 0.1,0.01] ...

The fidelity-cost table (method, projection, damping, power, LDS mean +- std over queries,
single-thread CPU seconds, fp32 bytes per stored training row, Pearson r of the scores with
the same method's exact scores,
``*`` = best at its cost: no row has a higher LDS (over seeds: by more than the paired
standard error) for fewer CPU
seconds, ``(default)`` = what ``tools/attribute.py`` runs by default) is printed and written
to ``<out>/lds.md``; everything else (config, per-query correlations, retrained losses) to
``<out>/lds.json``. The CPU seconds of a row (``time.process_time`` at ``--threads 1``)
are its own work (projection, factor fitting, scoring) plus the gradient captures it reads
(every checkpoint's for trajectories, the final model's otherwise); retraining is
excluded. ``--quick`` is a smaller preset (about 30 s); the default (N = 128, S = 32
subsets x 2 seeds) about 3 minutes on an idle core. ``--repeats R`` runs seeds
``--seed .. --seed+R-1`` (each into ``<out>/seed<s>/``; a seed already run with the same
settings is reused) and tabulates mean +- standard error over seeds, with each row's share
of the same method's exact LDS. A saved seed whose settings differ only in how it is
scored (``SCORING``: methods, projections, dampings, powers, hybrid weights) keeps its
ground truth (subset masks, retrained query losses, seed agreement, full-model query
losses): the full run is trained and captured again for the scores, the subsets are not
retrained (``--retrain`` forces it); the report's ``ground_truth.reused_from`` names the
source.

Training is plain Adam (or ``--optimizer sgd``) at a constant learning rate; every run,
full or subset, starts from the same initialization and visits its documents in the
order of one seeded permutation per epoch. TracIn weights its checkpoints by that
constant rate (with Adam the rate is nominal: TracIn's SGD derivation does not hold).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from dattri_ds import Checkpoint, KFACConfig, ProjectionConfig, collect
from dattri_ds.data import (
    Document, TokenizedDocuments, load_documents, source_counts, tokenize_documents,
    train_tokenizer,
)
from dattri_ds.models.causal_lm import build_model, load_model_config
from dattri_ds.errors import ConfigError
from dattri_ds.eval import lds, predicted, retrain_losses, subset_masks, tfidf_scores, zscore
from dattri_ds.methods import registered_attributors
from dattri_ds.methods.recipe import Recipe
from dattri_ds.ops.projection import KINDS, Projector, projection_kind
from dattri_ds.io.schema import add_flag

logger = logging.getLogger("benchmarks.lds")

ROOT = Path(__file__).resolve().parents[1]
#: Every registered attribution method (``class M(Attributor, name="m")``): plain ones first,
#: then curvature, trajectories after single checkpoints.
METHODS = tuple(sorted(registered_attributors(), key=lambda m: (
    Recipe(method=m).curvature, Recipe(method=m).trajectory, m)))
#: Model-free reference rows (exact setting only): TF-IDF of character n-grams
#: (``dattri_ds.eval.tfidf_scores``), the text-overlap baseline of the issue-14 benchmark.
BASELINES = ("tfidf",)
#: What ``tools/attribute.py`` runs by default (chosen by this table: docs/attribution_fidelity.md).
DEFAULT_METHOD = "ekfac-trajectory"
CURVATURE = tuple(m for m in METHODS if Recipe(method=m).curvature)
#: Projection settings: every kind of the projection registry, LoGra, and whitened rows.
SETTING_KINDS = KINDS + ("logra",) + tuple(f"whitened-{k}" for k in KINDS)
#: Settings that only curvature methods have (factors in the projected space, or whitened).
CURVATURE_ONLY = ("logra",) + tuple(f"whitened-{k}" for k in KINDS)
MODEL = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 64,
         "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
         "attn_pdrop": 0.0, "tie_word_embeddings": False}
#: ``--tokenizer`` choices (``train_tokenizer``'s model type) and each one's default T: a
#: character holds about half the text of a BPE-512 piece on this pool (2.07 chars/piece).
TOKENIZERS = ("bpe", "char")
SEQ_LEN = {"bpe": 64, "char": 128}
#: The default pool of training documents, and ``--draw`` orders (``eligible_pool``).
DEFAULT_TRAIN_DATA = "data/tiny/train.jsonl"
DRAWS = ("prefix", "round-robin")
#: Query sets of ``--queries`` (``load_data``).
QUERY_SETS = ("target", "heldout")
PRESETS = {
    "default": dict(n_train=128, subsets=32, seeds=2, epochs=6,
                    projections="exact,sparse:1024,whitened-sparse:4096,logra:1024"),
    "quick": dict(n_train=64, subsets=8, seeds=1, epochs=4, projections="exact,dense:64"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/lds", help="output directory (lds.json, lds.md)")
    p.add_argument("--quick", action="store_true", help="smaller preset (about 30 s)")
    add_flag(p, "--n-train", int, ge=1,
             help="training documents (the first of the --train-data pool, in --draw order)")
    p.add_argument("--train-data", default=DEFAULT_TRAIN_DATA,
                   help="JSONL pool of training documents (and of --queries heldout queries); "
                   "a relative path is read from the repository root")
    p.add_argument("--draw", choices=DRAWS, default=None,
                   help="order in which the pool is drawn: prefix (file order) or "
                   "round-robin (shuffled within each source by --seed, one source at a "
                   "time); default: prefix for the default pool, round-robin for another")
    p.add_argument("--exclude-data", default=None,
                   help="comma-separated JSONL files whose documents (same id or text) are "
                   "never drawn, e.g. data/tiny/train.jsonl to draw a disjoint pool from "
                   "data/corpus/train.jsonl")
    add_flag(p, "--subsets", int, ge=1,
             help="random subsets retrained (S)")
    add_flag(p, "--seeds", int, ge=1,
             help="training seeds averaged per subset")
    add_flag(p, "--epochs", int, ge=1,
             help="epochs of every training run")
    p.add_argument("--projections", help="comma-separated settings: exact or <kind>:<k> "
                   f"(k per layer), kind in {SETTING_KINDS}")
    p.add_argument("--methods", default=",".join(METHODS + BASELINES),
                   help="comma-separated methods")
    add_flag(p, "--fraction", float, gt=0, lt=1,
             default=0.5, help="subset size / N")
    add_flag(p, "--n-hamlet", int, ge=0,
             default=8, help="Hamlet queries")
    add_flag(p, "--n-code", int, ge=0,
             default=2, help="code queries")
    p.add_argument("--queries", choices=QUERY_SETS, default="target",
                   help="target: --n-hamlet Hamlet chunks and --n-code code functions (out "
                   "of the training distribution); heldout: --n-heldout documents of the "
                   "pool that are not trained on (in distribution, all sources)")
    add_flag(p, "--n-heldout", int, ge=1,
             default=10, help="held-out queries (--queries heldout)")
    p.add_argument("--model-config", default=None,
                   help="JSON model config (dattri_ds.models.causal_lm.build_model: gpt2 or llama, e.g. "
                   "configs/model_llama_tiny.json) instead of the built-in 2 x 64 GPT-2")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="tie the output projection to the token embedding (GPT-2's default)")
    add_flag(p, "--seq-len", int, ge=1,
             help="tokens per document (T; default: bpe 64, char 128, about the same text); "
             "the model's positions are raised to T when it has fewer")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="bpe",
                   help="SentencePiece model type trained on the pool: bpe (subwords) or char "
                   "(one piece per character seen, at most --vocab-size)")
    add_flag(p, "--vocab-size", int, ge=1,
             default=512, help="SentencePiece vocabulary")
    add_flag(p, "--batch-size", int, ge=1,
             default=16, help="training batch size")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="Adam or SGD with momentum 0.9, constant learning rate")
    add_flag(p, "--lr", float, gt=0,
             help="learning rate (default: adam 3e-3, sgd 0.1)")
    add_flag(p, "--checkpoints", int, ge=1, default=5,
             help="checkpoints of the trajectory methods")
    p.add_argument("--dampings", default=None,
                   help="comma-separated relative dampings of the curvature methods, all "
                        "run on the exact setting; projected settings use the first "
                        "(default: the library default KFACConfig().damping)")
    p.add_argument("--powers", default=None,
                   help="comma-separated exponents of the curvature inverse "
                        "(KFACConfig.power), crossed with --dampings on the exact setting "
                        "(default: the library default)")
    p.add_argument("--hybrid-weights", default=None,
                   help="comma-separated weights w >= 0: for every method m of --methods on "
                   "the exact setting (each damping and power) add the row "
                   "'m+<w>*tfidf' scoring z(m) + w z(tfidf) per query (needs tfidf in "
                   "--methods; no new captures)")
    add_flag(p, "--repeats", int, ge=1, default=1,
             help="run seeds --seed .. --seed+R-1 into <out>/seed<s>/ (a finished "
             "seed with the same settings is reused) and tabulate mean +- s.e.")
    p.add_argument("--retrain", action="store_true",
                   help="retrain the subsets even when <out> (or <out>/seed<s>/) holds a "
                   "saved seed with the same ground-truth settings (by default its masks "
                   "and retrained losses are reused and only the scores are recomputed)")
    add_flag(p, "--threads", int, ge=1,
             default=1, help="torch CPU threads")
    p.add_argument("--cache-dir", default=None, help="tokenizer cache directory")
    add_flag(p, "--seed", int, ge=0,
             default=0, help="init, data and subset seed")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for k, v in PRESETS["quick" if args.quick else "default"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.lr is None:
        args.lr = 0.1 if args.optimizer == "sgd" else 3e-3
    if args.seq_len is None:
        args.seq_len = SEQ_LEN[args.tokenizer]
    if args.draw is None:
        args.draw = "prefix" if args.train_data == DEFAULT_TRAIN_DATA else "round-robin"
    args.exclude_data = ([t.strip() for t in args.exclude_data.split(",") if t.strip()]
                         if args.exclude_data else None)
    try:
        args.projections = [parse_setting(t) for t in str(args.projections).split(",")
                            if t.strip()]
    except ValueError as e:
        p.error(str(e))
    args.dampings, args.powers = _floats(args.dampings), _floats(args.powers)
    try:
        args.hybrid_weights = ([float(w) for w in args.hybrid_weights.split(",") if w.strip()]
                               if args.hybrid_weights else None)
    except ValueError:
        p.error(f"--hybrid-weights '{args.hybrid_weights}': give comma-separated numbers, "
                "e.g. 0.25,0.5,1")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for name in ("seeds", "epochs", "checkpoints", "n_train"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    unknown = sorted(set(args.methods) - set(METHODS) - set(BASELINES))
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {list(METHODS + BASELINES)}")
    if args.hybrid_weights and ("tfidf" not in args.methods
                                or min(args.hybrid_weights) < 0):
        p.error(f"--hybrid-weights {args.hybrid_weights}: the weights must be >= 0 and "
                "--methods must include tfidf (the text-overlap scores they mix in)")
    return args


def _floats(text: str | None) -> list[float | None]:
    """A comma-separated list of floats; ``[None]`` (the library default) when not given."""
    return [float(d) for d in text.split(",") if d.strip()] if text else [None]


# ---- data and training -----------------------------------------------------------------
def evenly_spaced(docs: list[Document], k: int) -> list[Document]:
    """``k`` documents at evenly spaced positions of ``docs``."""
    if k >= len(docs):
        return list(docs)
    return [docs[(2 * i + 1) * len(docs) // (2 * k)] for i in range(k)]


#: The position-table size of each ``model_type`` (raised to ``--seq-len`` when smaller).
POSITIONS = {"gpt2": "n_positions", "llama": "max_position_embeddings"}


def model_config(args: argparse.Namespace) -> dict:
    """The benchmark's model: ``MODEL`` or ``--model-config``; ``--tie-embeddings`` ties;
    a position table shorter than ``--seq-len`` is lengthened to it."""
    config = MODEL if args.model_config is None else load_model_config(args.model_config)
    config = {**config, **({"tie_word_embeddings": True} if args.tie_embeddings else {})}
    key = POSITIONS.get(config["model_type"])
    if key in config and config[key] < args.seq_len:
        config[key] = args.seq_len
    return config


def _text_hash(doc: Document) -> str:
    return hashlib.sha256(doc.text.encode("utf-8")).hexdigest()


def _resolve(path: str) -> Path:
    return Path(path) if Path(path).is_absolute() else ROOT / path


def round_robin(docs: list[Document], seed: int) -> list[Document]:
    """``docs`` shuffled within each source (seeded), then taken one per source in turn
    (sources by name): any prefix holds the sources as evenly as they allow."""
    gen = torch.Generator().manual_seed(seed)
    by_source: dict[str, list[Document]] = {}
    for d in docs:
        by_source.setdefault(d.source, []).append(d)
    queues = [[group[i] for i in torch.randperm(len(group), generator=gen).tolist()]
              for _, group in sorted(by_source.items())]
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def eligible_pool(args: argparse.Namespace, targets: list[Document]) -> list[Document]:
    """The documents of ``--train-data`` that may be drawn, in the order they are drawn.

    Dropped: a document whose id or text (SHA-256) is that of a target query or of a
    document of ``--exclude-data``, and any repeat of an earlier document's text. ``--draw
    prefix`` keeps the file order (the shipped pool is in a seeded random order);
    ``round-robin`` is ``round_robin(docs, --seed)``.
    """
    docs = load_documents(_resolve(args.train_data))
    banned = list(targets)
    for path in args.exclude_data or []:
        banned += load_documents(_resolve(path))
    ids, texts = {d.id for d in banned}, {_text_hash(d) for d in banned}
    keep, seen = [], set()
    for d in docs:
        h = _text_hash(d)
        if d.id in ids or h in texts or h in seen:
            continue
        seen.add(h)
        keep.append(d)
    if len(keep) < len(docs):
        logger.info("%s: %d of %d documents eligible (the rest are queries, --exclude-data "
                    "documents or repeated texts)", args.train_data, len(keep), len(docs))
    return keep if args.draw == "prefix" else round_robin(keep, args.seed)


def load_data(args: argparse.Namespace):
    """Tokenizer, training documents ``[N, T]`` and queries ``[Q, T]``.

    The N training documents are the first of ``eligible_pool``; ``--queries heldout``
    takes its queries evenly from the rest of the same pool. The tokenizer is trained on
    the whole eligible pool. Training and query documents never share an id or a text.
    """
    targets = (evenly_spaced(load_documents(ROOT / "data/tiny/target.jsonl"), args.n_hamlet)
               + evenly_spaced(load_documents(ROOT / "data/target/code.jsonl"), args.n_code))
    pool = eligible_pool(args, targets)
    if len(pool) < args.n_train:
        raise ConfigError(f"--n-train {args.n_train}: {args.train_data} holds only "
                          f"{len(pool)} eligible documents; lower --n-train")
    if args.queries == "heldout":
        rest = pool[args.n_train:]
        if not rest:
            raise ConfigError(f"--queries heldout needs documents beyond --n-train "
                              f"{args.n_train}: the pool holds {len(pool)}; lower --n-train")
        queries = evenly_spaced(rest, args.n_heldout)
    else:
        queries = targets
    train = pool[:args.n_train]
    if ({d.id for d in train} & {d.id for d in queries}
            or {_text_hash(d) for d in train} & {_text_hash(d) for d in queries}):
        raise ConfigError("a training document is also a query (same id or text); "
                          "check --train-data and --exclude-data")
    tok = train_tokenizer([d.text for d in pool], vocab_size=args.vocab_size,
                          model_type=args.tokenizer, cache_dir=args.cache_dir)
    ds = tokenize_documents(train, tok, args.seq_len)
    qds = tokenize_documents(queries, tok, args.seq_len)
    return tok, ds, qds


@torch.no_grad()
def doc_losses(model: torch.nn.Module, ds: TokenizedDocuments) -> torch.Tensor:
    """``[Q]`` token-mean causal-LM loss of every document (the model's own loss, per row)."""
    model.eval()
    logits = model(input_ids=ds.input_ids, attention_mask=ds.attention_mask).logits[:, :-1]
    labels = ds.labels[:, 1:]
    valid = labels != -100
    ll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                         labels.clamp_min(0).reshape(-1), reduction="none").view(labels.shape)
    return (ll * valid).sum(1) / valid.sum(1).clamp_min(1)


def make_trainer(init: torch.nn.Module, ds: TokenizedDocuments, args: argparse.Namespace):
    """``train(mask [N], seed, on_epoch=None) -> model``: deterministic plain-torch loop.

    Every run starts from a copy of ``init``. Epoch e visits the masked rows in the order
    of ``randperm(N)`` drawn from ``(seed, e)``, so a subset sees its examples in the same
    relative order as the full run: subsets differ only by their data.
    """
    n = len(ds)

    def train(mask: torch.Tensor, seed: int, on_epoch: Callable | None = None):
        model = copy.deepcopy(init)
        model.train()
        if args.optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        for epoch in range(args.epochs):
            gen = torch.Generator().manual_seed(1_000_003 * seed + epoch)
            perm = torch.randperm(n, generator=gen)
            order = perm[mask[perm]]
            for s in range(0, len(order), args.batch_size):
                loss = model(**ds.batch(order[s:s + args.batch_size])).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if on_epoch is not None:
                on_epoch(epoch + 1, model, args.lr)
        return model

    return train


# ---- attribution -------------------------------------------------------------------------
def capture(model: torch.nn.Module, ds: TokenizedDocuments, batch_size: int = 32):
    """Factorized per-example gradients of every row, in row order (``probe``: no .grad)."""
    model.eval()
    batches = (ds.batch(slice(s, s + batch_size)) for s in range(0, len(ds), batch_size))
    return list(collect(model, batches))


def parse_setting(text: str) -> tuple[str | None, int]:
    """``exact`` -> (None, 0); ``<kind>:<k>`` (e.g. ``whitened-sparse:1024``) -> (kind, k)."""
    text = text.strip()
    if text in ("exact", "0"):
        return None, 0
    kind, _, k = text.partition(":")
    if kind not in SETTING_KINDS or not k.isdigit() or int(k) < 1:
        raise ConfigError(f"projection setting '{text}' (--projections): use exact or "
                          f"<kind>:<k> with kind in {SETTING_KINDS} and k >= 1")
    return kind, int(k)


def setting_name(setting: tuple[str | None, int]) -> str:
    return "exact" if setting[0] is None else f"{setting[0]}:{setting[1]}"


def attribute(method: str, setting: tuple[str | None, int], grads: list[dict],
              args: argparse.Namespace, damping: float | None = None,
              power: float | None = None) -> torch.Tensor:
    """``[N, Q]`` scores of one method and projection setting, from captures.

    ``grads`` holds one ``{"train", "query", "lr"}`` capture per checkpoint; the last is
    the final model, the only one that single-checkpoint methods read. Settings: ``exact``
    (factorized, unprojected); ``dense:k`` / ``kronecker:k``: training rows projected per
    layer to k (as a store holds them); curvature factors stay exact and the exactly
    preconditioned query is projected (``Attributor(projector=...)``); ``logra:k``:
    Kronecker projection with the factors fitted in the projected space (LoGra).
    """
    kind, k = setting
    proj = None
    if kind is not None:
        base = "kronecker" if kind == "logra" else kind.removeprefix("whitened-")
        proj = ProjectionConfig(kind=base, dim=k, seed=args.seed)
    recipe = Recipe(method=method, projection=proj, logra=kind == "logra",
                    whitened=kind is not None and kind.startswith("whitened-"))
    config = KFACConfig(**{k: v for k, v in (("damping", damping), ("power", power))
                           if v is not None})
    cks = []
    per_epoch = -(-sum(len(b.sample_ids) for b in grads[-1]["train"]) // args.batch_size)
    for g in recipe.select(grads):
        factors = recipe.fit(g["train"], config) if recipe.curvature else None
        cks.append(Checkpoint(recipe.rows(g["train"], factors), recipe.query(g["query"][0]),
                              g["lr"], factors, step=g["epoch"] * per_epoch))
    return recipe.score(cks).values


def capture_checkpoints(states: list[tuple[int, dict, float]], model: torch.nn.Module,
                        ds: TokenizedDocuments, qds: TokenizedDocuments) -> list[dict]:
    """Train and query captures at every saved checkpoint, with their capture CPU time."""
    out = []
    for epoch, state, lr in states:
        t0 = time.process_time()
        model.load_state_dict(state)
        train = capture(model, ds)
        query = capture(model, qds, batch_size=len(qds))
        out.append({"epoch": epoch, "lr": lr, "train": train, "query": query,
                    "seconds": time.process_time() - t0})
        logger.info("captured %d train + %d query gradients at epoch %d (%.1f CPU s)", len(ds),
                    len(qds), epoch, out[-1]["seconds"])
    return out


# ---- report ------------------------------------------------------------------------------
def frontier(rows: list[dict]) -> None:
    """Mark ``best_at_cost``: no other row has a higher LDS at no more CPU seconds.

    Rows summarized over seeds (``per_seed``: LDS per seed, same seeds in every row) count
    as higher only by more than the standard error of the paired per-seed differences: a
    row is not pushed off the frontier by a tie within noise."""
    def better(o: dict, r: dict) -> bool:
        a, b = o.get("per_seed"), r.get("per_seed")
        if not a or not b or len(a) != len(b) or len(a) < 2:
            return o["lds_mean"] > r["lds_mean"]
        d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
        return float(d.mean()) > float(d.std() / len(d) ** 0.5)

    for r in rows:
        r["best_at_cost"] = not any(
            o is not r and o["time_s"] <= r["time_s"] and better(o, r) for o in rows)


def _opt(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


#: Columns every table shares before its statistics: (header, row -> cell).
_KEY_COLUMNS = [("method", lambda r: r["method"]), ("projection", lambda r: r["projection"]),
                ("damping", lambda r: _opt(r["damping"], "g")),
                ("power", lambda r: _opt(r.get("power"), "g"))]
_TAIL_COLUMNS = [("bytes/row", lambda r: str(r.get("bytes_per_row") or "-")),
                 ("r vs exact", lambda r: _opt(r["r_vs_exact"], ".3f")),
                 ("", lambda r: ("*" if r["best_at_cost"] else "")
                  + (" (default)" if r["default"] else ""))]


def markdown(rows: list[dict], columns: list[tuple[str, Callable[[dict], str]]]) -> str:
    """A markdown table of ``rows`` with ``columns = [(header, row -> cell text)]``."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """Markdown fidelity-cost table; ``*`` = best at its cost, ``(default)`` = the default."""
    return markdown(rows, _KEY_COLUMNS + [
        ("LDS (mean ± std over queries)", lambda r: f"{r['lds_mean']:+.3f} ± {r['lds_std']:.3f}"),
        ("CPU s", lambda r: f"{r['time_s']:.2f}")] + _TAIL_COLUMNS) + "\n\n" + LEGEND


#: Printed under every table: what the last column's marks mean.
LEGEND = ("`*` best at its cost: no row has a higher LDS for fewer CPU seconds (over seeds: "
          "higher by more than the paired standard error); `(default)` what `dattri-ds "
          "attribute` runs by default.")


def full_run(train: Callable, init: torch.nn.Module, ds: TokenizedDocuments,
             qds: TokenizedDocuments, args: argparse.Namespace):
    """Train on all N documents, keeping ``args.checkpoints`` evenly spaced epochs' states.

    Returns:
        ``(states, query_losses [Q])`` with ``states = [(epoch, state_dict, lr), ...]``,
        the last being the final model.
    """
    at = {round(args.epochs * (c + 1) / args.checkpoints) for c in range(args.checkpoints)}
    states: list[tuple[int, dict, float]] = []

    def save(epoch: int, model: torch.nn.Module, lr: float) -> None:
        if epoch in at:
            states.append((epoch, copy.deepcopy(model.state_dict()), lr))

    t0 = time.time()
    full = train(torch.ones(len(ds), dtype=torch.bool), args.seed, on_epoch=save)
    loss = doc_losses(full, qds)
    logger.info("full run: %d epochs in %.1f s; query loss %.3f (init %.3f), train loss %.3f",
                args.epochs, time.time() - t0, float(loss.mean()),
                float(doc_losses(init, qds).mean()), float(doc_losses(full, ds).mean()))
    return states, loss


def row_bytes(shapes: dict[str, tuple[int, int]], setting: tuple[str | None, int]) -> int:
    """fp32 bytes of one training example's row in a store of this setting.

    ``exact``: the materialized gradient, ``sum O*I'``; a projected layer holds
    ``min(O*I', k)`` values (``ko*ki`` for Kronecker kinds, ``ops.projection.kron_dims``):
    a layer no larger than k is kept exactly (``ops.inner.project``).
    """
    kind, k = setting
    base = None if kind is None else ("kronecker" if kind == "logra"
                                      else kind.removeprefix("whitened-"))
    total = 0
    for o, i in shapes.values():
        if base is None or o * i <= k:
            total += o * i
        else:
            projector = Projector(ProjectionConfig(kind=base, dim=k))
            total += projection_kind(projector.kind_of(o, i)).width(k, o, i)
    return 4 * total


def score_all(grads: list[dict], args: argparse.Namespace,
              texts: tuple[list[str], list[str]] | None = None) -> dict:
    """``{(method, setting, damping, power): (scores [N, Q], CPU seconds)}``.

    CPU seconds (``time.process_time``, single-threaded with ``--threads 1``) include the
    captures the method reads. ``logra`` settings apply to curvature methods only; every
    ``--dampings`` x ``--powers`` value runs on the exact setting, projected settings use the
    first of each.
    ``BASELINES`` (exact setting only) score ``texts = (train texts, query texts)``.
    """
    scores: dict[tuple[str, str, float | None], tuple[torch.Tensor, float]] = {}
    for setting in args.projections:
        for method in args.methods:
            if method in BASELINES:
                if setting[0] is None and texts is not None:
                    t0 = time.process_time()
                    values = tfidf_scores(*texts).float()
                    scores[(method, "exact", None, None)] = (values, time.process_time() - t0)
                continue
            curvature = method in CURVATURE
            if setting[0] in CURVATURE_ONLY and not curvature:
                continue
            exact = setting[0] is None
            combos = ([(d, p) for d in (args.dampings if exact else args.dampings[:1])
                       for p in (args.powers if exact else args.powers[:1])]
                      if curvature else [(None, None)])
            for damping, power in combos:
                t0 = time.process_time()
                values = attribute(method, setting, grads, args, damping, power)
                used = grads if Recipe(method=method).trajectory else grads[-1:]
                seconds = time.process_time() - t0 + sum(g["seconds"] for g in used)
                if curvature:
                    damping = KFACConfig().damping if damping is None else damping
                    power = KFACConfig().power if power is None else power
                scores[(method, setting_name(setting), damping, power)] = (values, seconds)
                logger.info("%-16s %-14s damping %-6s power %-5s scores %s in %.2f CPU s",
                            method, setting_name(setting), damping, power, list(values.shape),
                            seconds)
    return scores


def hybrid_name(method: str, weight: float) -> str:
    """The row name of ``z(method) + weight z(tfidf)``, e.g. ``ekfac-trajectory+0.5*tfidf``."""
    return f"{method}+{weight:g}*tfidf"


def hybrid_weight(name: str) -> float | None:
    """The tfidf weight of a hybrid row's name (``hybrid_name``), ``None`` for other rows."""
    return float(name.rsplit("+", 1)[1][:-len("*tfidf")]) if name.endswith("*tfidf") else None


def add_hybrids(scores: dict, weights: list[float] | None) -> None:
    """Add to ``scores`` (``score_all``'s dict) one row per exact-setting method row and
    weight w: ``z(method) + w z(tfidf)`` (``zscore``), CPU seconds the sum of both rows'.

    ``z`` leaves a method's LDS unchanged (a positive per-query scale and a shift that adds
    the same amount to every subset of the same size), so w = 0 is the method itself.
    """
    text = scores.get(("tfidf", "exact", None, None))
    if not weights or text is None:
        return
    tz = zscore(text[0].double())
    for (method, setting, damping, power), (values, seconds) in list(scores.items()):
        if method in BASELINES or setting != "exact":
            continue
        mz = zscore(values.double())
        for w in weights:
            scores[(hybrid_name(method, w), setting, damping, power)] = (
                (mz + w * tz).float(), seconds + text[1])


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the report also written to ``<out>/lds.json``.

    With ``--repeats R`` every seed runs into ``<out>/seed<s>/`` and the report is the
    summary over seeds (``summarize``).
    """
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    if args.repeats == 1:
        return run_one(args, saved_truth(args))
    reports = []
    for seed in range(args.seed, args.seed + args.repeats):
        one = argparse.Namespace(**{**vars(args), "seed": seed, "repeats": 1,
                                    "out": str(Path(args.out) / f"seed{seed}")})
        old = saved_truth(one)
        if old is not None and _settings(old["args"]) == _settings(vars(one)):
            logger.info("seed %d: reusing %s (every setting matches)", seed,
                        Path(one.out) / "lds.json")
            reports.append(old)
        else:
            reports.append(run_one(one, old))
    return summarize(reports, Path(args.out))


#: The arguments that define a benchmark run (a saved seed with equal values is reused).
SETTINGS = ("n_train", "subsets", "seeds", "epochs", "projections", "methods", "fraction",
            "n_hamlet", "n_code", "queries", "n_heldout", "model_config", "tie_embeddings",
            "seq_len", "vocab_size", "batch_size", "optimizer", "lr", "checkpoints", "dampings",
            "powers", "tokenizer", "train_data", "draw", "exclude_data", "hybrid_weights")
#: Settings that change only how the saved models are scored: a saved seed whose other
#: settings match keeps its ground truth (subset masks, retrained query losses, seed
#: agreement, full-model query losses) and only the scores are computed again.
SCORING = ("projections", "methods", "dampings", "powers", "hybrid_weights")
#: The settings that define a seed's ground truth.
TRUTH = tuple(k for k in SETTINGS if k not in SCORING)
#: Values of settings added later, for seeds saved before them (so those are still reused).
_SAVED_BEFORE = {"tokenizer": "bpe", "train_data": DEFAULT_TRAIN_DATA, "draw": "prefix",
                 "exclude_data": None}


def _settings(args: dict, keys: tuple[str, ...] = SETTINGS) -> str:
    """The benchmark settings ``keys`` of a run's args (JSON), without its seed and output
    folder."""
    keep = {k: args.get(k, _SAVED_BEFORE.get(k)) for k in keys}
    return json.dumps(json.loads(json.dumps(keep, default=str)), sort_keys=True)


def saved_truth(args: argparse.Namespace) -> dict | None:
    """The report saved in ``<out>/lds.json`` when its ground-truth settings (``TRUTH``)
    equal this run's, else ``None`` (also with ``--retrain``, or no per-seed report there)."""
    saved = Path(args.out) / "lds.json"
    if getattr(args, "retrain", False) or not saved.is_file():
        return None
    old = json.loads(saved.read_text(encoding="utf-8"))
    if "args" not in old or "masks" not in old:
        return None
    if _settings(old["args"], TRUTH) != _settings(vars(args), TRUTH):
        logger.info("seed %d: %s has other ground-truth settings; retraining", args.seed, saved)
        return None
    old["path"] = str(saved)
    return old


def summarize(reports: list[dict], out: Path) -> dict:
    """Mean +- standard error over seeds of every row's LDS, share of exact and CPU seconds.

    ``pct_exact`` is the ratio of a row's mean LDS to the mean LDS of the same method's
    exact row at the same damping and power; ``best_at_cost`` compares the seed means
    (a row beats another only by more than the paired s.e. of their per-seed LDS).
    Writes ``<out>/lds.md`` and ``<out>/lds.json``.
    """
    def mean_se(xs: list[float]) -> tuple[float, float]:
        t = torch.tensor(xs, dtype=torch.float64)
        se = float(t.std() / len(xs) ** 0.5) if len(xs) > 1 else 0.0
        return float(t.mean()), se

    groups: dict[tuple, list[dict]] = {}
    for rep in reports:
        by_key = {(r["method"], r["projection"], r["damping"], r.get("power")): r
                  for r in rep["results"]}
        for key, r in by_key.items():
            groups.setdefault(key, []).append(r)
    means = {key: mean_se([r["lds_mean"] for r in rs])[0] for key, rs in groups.items()}
    rows = []
    for (method, setting, damping, power), rs in groups.items():
        lm, ls = mean_se([r["lds_mean"] for r in rs])
        tm, ts = mean_se([r["time_s"] for r in rs])
        exact = means.get((method, "exact", damping, power))
        rows.append({"method": method, "projection": setting, "damping": damping,
                     "power": power,
                     "lds_mean": lm, "lds_se": ls, "time_s": tm, "time_se": ts,
                     "pct_exact": None if not exact else lm / exact,
                     "bytes_per_row": rs[0].get("bytes_per_row"), "seeds": len(rs),
                     "r_vs_exact": None if rs[0]["r_vs_exact"] is None
                     else mean_se([r["r_vs_exact"] for r in rs])[0],
                     "default": rs[0]["default"],
                     "per_seed": [r["lds_mean"] for r in rs]})
    frontier(rows)
    md = markdown(rows, _KEY_COLUMNS + [
        ("LDS (mean ± s.e. over seeds)", lambda r: f"{r['lds_mean']:+.3f} ± {r['lds_se']:.3f}"),
        ("of exact", lambda r: _opt(None if r["pct_exact"] is None else 100 * r["pct_exact"],
                                    ".0f") + ("%" if r["pct_exact"] is not None else "")),
        ("CPU s", lambda r: f"{r['time_s']:.2f} ± {r['time_se']:.2f}")] + _TAIL_COLUMNS) \
        + "\n\n" + LEGEND
    seeds = [rep["args"]["seed"] for rep in reports]
    agree = [rep["seed_agreement"]["mean"] for rep in reports if rep["seed_agreement"]]
    head = f"LDS over seeds {seeds} (each: {reports[0]['head'].split(';')[0]})"
    if agree:
        a, e = mean_se(agree)
        head += f"; seed-to-seed agreement of retrained losses {a:+.3f} ± {e:.3f}"
    print(f"\n{head}\n{md}")
    summary = {"seeds": seeds, "results": rows, "head": head,
               "regime": reports[0].get("regime")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "lds.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    (out / "lds.md").write_text(f"{head}\n\n{md}\n", encoding="utf-8")
    return summary


def regime(args: argparse.Namespace, tok) -> dict:
    """What sets a benchmark apart (model family, tokenizer, data, training), for the report."""
    return {"model_type": model_config(args)["model_type"], "model_config": args.model_config,
            "tie_embeddings": args.tie_embeddings, "tokenizer": args.tokenizer,
            "vocab_size": tok.vocab_size, "tokenizer_fingerprint": tok.fingerprint,
            "seq_len": args.seq_len, "n_train": args.n_train, "queries": args.queries,
            "train_data": args.train_data, "draw": args.draw,
            "exclude_data": args.exclude_data,
            "optimizer": args.optimizer, "lr": args.lr, "epochs": args.epochs}


def ground_truth(args: argparse.Namespace, train: Callable, ds: TokenizedDocuments,
                 qds: TokenizedDocuments, full_loss: torch.Tensor,
                 saved: dict | None = None) -> dict:
    """Subset masks ``[S, N]``, retrained query losses ``[S, Q]`` (mean over ``--seeds``
    training seeds), their seed agreement and the full model's query losses.

    ``saved`` (a report with the same ``TRUTH`` settings, ``saved_truth``) is reused when it
    holds the same training and query documents: the S x seeds retraining is skipped and its
    full-model losses are kept (the ones just recomputed are compared with them and the
    largest difference is recorded).
    """
    if saved is not None and (saved["train_ids"] != list(ds.ids)
                              or saved["query_ids"] != list(qds.ids)):
        logger.warning("seed %d: %s holds other training or query documents; retraining",
                       args.seed, saved["path"])
        saved = None
    if saved is not None:
        masks = torch.tensor(saved["masks"], dtype=torch.bool)
        diff = float((torch.tensor(saved["full_model_query_loss"]) - full_loss).abs().max())
        logger.info("seed %d: reusing the ground truth of %s (%d subset masks, retrained "
                    "query losses, seed agreement, full-model losses; full-model query loss "
                    "recomputed within %.2e): retraining skipped", args.seed, saved["path"],
                    len(masks), diff)
        old = saved.get("ground_truth") or {}
        return {"masks": masks, "actual": torch.tensor(saved["retrained_query_loss"]),
                "agreement": saved["seed_agreement"],
                "full_loss": saved["full_model_query_loss"],
                "retrain_s": saved["runtime_s"]["retrain"],
                "record": {"reused_from": old.get("reused_from") or saved["path"],
                           "full_loss_max_diff": diff}}
    masks = subset_masks(len(ds), args.subsets, args.fraction, seed=args.seed)
    t0 = time.time()
    per_seed = [retrain_losses(train, masks, lambda m: doc_losses(m, qds), seeds=[args.seed + r])
                for r in range(args.seeds)]  # one call per seed: seed agreement below
    # Reproducibility of the target itself: rank correlation of two seeds' retrained losses
    # (a rough ceiling for the LDS of any method against a single seed).
    agree = lds(per_seed[0], per_seed[1]) if args.seeds > 1 else None
    return {"masks": masks, "actual": torch.stack(per_seed).mean(0),
            "agreement": None if agree is None else {"mean": agree.mean, "std": agree.std},
            "full_loss": full_loss.tolist(), "retrain_s": round(time.time() - t0, 2),
            "record": {"reused_from": None}}


def run_one(args: argparse.Namespace, truth: dict | None = None) -> dict:
    """One seed of the benchmark into ``args.out`` (``lds.json``, ``lds.md``); ``truth``: a
    saved report whose ground truth is reused (``ground_truth``)."""
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    tok, ds, qds = load_data(args)
    logger.info("%d training documents %s, %d queries (%s); T=%d, %s vocab %d", len(ds),
                source_counts(ds.docs), len(qds), ", ".join(qds.ids), args.seq_len,
                args.tokenizer, tok.vocab_size)
    init = build_model(model_config(args), tokenizer=tok, seed=args.seed)
    train = make_trainer(init, ds, args)
    states, full_loss = full_run(train, init, ds, qds, args)
    grads = capture_checkpoints(states, copy.deepcopy(init), ds, qds)
    scores = score_all(grads, args, (ds.texts(tok), qds.texts(tok)))
    add_hybrids(scores, args.hybrid_weights)
    shapes = {n: lg.shape for n, lg in grads[-1]["train"][0].layers.items()}

    truth = ground_truth(args, train, ds, qds, full_loss, truth)
    masks, actual = truth["masks"], truth["actual"]
    agree = truth["agreement"]

    # "(default)": what attribute runs, the default method with its text prior when the
    # hybrid rows hold that weight (Recipe.text_weight), else the method alone
    w = Recipe(method=DEFAULT_METHOD).text_weight
    shipped = hybrid_name(DEFAULT_METHOD, w) if w else DEFAULT_METHOD
    default_row = shipped if any(key[0] == shipped for key in scores) else DEFAULT_METHOD
    rows = []
    for (method, setting, damping, power), (values, seconds) in scores.items():
        res = lds(predicted(values, masks), actual)
        exact = scores.get((method, "exact", damping, power))
        r_exact = None if exact is None else float(
            torch.corrcoef(torch.stack([values.flatten(), exact[0].flatten()]).double())[0, 1])
        rows.append({"method": method, "projection": setting, "damping": damping,
                     "power": power, "lds_mean": res.mean, "lds_std": res.std,
                     "time_s": round(seconds, 3),
                     "r_vs_exact": r_exact,
                     "bytes_per_row": None if method in BASELINES
                     else row_bytes(shapes, parse_setting(setting)),
                     "hybrid_weight": hybrid_weight(method),
                     "default": (method == default_row and setting == "exact"
                                 and damping == KFACConfig().damping
                                 and power == KFACConfig().power),
                     "per_query": [round(float(r), 4) for r in res.per_query]})
    frontier(rows)
    md = table(rows)
    head = (f"LDS over {args.subsets} subsets of {round(args.fraction * len(ds))}/{len(ds)} "
            f"documents ({args.seeds} training seed(s) each), {len(qds)} queries")
    if agree is not None:
        head += (f"; seed-to-seed agreement of retrained losses {agree['mean']:+.3f} ± "
                 f"{agree['std']:.3f}")
    print(f"\n{head}\n{md}")
    report = {
        "args": vars(args), "head": head, "model": model_config(args), "tokenizer": tok.fingerprint,
        "regime": regime(args, tok),
        "train_ids": ds.ids, "query_ids": qds.ids, "results": rows,
        "full_model_query_loss": truth["full_loss"],
        "retrained_query_loss": actual.tolist(), "masks": masks.int().tolist(),
        "seed_agreement": agree, "ground_truth": truth["record"],
        "checkpoints": [{"epoch": g["epoch"], "lr": g["lr"]} for g in grads],
        "runtime_s": {"retrain": truth["retrain_s"],
                      "total": round(time.time() - t_start, 2)},
    }
    (out / "lds.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (out / "lds.md").write_text(f"{head}\n\n{md}\n", encoding="utf-8")
    logger.info("wrote %s and %s (total %.1f s, retraining %.1f s%s)", out / "lds.json",
                out / "lds.md", report["runtime_s"]["total"], truth["retrain_s"],
                ", reused" if truth["record"]["reused_from"] else "")
    return report


if __name__ == "__main__":
    from dattri_ds.cli.exits import run

    sys.exit(run(main))
