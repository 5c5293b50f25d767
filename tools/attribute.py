"""Attribute query texts to the training examples of a gradient store.

    python tools/attribute.py --run-dir runs/main/selection --store runs/main/grads \
        --queries data/target/hamlet.jsonl --query-max-docs 4 --method ekfac \
        --factors runs/main/factors.pt --out runs/main/attr-ekfac
    --method ekfac-trajectory (default) | kfac-trajectory | tracin | ekfac | kfac | graddot
             | gradcos

Every method is the library's (``make_attributor``); trajectories sum per-checkpoint scores
with ``Trajectory.trajectory_scores`` (curvature factors per checkpoint: ``tools/fit.py
--checkpoint all --out <dir>``). Curvature methods precondition the unprojected query
exactly and then project it into the store's space (``Attributor(projector=...)``), unless
the factors were fitted in that space (``fit --store``, LoGra), or the store holds whitened
rows (``collect --whiten ekfac --factors DIR``): then the query is whitened by the same
exact factors and projected, and scores are plain dot products (the projected recipe that
keeps >= 90% of the exact LDS).

Streams the store in blocks of ``--block-rows`` (memory: one block plus the preconditioned
queries plus the ``[N, Q]`` result). Writes ``scores.npy`` (``[N, Q]``, positive = the
training example lowers the query's loss), ``train_ids.json``, ``queries.json``,
``topk.json`` (proponents and opponents per query), for trajectories ``per_checkpoint.npy``
(``[C, N, Q]`` lr-weighted contributions), and the resolved config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dattri_ds.schema import add_flag  # noqa: E402
from dattri_ds.tools.common import (  # noqa: E402
    Run, add_source_args, gradients, load_texts, logger, open_source, projection_from_tag,
    setup_logging, write_config,
)

METHODS = ("graddot", "gradcos", "tracin", "kfac", "ekfac", "kfac-trajectory",
           "ekfac-trajectory")
#: The default method: the most faithful at its cost in ``tools/lds.py`` (README).
DEFAULT_METHOD = "ekfac-trajectory"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds attribute", description=__doc__.splitlines()[0])
    add_source_args(p)
    p.add_argument("--store", required=True,
                   help="a gradient store, or a folder of per-checkpoint stores (collect --out)")
    p.add_argument("--queries", required=True, help="jsonl of query texts")
    add_flag(p, "--query-max-docs", int, ge=1,
             default=None)
    p.add_argument("--method", choices=METHODS, default=DEFAULT_METHOD,
                   help="attribution method (trajectories need a store and, for curvature, "
                        "factors per checkpoint)")
    p.add_argument("--weighting", choices=["lr", "uniform", "normalized"], default=None,
                   help="trajectory methods: checkpoint weights (default: the method's, lr "
                        "for tracin, normalized for the curvature trajectories)")
    p.add_argument("--checkpoints", default=None,
                   help="tracin: all | tag,tag (default all stored); others: one tag "
                        "(default: the newest stored)")
    p.add_argument("--factors", help="curvature methods: factors file from tools/fit.py, or "
                   "a folder of <tag>.pt (tools/fit.py --checkpoint all) for trajectories")
    add_flag(p, "--top-k", int, ge=1, default=10)
    add_flag(p, "--block-rows", int, ge=1, default=1024)
    p.add_argument("--truncate", action="store_true",
                   help="score the first context-many tokens of queries longer than the "
                        "model's context (default: error)")
    p.add_argument("--per-token", action="store_true",
                   help="also score every query token: per_token.npy [N, Q, T] and "
                        "query_tokens.json (the report colours query tokens by influence)")
    p.add_argument("--out", required=True)
    return p


def stores(root: Path) -> dict[str, Path]:
    """tag -> store path under ``root`` (or ``root`` itself, tagged from its manifest).

    A directory holding a manifest or any shard file is a store, so a store whose
    ``info.json`` was deleted is found (and refused when opened), never skipped.
    """
    from dattri_ds.errors import ConfigError
    from dattri_ds.store.format import store_files
    from dattri_ds.store.spec import load_manifest

    if store_files(root):
        spec = load_manifest(root)[0]
        return {spec.checkpoint or spec.fingerprint.rsplit("@", 1)[-1]: root}
    found = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and store_files(p)} \
        if root.is_dir() else {}
    if not found:
        raise ConfigError(f"'{root}' holds no gradient store: run tools/collect.py --out {root}")
    return found


def _open_checked(path: Path, run: Run, tag: str):
    """The store of checkpoint ``tag``: complete, intact, and of this run and checkpoint.

    Raises:
        StoreCorruptError: a part of the store is missing or damaged (named).
        StoreMismatchError: the store was collected from another model, run or checkpoint.
    """
    from dattri_ds.store import GradientStore

    return GradientStore.open(path, require_complete=True, origin={
        "fingerprint": f"{run.fingerprint()}@{tag}", "run_id": run.run_id, "checkpoint": tag})


def _check_weights(store, model, tag: str) -> None:
    """Refuse a store whose recorded weights hash differs from the loaded checkpoint's."""
    from dattri_ds.store import weights_hash
    from dattri_ds.store.spec import mismatch_error

    lines = store.spec.origin_diff({"weights_hash": weights_hash(model)})
    if lines:
        store.close()
        raise mismatch_error(str(store.path), lines, what=f"Checkpoint '{tag}' (its weights)")


def _choose_tags(args, run: Run, available: dict[str, Path]) -> list[str]:
    """The checkpoints to score; a checkpoint the request needs but whose store is missing is
    an error naming the expected path, never a fallback to the stores that exist."""
    from dattri_ds.errors import ConfigError, StoreCorruptError

    root = Path(args.store)
    if args.checkpoints not in (None, "all"):
        order = [t.strip() for t in args.checkpoints.split(",")]
        missing = [t for t in order if t not in available]
        if missing:
            raise ConfigError(f"No store for checkpoint(s) {missing} under {args.store}; "
                              f"stored: {sorted(available)}")
        return order if _is_trajectory(args.method) else order[-1:]
    trajectory = [c["tag"] for c in run.trajectory()]
    if len(available) == 1 and next(iter(available.values())) == root:
        order = [t for t in trajectory if t in available]  # --store names one store
    else:
        order = trajectory if _is_trajectory(args.method) else trajectory[-1:]
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
    return order if _is_trajectory(args.method) else order[-1:]


def _is_trajectory(method: str) -> bool:
    from dattri_ds.methods import Trajectory, get_attributor
    return issubclass(get_attributor(method), Trajectory)


def _inner(method: str) -> str:
    """The per-checkpoint method of ``method`` (itself unless it is a trajectory)."""
    from dattri_ds.methods import Trajectory, get_attributor
    cls = get_attributor(method)
    return cls.default_inner if issubclass(cls, Trajectory) else method


def _is_curvature(method: str) -> bool:
    from dattri_ds.methods import KFAC, get_attributor
    return issubclass(get_attributor(_inner(method)), KFAC)


def _check_whitened(method: str, whitened: str | None, store: Path) -> None:
    """A whitened store is scored only by the curvature method it was whitened for."""
    from dattri_ds.errors import ConfigError

    if whitened is not None and _inner(method) != whitened:
        raise ConfigError(f"Store '{store}' holds rows whitened by '{whitened}' factors; "
                          f"--method {method} cannot score them: use --method {whitened} or "
                          f"{whitened}-trajectory, or collect without --whiten")


def _factors(args, tag: str, proj):
    """The curvature factors of checkpoint ``tag`` (a file, or ``<dir>/<tag>.pt``)."""
    from dattri_ds import KFACFactors, Projector
    from dattri_ds.errors import ConfigError

    path = Path(args.factors) if args.factors else None
    if path is not None and path.is_dir():
        path = path / f"{tag}.pt"
    if path is None or not path.exists():
        every = " --checkpoint all" if _is_trajectory(args.method) else ""
        source = f"--model {args.model}" if args.run is None else f"--run-dir {args.run}"
        raise ConfigError(f"--method {args.method} needs curvature factors of checkpoint "
                          f"'{tag}' (got --factors {args.factors!r}, looked for {path}); fit "
                          f"them with tools/fit.py {source}{every} --out <dir>")
    factors = KFACFactors.load(path, projector=Projector(proj) if proj else None)
    if proj is not None and all(lf.projection is None for lf in factors.layers.values()):
        logger.warning("%s: exact factors on a %s-projected store of raw gradients: the query "
                       "is preconditioned exactly, then projected, which loses most of the "
                       "curvature's fidelity (LDS ~0.05 of 0.67, README 'Attribution "
                       "fidelity'); collect whitened rows instead (tools/collect.py --factors "
                       "%s: >= 90%% of the exact LDS)", path, proj.kind, args.factors)
    return factors


def _store_projection(store):
    """The ProjectionConfig a store was collected with (None: unprojected)."""
    if store.spec.projection_config is not None:
        return store.spec.projection_cfg()
    return projection_from_tag(store.spec.projection)


def _checkpoints(args, run: Run, available: dict[str, Path], tags: list[str], queries,
                 proj, token_where: list[torch.Tensor], whitened: str | None = None):
    """One ``Checkpoint`` per tag, opened lazily (store, query gradients, factors).

    With ``--per-token`` every query token's loss gradient is appended to the query rows
    (after the Q sequence rows) and its position is put in ``token_where``.
    """
    from dattri_ds import CaptureConfig, Checkpoint, GradBatch
    from dattri_ds.errors import StoreMismatchError

    curvature = _is_curvature(args.method)
    for tag in tags:
        store = _open_checked(available[tag], run, tag)
        if _store_projection(store) != proj or store.spec.whitened != whitened:
            store.close()
            raise StoreMismatchError(
                f"Store '{available[tag]}' is projected with {store.spec.projection!r} "
                f"(whitened {store.spec.whitened!r}), the store of '{tags[0]}' otherwise "
                f"({whitened!r}); collect every checkpoint with the same --projection and "
                f"--whiten settings")
        model = run.model(tag)
        _check_weights(store, model, tag)
        # curvature: the query is preconditioned exactly, then projected (Attributor projector)
        capture = CaptureConfig(projection=None if curvature else proj,
                                **(store.spec.semantics or {}))
        q = GradBatch.cat(list(gradients(model, queries, torch.arange(len(queries)),
                                         capture=capture,
                                         batch_size=len(queries) if curvature else 8)))
        if args.per_token:  # token rows scored in the same pass over the store
            from dattri_ds.per_token import collect_per_token

            tok, where = collect_per_token(model, queries.batch(torch.arange(len(queries))),
                                           capture)
            q = GradBatch.cat([q, tok])
            token_where[:] = [where]
        # whitened rows: exact factors (the query is whitened, then projected)
        factors = _factors(args, tag, None if whitened else proj) if curvature else None
        stored_by = store.spec.whitened_by
        if whitened and stored_by is not None and stored_by != factors.fingerprint():
            store.close()
            raise StoreMismatchError(
                f"Store '{available[tag]}' was whitened by other factors (fingerprint "
                f"{stored_by}) than --factors gives for '{tag}' ({factors.fingerprint()}: "
                f"another fit, damping or power): the query would be whitened differently "
                f"from the rows; pass the factors collect used, or collect again with these")
        try:
            yield Checkpoint(store.iter_batches(args.block_rows), q,
                             float(run.checkpoint(tag)["lr"]), factors)
        finally:
            store.close()
        logger.info("%s: scored %d queries (%s)", tag, len(q.sample_ids), args.method)


def main(argv: list[str] | None = None) -> dict:
    """Score the queries with the library's method (``make_attributor(--method)``)."""
    from dattri_ds import Projector, make_attributor

    args = build_parser().parse_args(argv)
    setup_logging()
    run = open_source(args)
    available = stores(Path(args.store))
    tags = _choose_tags(args, run, available)
    queries = load_texts(args.queries, run.tokenizer, run.context, args.query_max_docs,
                         context=run.context, truncate=args.truncate)
    t0 = time.perf_counter()
    proj, whitened = None, None
    for i, tag in enumerate(tags):  # every store is checked before any factors or gradients
        with _open_checked(available[tag], run, tag) as store:
            if i == 0:
                proj, whitened = _store_projection(store), store.spec.whitened
                _check_whitened(args.method, whitened, available[tag])
    projector = Projector(proj) if proj else None
    token_where: list[torch.Tensor] = []  # --per-token: where each token row belongs
    cks = _checkpoints(args, run, available, tags, queries, proj, token_where, whitened)
    extra = {} if whitened is None else {"whitened": True}
    per_ckpt: list[torch.Tensor] = []
    if _is_trajectory(args.method):
        kwargs = {} if args.weighting is None else {"weighting": args.weighting}
        attributor = make_attributor(args.method, projector=projector, **kwargs, **extra)
        ids, total = attributor.trajectory_scores(cks, per_checkpoint=per_ckpt)
    else:
        ck = next(cks)
        kwargs = {"factors": ck.factors, **extra} if ck.factors is not None else {}
        attributor = make_attributor(args.method, projector=projector, **kwargs)
        ids, total = attributor.scores(ck.train, ck.query)
        cks.close()
    seconds = time.perf_counter() - t0
    if token_where:  # token columns follow the Q query columns (scored in the same pass)
        from dattri_ds.per_token import scatter_tokens

        q = len(queries)
        tokens = scatter_tokens(total[:, q:], token_where[0], q, queries.seq_len)
        write_per_token(Path(args.out), run, queries, tokens)
        total, per_ckpt = total[:, :q], [c[:, :q] for c in per_ckpt]
    return write_outputs(Path(args.out), args, run, tags, queries, ids, total, per_ckpt,
                         seconds)


def write_per_token(out: Path, run, queries, per_token: torch.Tensor) -> None:
    """``per_token.npy`` ``[N, Q, T]`` and ``query_tokens.json``: per query, its tokens
    ``{"t", "id", "text"}`` up to its last real one (``text`` decoded when a tokenizer is
    known, else the id)."""
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "per_token.npy", per_token.numpy())
    tokenizer = None
    if queries.tokenizer_fingerprint != "token-ids":
        tokenizer = run.tokenizer()
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


def write_outputs(out: Path, args, run, tags, queries, train_ids, total, per_ckpt, seconds):
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "scores.npy", total.numpy())
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
    summary = {"method": args.method, "checkpoints": tags, "train": len(train_ids),
               "queries": len(queries), "seconds": round(seconds, 3),
               "pairs_per_second": round(len(train_ids) * len(queries) / max(seconds, 1e-9))}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_config(out, "attribute", args)
    logger.info("attribution -> %s (%s)", out, json.dumps(summary))
    return summary


if __name__ == "__main__":
    from dattri_ds.cli import run

    sys.exit(run(main))
