"""Attribute query texts to the training examples of a gradient store.

    python tools/attribute.py --run-dir runs/main/selection --store runs/main/grads \
        --queries data/target/hamlet.jsonl --query-max-docs 4 --method ekfac \
        --factors runs/main/factors.pt --out runs/main/attr-ekfac
    python tools/attribute.py --checkpoints 'hf_out/checkpoint-*' --store grads ...
        # Hugging Face checkpoint folders read as a run (docs/offline_tools.md)
    --method ekfac-trajectory (default) | kfac-trajectory | tracin | ekfac | kfac | graddot
             | gradcos

Every store is checked against this run, checkpoint, layers, projection and whitening
before any query gradient (``dattri_ds.store.attach``); every method is the library's
(``dattri_ds.methods.recipe.Recipe`` over ``make_attributor``); the store is streamed in blocks of
``--block-rows``. What it writes and how curvature queries meet projected or whitened rows:
docs/offline_tools.md; the text prior (``--text-weight``) and the defaults' fidelity:
docs/attribution_fidelity.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dattri_ds import (  # noqa: E402
    CaptureConfig, Checkpoint, GradBatch, KFACFactors, Projector,
)
from dattri_ds.cli import exits as cli  # noqa: E402
from dattri_ds.errors import ConfigError, DoesNotFitError, StoreCorruptError  # noqa: E402
from dattri_ds.eval import tfidf_scores, with_text_prior  # noqa: E402
from dattri_ds.methods import get_attributor  # noqa: E402
from dattri_ds.io.outputs import check_dir, writing  # noqa: E402
from dattri_ds.methods.per_token import (  # noqa: E402
    TokenPlan, scatter_tokens, token_chunks, token_gradients, token_rows,
)
from dattri_ds.plan import available_memory, check_tool  # noqa: E402
from dattri_ds.methods.recipe import Recipe  # noqa: E402
from dattri_ds.store import StoreRequest, attach  # noqa: E402
from dattri_ds.store.attach import check, manifest, model_layers  # noqa: E402
from dattri_ds.tools.configs import ATTRIBUTE, DATA, DEFAULT_METHOD, add_flags  # noqa: E402
from dattri_ds.tools.datasets import ToolData, source_data  # noqa: E402
from dattri_ds.tools.gradients import gradients  # noqa: E402
from dattri_ds.tools.progress import bar  # noqa: E402
from dattri_ds.tools.provenance import (  # noqa: E402
    TRUNCATED, recorded_data, training_data, write_config,
)
from dattri_ds.tools.runtime import announce, logger, setup_logging  # noqa: E402
from dattri_ds.tools.sources import (  # noqa: E402
    Source, add_checkpoint_args, add_source_args, check_checkpoints, open_source, source_flags,
    tag_choice,
)
from dattri_ds.tools.stores import (  # noqa: E402
    check_data, check_factors, factors_path, store_origin, store_paths,
)
from dattri_ds.tools.texts import load_texts, row_texts  # noqa: E402

__all__ = ["build_parser", "main", "DEFAULT_METHOD"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds attribute", description=__doc__.splitlines()[0])
    add_source_args(p)
    p.add_argument("--store", required=True,
                   help="a gradient store, or a folder of per-checkpoint stores (collect --out)")
    p.add_argument("--queries", required=True, help="jsonl of query texts")
    add_checkpoint_args(p, "checkpoints to score (trajectories: default every stored one; "
                           "others: one tag, default the newest stored)")
    p.add_argument("--factors", help="curvature methods: factors file from tools/fit.py, or "
                   "a folder of <tag>.pt (tools/fit.py --checkpoint all) for trajectories")
    add_flags(p, ATTRIBUTE)  # Recipe.method (the attributor registry), weighting, options
    add_flags(p, DATA)  # --data-path (prepared training data) and --packing
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="replace an earlier attribution in --out")
    return p


#: The attribute flag that fixes each compared field (``{stored}``: the store's value).
_FIXES = {
    "projection": "collect every checkpoint with the same --projection, --projection-dim "
    "and --seed (this store: {stored})",
    "whitened": "collect every checkpoint with the same --whiten / --factors",
    "whitened_by": "--factors with the factors the store was whitened by ({stored}), or "
    "collect again with these",
    "layers": "attribute with the model the store was collected from",
    "checkpoint": "--checkpoints, or --store the stores of this run",
    "weights_hash": "--run-dir / --model whose checkpoint the store was collected at, or "
    "collect the store again for this one",
    "fingerprint": "--run-dir / --model of the model the store was collected from (the "
    "store belongs to another model or checkpoint)",
    "run_id": "--run-dir of the run the store was collected from",
}


def store_requests(args, run: Source, available: dict[str, Path], tags: list[str],
                   models: _Models | None = None):
    """``(proj, whitened, requests)``: every store this attribution reads is compared with
    what it will do (this run, checkpoint and weights; the layers the queries are captured
    at; the first store's projection and whitening; the --factors that whiten the query)
    before any query gradient is computed.

    Raises:
        StoreMismatchError: a store differs (one line: the fields, both values, the fix).
        StoreCorruptError: a manifest is damaged (named).
        ConfigError: a whitened store and a method it was not whitened for.
    """
    first = check(available[tags[0]], StoreRequest(consumer="attribute"))
    proj, whitened = first.projection_cfg(), first.whitened
    _check_whitened(args.method, whitened, available[tags[0]])
    requests = {}
    for tag in tags:
        model = models.get(tag) if models is not None else run.model(tag)
        by = _factors(args, tag, None, model).fingerprint() if whitened and \
            Recipe(method=args.method).curvature else None
        requests[tag] = StoreRequest(
            consumer="attribute", projection=proj, whitening=(whitened, by), fixes=_FIXES,
            layers=model_layers(model, CaptureConfig(**(first.semantics or {}))),
            origin=store_origin(run, tag, model))
        attach(available[tag], requests[tag], mode="score").close()  # complete, intact
        if models is not None:
            models.put(tag, model)
        del model
    return proj, whitened, requests


def _choose_tags(args, run: Source, available: dict[str, Path]) -> list[str]:
    """The checkpoints to score; a checkpoint the request needs but whose store is missing is
    an error naming the expected path, never a fallback to the stores that exist."""
    root, wanted = Path(args.store), tag_choice(args)
    traj = Recipe(method=args.method).trajectory
    if wanted not in (None, "all"):
        order = [t.strip() for t in wanted.split(",")]
        missing = [t for t in order if t not in available]
        if missing:
            raise ConfigError(f"No store for checkpoint(s) {missing} under {args.store}; "
                              f"stored: {sorted(available)}")
        return order if traj else order[-1:]
    trajectory = [c["tag"] for c in run.trajectory()]
    if len(available) == 1 and next(iter(available.values())) == root:
        order = [t for t in trajectory if t in available]  # --store names one store
    else:
        order = trajectory if traj else trajectory[-1:]
        missing = [t for t in order if t not in available]
        if missing:
            raise StoreCorruptError(
                f"No store for checkpoint '{missing[0]}' of {run.root}: expected "
                f"'{root / missing[0]}' (stored: {sorted(available)}); it was deleted or never "
                f"collected. Collect it (tools/collect.py --checkpoints {missing[0]}), or pass "
                f"--checkpoints with the stored tags to use only those")
    if not order:
        raise ConfigError(f"None of the stores under {args.store} ({sorted(available)}) is a "
                          f"checkpoint of {run.root}")
    return order if traj else order[-1:]


def _check_whitened(method: str, whitened: str | None, store: Path) -> None:
    """A whitened store is scored only by the curvature method it was whitened for."""
    if whitened is not None and Recipe(method=method).inner != whitened:
        raise ConfigError(f"Store '{store}' holds rows whitened by '{whitened}' factors; "
                          f"--method {method} cannot score them: use --method {whitened} or "
                          f"{whitened}-trajectory, or collect without --whiten")


def _factors(args, tag: str, proj, model=None):
    """The curvature factors of checkpoint ``tag`` (a file, or ``<dir>/<tag>.pt``), checked
    against ``model``'s layer shapes when given."""
    path = factors_path(args.factors, tag)
    if path is None or not path.exists():
        every = " --checkpoint all" if Recipe(method=args.method).trajectory else ""
        raise ConfigError(f"--method {args.method} needs curvature factors of checkpoint "
                          f"'{tag}' (got --factors {args.factors!r}, looked for {path}); fit "
                          f"them with tools/fit.py {source_flags(args)}{every} --out <dir>")
    factors = KFACFactors.load(path, projector=Projector(proj) if proj else None)
    if model is not None:
        check_factors(factors, path, model, args)
    if proj is not None and all(lf.projection is None for lf in factors.layers.values()):
        logger.warning("%s: exact factors on a %s-projected store of raw gradients: the query "
                       "is preconditioned exactly, then projected, which can lose most of "
                       "the curvature's fidelity on the layers the projection compresses "
                       "(18-28%% of the exact LDS at sparse k = 1024 on benchmarks/lds.py, "
                       "docs/attribution_fidelity.md); "
                       "collect whitened rows instead (tools/collect.py --factors "
                       "%s: >= 90%% of the exact LDS)", path, proj.kind, args.factors)
    return factors


def _checkpoints(args, run: Source, available: dict[str, Path], tags: list[str], queries,
                 recipe: Recipe, requests: dict, models: _Models,
                 tokens: TokenScores | None = None):
    """One ``Checkpoint`` per tag, opened lazily (store, query gradients, factors); every
    store was checked against ``requests`` at start and is attached with them.

    With ``tokens`` (``--per-token``) the query tokens are scored at each checkpoint once
    its sequence scores are done, with the same model, factors and store, chunk by chunk.
    """
    for i, tag in enumerate(tags):
        logger.info("%s (%d/%d): loading the model%s, capturing %d queries", tag, i + 1,
                    len(tags), " and factors" if recipe.curvature else "", len(queries))
        store = attach(available[tag], requests[tag], mode="score")
        model = models.get(tag)
        capture = recipe.query_capture(CaptureConfig(**(store.spec.semantics or {})))
        q = GradBatch.cat(list(gradients(model, queries, torch.arange(len(queries)),
                                         capture=capture,
                                         batch_size=len(queries) if recipe.curvature else 8)))
        factors = _factors(args, tag, recipe.factor_projection, model) if recipe.curvature \
            else None
        try:
            lr, step = _schedule(run, tag, recipe)
            yield Checkpoint(store.iter_batches(args.block_rows), q, lr, factors, step)
            logger.info("%s: scored %d queries (%s)", tag, len(q.sample_ids), args.method)
            if tokens is not None:
                del q
                tokens.score(tag, Checkpoint(store, None, lr, factors, step), model, capture)
        finally:
            store.close()
        del model


class _Models:
    """Each checkpoint's model loaded once per attribution (a ZeRO-3 checkpoint is then
    consolidated once): kept from the start-up check until it is scored while all of them
    fit in ``keep`` bytes, else loaded again."""

    def __init__(self, run, keep: int = 512 * 2**20) -> None:
        self.run, self.keep, self.cache, self.held = run, keep, {}, 0

    def get(self, tag: str):
        if tag in self.cache:
            model, size = self.cache.pop(tag)
            self.held -= size
            return model
        return self.run.model(tag)

    def put(self, tag: str, model) -> None:
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        if self.held + size <= self.keep:
            self.cache[tag] = (model, size)
            self.held += size


class TokenScores:
    """``--per-token``: every loss-bearing query token scored chunk by chunk (``TokenPlan``:
    at most ``chunk`` token rows' gradients are held at once), summed over checkpoints as
    the method sums them; a progress line at least every 10 s."""

    def __init__(self, args, recipe: Recipe, queries, plan, semantics: dict) -> None:
        self.args, self.recipe, self.plan = args, recipe, plan
        batch = queries.batch(torch.arange(len(queries)))
        self.chunks = list(token_chunks(batch, CaptureConfig(**semantics), chunk=plan.chunk))
        self.where = torch.cat([w for _, w in self.chunks])
        self.values: torch.Tensor | None = None
        self.ids: tuple[str, ...] | None = None

    def score(self, tag: str, ck, model, capture) -> None:
        """Add checkpoint ``tag``'s (weighted) token scores; ``ck.train`` is the store."""
        progress = bar(self.where.shape[0], f"per-token {tag}")
        col = 0
        for rows, where in self.chunks:
            q = token_gradients(model, [rows], capture, batch_size=8)
            got = self.recipe.score([ck._replace(train=ck.train.iter_batches(
                self.args.block_rows), query=q)])
            if self.values is None:
                self.ids = got.train_ids
                self.values = torch.zeros(len(got.train_ids), self.where.shape[0])
            self.values[:, col:col + where.shape[0]] += got.values
            col += where.shape[0]
            del q, got
            progress.update(where.shape[0])
        progress.close()


def _announce(args, available: dict[str, Path], tags: list[str], queries) -> None:
    """The first line: queries, store, checkpoints, projection, method and factors."""
    found = manifest(available[tags[0]])
    proj = found[0].projection_cfg() if found else None
    rows = "?" if found is None else (f"{proj.kind} k={proj.dim}" + (
        f", whitened by {found[0].whitened}" if found[0].whitened else ""))
    recipe = Recipe(method=args.method)
    weighting = args.weighting or (recipe.trajectory and _default_weighting(args.method))
    announce("attribute", queries=f"{args.queries} ({len(queries)})", store=args.store,
             checkpoints=",".join(tags), projection=rows,
             method=args.method + (f" (weighting {weighting})" if weighting else ""),
             factors=args.factors if recipe.curvature else None, out=args.out)


def _default_weighting(method: str) -> str:
    return get_attributor(method).default_weighting


def _semantics(store: Path) -> dict:
    found = manifest(store)
    return dict((found[0].semantics or {}) if found else {})


def _token_plan(args, store: Path, queries):
    """The per-token chunk (``TokenPlan``), checked at start against --token-memory-gb and
    this machine's free memory, from the store's layer shapes (no model is loaded).

    Raises:
        ConfigError: --token-chunk (or one token row) needs more than --token-memory-gb.
        DoesNotFitError: --token-memory-gb is more than the memory available.
    """
    found = manifest(store)
    cfg = CaptureConfig(**_semantics(store))
    _, where = token_rows(queries.batch(torch.arange(len(queries))),
                          ignore_index=cfg.ignore_index, label_shift=cfg.label_shift)
    budget = int(args.token_memory_gb * 1024**3)
    limit, source = available_memory("cpu")
    if budget > limit and not args.skip_memory_check:
        raise DoesNotFitError(
            f"--token-memory-gb {args.token_memory_gb:g} is more than the "
            f"{limit / 1024**3:.1f} GB available ({source}); lower --token-memory-gb")
    shapes = [tuple(ls.shape[-2:]) if len(ls.shape) >= 2 else (ls.shape[0], 1)
              for ls in found[0].layers] if found else []
    plan = TokenPlan.make(shapes, seq_len=queries.seq_len, rows=int(where.shape[0]),
                          dense_query=Recipe(method=args.method).curvature, budget=budget,
                          chunk=args.token_chunk)
    logger.info("per-token: %d token rows of %d queries in %d chunk(s) of <= %d rows, about "
                "%.2f GB per chunk (--token-memory-gb %g)", plan.rows, len(queries),
                plan.chunks, plan.chunk, plan.need / 1024**3, args.token_memory_gb)
    return plan


def _schedule(run, tag: str, recipe: Recipe) -> tuple[float, int | None]:
    """``(lr, step)`` of checkpoint ``tag`` when the scores read them (``Trajectory.
    reads_schedule``: a trajectory under ``weighting="lr"``); ``(1.0,
    None)`` (``Checkpoint``'s defaults, unread) otherwise, so a checkpoint folder without a
    recorded learning rate scores under the other weightings."""
    if recipe.trajectory and get_attributor(recipe.method).reads_schedule(recipe.weighting):
        entry = run.checkpoint(tag)
        return float(entry["lr"]), entry.get("step")
    return 1.0, None


def main(argv: list[str] | None = None) -> dict:
    """Score the queries with the library's method (``dattri_ds.methods.recipe.Recipe``)."""
    args = build_parser().parse_args(argv)
    check_dir(args.out, flag="--out", force=args.force, overwrites=("scores.npy", "summary.json"))
    setup_logging(verbose=args.verbose)
    run = open_source(args)
    available = store_paths(Path(args.store))
    tags = _choose_tags(args, run, available)
    check_checkpoints(run, tags)  # their files whole, before anything is written
    data, why = training_texts(args, run, {t: available[t] for t in tags})
    tokenizer = data.tokenizer if data is not None else run.tokenizer
    queries = load_texts(args.queries, tokenizer, run.context, args.query_max_docs,
                         context=run.context, truncate=args.truncate, queries=True,
                         vocab_size=run.vocab_size)
    _announce(args, available, tags, queries)
    asked = Recipe(method=args.method)
    check_tool(run.root, args, seq_len=queries.seq_len, examples=len(queries),  # the size door
               method=asked.inner if asked.curvature else "graddot")
    tokens_plan = _token_plan(args, available[tags[0]], queries) if args.per_token else None
    t0 = time.perf_counter()
    models = _Models(run)
    proj, whitened, requests = store_requests(args, run, available, tags, models)
    recipe = Recipe(method=args.method, projection=proj, whitened=whitened is not None,
                    weighting=args.weighting)
    prior = text_prior(args, recipe, queries, data, why)  # checked before any scoring
    tokens = None
    if tokens_plan is not None:
        tokens = TokenScores(args, recipe, queries, tokens_plan,
                             _semantics(available[tags[0]]))
    cks = _checkpoints(args, run, available, tags, queries, recipe, requests, models, tokens)
    per_ckpt: list[torch.Tensor] = []
    ids, total = recipe.score(cks, per_checkpoint=per_ckpt)
    for _ in cks:  # a single-checkpoint method: finish its token pass
        pass
    seconds = time.perf_counter() - t0
    if tokens is not None:
        if tokens.ids != ids:
            raise RuntimeError("per-token scores read the store's rows in another order")
        per_token = scatter_tokens(tokens.values, tokens.where, len(queries), queries.seq_len)
        write_per_token(Path(args.out), tokenizer, queries, per_token)
    model_total = total
    if prior.weight > 0:
        prior = with_overlap(prior, queries, ids, tokenizer)
        total = with_text_prior(total, prior.overlap.to(total.dtype), prior.weight)
    with writing(args.out):
        return write_outputs(Path(args.out), args, run, tags, queries, ids, total, per_ckpt,
                             seconds, prior, model_total)


def training_texts(args, run: Source, stores: dict[str, Path]):
    """``(data, why)``: the training data of the stores (``--train-data`` / ``--data-path``,
    else recorded), opened (queries are then read with its tokenizer) and compared with
    every store's data record; ``(None, why not)`` when nothing names it or a recorded file
    is gone (the text prior is then off), unless the stores were collected on prepared data,
    whose tokenizer the queries need.

    Raises:
        ConfigError: given data that cannot be read; prepared data recorded and not found.
        StoreMismatchError: a store records other data (both sides named).
    """
    try:
        origin = training_data("--train-data", args.train_data, data_path=args.data_path,
                               packing=args.packing, store=args.store)
    except ConfigError as e:
        found = manifest(next(iter(stores.values())))
        recorded = found[0].data if found else None
        if args.train_data or args.data_path or (recorded and recorded.get("packing") !=
                                                 TRUNCATED):
            raise
        return None, str(e)
    data = source_data(origin, run, args)
    check_data(stores, data, "attribute", "--store the stores collected from "
               f"{' '.join(data.origin.files)}")
    args.train_data, args.data_path = recorded_data(data.origin)  # recorded: what was read
    args.seq_len, args.packing = data.seq_len, data.origin.packing
    return data, ""


@dataclass(frozen=True)
class TextPrior:
    """The text-overlap prior an attribution runs with: its weight (0: off), why, the
    training data whose row texts it reads and, once computed, the ``[N, Q]`` TF-IDF
    overlap of the training rows' and the queries' texts."""

    weight: float
    reason: str
    data: ToolData | None = None
    overlap: torch.Tensor | None = None


def text_prior(args, recipe: Recipe, queries, data: ToolData | None, why: str) -> TextPrior:
    """Resolve ``--text-weight`` (default: ``Recipe.text_weight``) and check the training
    texts are there, before any scoring.

    Raises:
        ConfigError: ``--text-weight`` > 0 was asked for and the texts are not there (the
            default turns the prior off instead, and says why).
    """
    asked = args.text_weight
    weight = recipe.text_weight if asked is None else asked
    if weight == 0:
        return TextPrior(0.0, "--text-weight 0" if asked is not None else
                         f"--method {args.method} has no measured text weight")
    try:
        if data is None:
            raise ConfigError(why)
        data.check_texts()
        _check_query_texts(queries)
    except ConfigError as e:
        if asked is not None:
            raise ConfigError(f"--text-weight {asked:g} needs the training texts: {e}. Fix: "
                              f"--train-data (or --data-path) the data the store was "
                              f"collected from, or --text-weight 0") from None
        logger.warning("text prior off (%s)", e)
        return TextPrior(0.0, f"off: {e}")
    return TextPrior(float(weight), f"TF-IDF overlap of the row texts of "
                     f"'{' '.join(data.origin.files)}'", data)


def _check_query_texts(queries) -> None:
    """Every query has text (token-id rows: a ``text`` field).

    Raises:
        ConfigError: naming the queries and how to give their text.
    """
    if queries.tokenizer_fingerprint == "token-ids" and \
            not all(d.text.strip() for d in queries.docs):
        raise ConfigError(f"--queries {queries.docs[0].id}...: token-id query rows without a "
                          f"'text' field; add \"text\" to every query row (or give the "
                          f"queries as text)")


def with_overlap(prior: TextPrior, queries, train_ids, tokenizer) -> TextPrior:
    """``prior`` with its overlap: each training row's text as collect read it (decoded),
    against the queries' rows.

    Raises:
        ConfigError: a store row has no example in the training data.
    """
    train = prior.data.texts_of(train_ids)
    return replace(prior, overlap=tfidf_scores(train, row_texts(queries, tokenizer)))


def write_per_token(out: Path, tokenizer, queries, per_token: torch.Tensor) -> None:
    """``per_token.npy`` ``[N, Q, T]`` and ``query_tokens.json``: per query, its tokens
    ``{"t", "id", "text"}`` up to its last real one (``text`` decoded when a tokenizer is
    known, else the id)."""
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "per_token.npy", per_token.numpy())
    tokenizer = None if queries.tokenizer_fingerprint == "token-ids" else tokenizer()
    rows = []
    for i in range(len(queries)):
        n = int(queries.attention_mask[i].sum())
        ids = queries.input_ids[i, :n].tolist()
        rows.append([{"t": t, "id": v, "text": _piece(tokenizer, v)} for t, v in enumerate(ids)])
    (out / "query_tokens.json").write_text(json.dumps(rows))


def _piece(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"<{token_id}>"
    if hasattr(tokenizer, "id_to_piece"):
        return tokenizer.id_to_piece(token_id).replace("\u2581", " ")
    return tokenizer.decode([token_id])


def write_outputs(out: Path, args, run, tags, queries, train_ids, total, per_ckpt, seconds,
                  prior: TextPrior, model_total):
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "scores.npy", total.numpy())
    for name, values in (("model_scores.npy", model_total), ("text_overlap.npy", prior.overlap)):
        if prior.weight > 0:  # the method's own scores, and the prior's overlap
            np.save(out / name, values.numpy())
        else:  # never leave an earlier run's (--force) next to these scores
            (out / name).unlink(missing_ok=True)
    if per_ckpt:
        np.save(out / "per_checkpoint.npy", torch.stack(per_ckpt).numpy())
    (out / "train_ids.json").write_text(json.dumps(list(train_ids)))
    qinfo = [{"id": d.id, "source": d.source, "text": d.text} for d in queries.docs]
    (out / "queries.json").write_text(json.dumps(qinfo, indent=1))
    k = min(args.top_k, len(train_ids))
    top = []
    for j, qd in enumerate(queries.docs):
        col = total[:, j]
        pro = torch.topk(col, k).indices.tolist()
        opp = torch.topk(-col, k).indices.tolist()
        top.append({"query": qd.id,
                    "proponents": [{"id": train_ids[i], "score": float(col[i])} for i in pro],
                    "opponents": [{"id": train_ids[i], "score": float(col[i])} for i in opp]})
    (out / "topk.json").write_text(json.dumps(top, indent=1))
    weighting = args.weighting or (_default_weighting(args.method) if
                                   Recipe(method=args.method).trajectory else None)
    summary = {"method": args.method, "weighting": weighting, "checkpoints": tags,
               "train": len(train_ids),
               "queries": len(queries), "seconds": round(seconds, 3),
               "pairs_per_second": round(len(train_ids) * len(queries) / max(seconds, 1e-9)),
               "text_weight": prior.weight, "text_prior": prior.reason}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_config(out, "attribute", args)
    logger.info("attribution -> %s (%s)", out, json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(cli.run(main))
