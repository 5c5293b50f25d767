"""Curate a training subset from a pool's stored gradients against a target (offline, LESS-style).

    dattri-ds curate --run-dir runs/warm --store runs/warm/grads --pool data/pool.jsonl \
        --target data/target/hamlet.jsonl --fraction 0.05 --with-text --out runs/warm/subset
    torchrun --standalone --nproc_per_node 2 tools/curate.py --run-dir ...   # rows per rank
    --method content (default) | combined | cosine | adam-cosine | trajectory

The method, budget (exactly one of --fraction, --examples, --tokens) and diversity flags
are generated from ``dattri_ds.selection.curate.CurateConfig`` (one flag per field). The
default method is the content prior (``content``, DSIR): no gradient method was ahead of it
in the curation benchmark. Inputs (pool stores, ``--target`` documents or a
``--target-store``), outputs (``subset.jsonl``, ``scores.npy``, ``ids.json``,
``config.json``, ``report.md``/``.html``; kept unless ``--force``) and memory per rank:
docs/curation.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dattri_ds import GradBatch  # noqa: E402

from dattri_ds.cli import exits as cli  # noqa: E402
from dattri_ds.capture.hooks import GradientCapture  # noqa: E402
from dattri_ds.data.doctable import hash64  # noqa: E402
from dattri_ds.errors import ConfigError  # noqa: E402
from dattri_ds.io.outputs import check_dir  # noqa: E402
from dattri_ds.io.schema import field_docs, field_flag  # noqa: E402
from dattri_ds.selection.curate import (  # noqa: E402
    METHODS, CurateConfig, Pool, curate, resolve_budget,
)
from dattri_ds.selection.curate.config import AGGREGATES, PRECONDITIONS  # noqa: E402
from dattri_ds.selection.curate.pool import ngram_counts  # noqa: E402
from dattri_ds.selection.curate.targets import (  # noqa: E402
    adam_target, capture_of, load_adam_moments, store_target_rows, target_rows,
)
from dattri_ds.selection.curate.writer import OUTPUTS  # noqa: E402
from dattri_ds.store import StoreRequest, attach  # noqa: E402
from dattri_ds.tools.configs import CURATE, DATA, add_flags  # noqa: E402
from dattri_ds.tools.datasets import ToolData, source_data  # noqa: E402
from dattri_ds.tools.gradients import gradients  # noqa: E402
from dattri_ds.tools.provenance import training_data  # noqa: E402
from dattri_ds.tools.runtime import init_distributed, logger, setup_logging  # noqa: E402
from dattri_ds.tools.sources import (  # noqa: E402
    Source, add_checkpoint_args, add_source_args, check_checkpoints, open_source, tag_choice,
)
from dattri_ds.tools.stores import check_data, store_paths  # noqa: E402
from dattri_ds.tools.subset import SUBSET_FILES  # noqa: E402
from dattri_ds.tools.texts import load_texts  # noqa: E402

_CHOICES = {"method": METHODS.names(), "aggregate": list(AGGREGATES),
            "precondition": list(PRECONDITIONS),
            "combine_with": [m for m in METHODS.names() if METHODS.lookup(m).gradient
                             and m != "combined"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds curate", description=__doc__.splitlines()[0])
    add_source_args(p)
    p.add_argument("--store", required=True,
                   help="the pool's gradient store, or a folder of per-checkpoint stores")
    p.add_argument("--pool", nargs="+", default=None,
                   help="jsonl file(s) of the pool documents (default: collect's --data)")
    add_flags(p, DATA)  # --data-path (a prepared pool) and --packing
    p.add_argument("--target", default=None, help="jsonl of target documents")
    p.add_argument("--target-store", default=None,
                   help="a target store (or folder of per-checkpoint ones) instead of --target "
                        "gradients")
    add_checkpoint_args(p, "stored checkpoints to read (default every one; non-trajectory "
                           "methods use the newest of them)")
    add_flags(p, CURATE)  # --target-max-docs, --with-text, --allow-target-overlap
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="replace an earlier selection in --out")
    defaults = CurateConfig(examples=1)
    docs = field_docs(CurateConfig)
    for f in fields(CurateConfig):  # one flag per field, default and help from the dataclass
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name) if f.name != "examples" else None
        text = " ".join(docs.get(f.name, "").split()).replace("``", "").replace("%", "%%")
        doc = f"{text} (CurateConfig.{f.name}, default {value!r})"
        if isinstance(value, bool):
            p.add_argument(flag, default=value, action=argparse.BooleanOptionalAction,
                           help=doc)
        elif f.name in _CHOICES:
            p.add_argument(flag, default=value, choices=_CHOICES[f.name], help=doc)
        else:
            p.add_argument(flag, type=field_flag(CurateConfig, f.name, name=flag),
                           default=value, help=doc)
    return p


def _config(args) -> CurateConfig:
    return CurateConfig(**{f.name: getattr(args, f.name) for f in fields(CurateConfig)})


def _tags(args, source: Source, available: dict[str, Path]) -> list[str]:
    """Stored checkpoints to read, oldest first (the run's trajectory order)."""
    order = [c["tag"] for c in source.trajectory()]
    tags = [t for t in order if t in available] or sorted(available)
    chosen = tag_choice(args)
    if chosen is not None:
        want = [t.strip() for t in chosen.split(",") if t.strip()]
        missing = [t for t in want if t not in available]
        if missing or not want:
            raise ConfigError(f"--checkpoints {chosen!r}: no store for {missing or want}"
                              f" under {args.store} (stored: {sorted(available)})")
        tags = [t for t in tags if t in want]
    return tags


def _pool_data(args, source: Source, stores) -> ToolData:
    """The pool's documents: ``--pool`` (jsonl) or ``--data-path``, else the data the pool
    store records, compared with every pool store's data record.

    Raises:
        StoreMismatchError: a store was collected from other data (both sides named).
    """
    origin = training_data("--pool", args.pool, data_path=args.data_path, packing=args.packing,
                           store=args.store)
    data = source_data(origin, source, args)
    check_data({t: s.path for t, s in stores.items()}, data, "curate",
               f"--store the pool stores collected from {' '.join(data.origin.files)}")
    return data


def target_overlap(docs, data: ToolData, target: str, allow: bool) -> int:
    """How many ``--target`` documents are also in the pool data (by text hash, docs/data.md);
    refused unless ``allow``: the target would then measure documents the subset may train
    on.

    Raises:
        ConfigError: an overlap without ``--allow-target-overlap`` (the count and an id named).
    """
    hashes = np.array([hash64(d.text.encode("utf-8")) for d in docs.docs], dtype=np.uint64)
    shared = [d.id for d, hit in zip(docs.docs, np.isin(hashes, data.text_hashes())) if hit
              and d.text]
    pool = " ".join(data.origin.files)
    if shared and not allow:
        raise ConfigError(f"--target {target}: {len(shared)} of {len(docs)} documents are also "
                          f"in the pool {pool} (same text, e.g. '{shared[0]}'): the target "
                          f"would measure documents the subset may train on. Fix: remove them "
                          f"from the target or the pool, or pass --allow-target-overlap")
    logger.log(logging.WARNING if shared else logging.INFO, "target overlap: %d of %d target "
               "documents are in the pool %s", len(shared), len(docs), pool)
    return len(shared)


def _attach_pool(source: Source, available, tags):
    """Every pool store of ``tags``, attached after comparing its provenance."""
    stores = {}
    for t in tags:
        _refuse_empty(available[t])
        req = StoreRequest(consumer="curate", whitening=(None, None), origin={
            "fingerprint": f"{source.fingerprint()}@{t}"},
            fixes={"whitened": "collect the pool without --whiten / --factors",
                   "fingerprint": "--run-dir / --model of the run the pool store was "
                   "collected from"})
        stores[t] = attach(available[t], req, mode="score")
    return stores


def _refuse_empty(path: Path) -> None:
    """An empty pool store (a collect that wrote no row) is a usage error, not damage."""
    data = list(path.glob("shard-*.data"))
    if not list(path.glob("shard-*.index.json")) and all(f.stat().st_size == 0 for f in data):
        raise ConfigError(f"The pool store '{path}' holds no rows: collect the pool into it "
                          f"(tools/collect.py --data POOL --out {path.parent}), or pass --store "
                          f"the folder of a collected pool")


def _projection_fields(spec) -> dict:
    keys = ("kind", "dim", "seed", "distribution", "kron_speedup")
    return {k: v for k, v in (spec.projection_config or {}).items() if k in keys}


def _target_store_rows(args, stores, tags) -> dict[str, torch.Tensor]:
    """Rows of the target store of each checkpoint, refused unless it holds the pool
    store's model, checkpoint, projection and layers."""
    found = store_paths(Path(args.target_store))
    out = {}
    for t in tags:
        spec = stores[t].spec
        path = found.get(t) or (next(iter(found.values())) if len(found) == 1 else None)
        if path is None:
            raise ConfigError(f"--target-store {args.target_store}: no store for checkpoint "
                              f"'{t}' (stored: {sorted(found)})")
        req = StoreRequest(
            consumer="curate --target-store", projection=_projection_fields(spec),
            layers={ls.name: (ls.kind, tuple(ls.shape)) for ls in spec.layers},
            whitening=(None, None), origin={"fingerprint": spec.fingerprint},
            fixes={"projection": f"collect the target with the pool store's projection "
                   f"({spec.projection})", "fingerprint": "collect the target store from "
                   "the model and checkpoint of the pool store",
                   "layers": "collect the target store from the pool store's model"})
        with attach(path, req, mode="score") as ts:
            out[t] = store_target_rows(ts)
    return out


def _target_rows(args, source: Source, stores, tags, config, docs) -> dict[str, torch.Tensor]:
    """Target rows ``[Q, P]`` per checkpoint from documents, in each store's space."""
    method = METHODS.lookup(config.method)(config)
    adam = method.precondition == "adam"
    out = {}
    for n, t in enumerate(tags, 1):
        logger.info("target %d/%d (%s): capturing %d documents%s", n, len(tags), t, len(docs),
                    " exactly, then Adam-preconditioned and projected" if adam else "")
        spec = stores[t].spec
        model = source.model(t)
        capture = capture_of(spec, exact=adam)
        batch = GradBatch.cat(list(gradients(model, docs, torch.arange(len(docs)),
                                             capture=capture, batch_size=8)))
        if adam:
            folder = source.folder(t)
            logger.info("target %s: reading the Adam moments of %s", t, folder)
            moments = load_adam_moments(model, folder)
            probe = GradientCapture(model, capture, probe_only=True).attach()
            try:
                batch = adam_target(batch, probe.layers, moments, capture_of(
                    spec, exact=False).projection)
            finally:
                probe.detach()
        out[t] = target_rows(batch, spec)
        logger.info("%s: %d target rows (%s)", t, len(docs), "adam" if adam else "plain")
        del model
    return out


def main(argv: list[str] | None = None) -> dict:
    """Curate the subset (``dattri_ds.selection.curate.curate``); the summary on rank 0."""
    args = build_parser().parse_args(argv)
    config = _config(args)
    if (args.target is None) == (args.target_store is None) and METHODS.lookup(
            config.method).gradient:
        raise ConfigError("Give exactly one of --target (documents) and --target-store; got "
                          f"target={args.target!r}, target_store={args.target_store!r}")
    if METHODS.lookup(config.method).content and args.target is None:
        default = " (the default)" if config.method == CurateConfig.method else ""
        raise ConfigError(f"--method {config.method}{default} uses the content prior: pass "
                          f"--target documents (their n-grams), or with only a "
                          f"--target-store a gradient method (--method cosine)")
    setup_logging()
    rank, world = init_distributed()
    source = open_source(args)
    available = store_paths(Path(args.store))
    tags = METHODS.lookup(config.method)(config).checkpoints(_tags(args, source, available))
    first = _tags(args, source, available)[-1] if not tags else tags[0]
    stores = _attach_pool(source, available, tags or [first])
    base = stores[tags[0] if tags else first]
    data = _pool_data(args, source, stores)
    pool = Pool.build(base.ids, base.token_counts, data.pool_texts(base.ids))
    resolve_budget(config, len(pool), pool.tokens)
    docs = overlap = None
    if args.target is not None:
        docs = load_texts(args.target, data.tokenizer, data.seq_len, args.target_max_docs,
                          context=source.context, truncate=True, vocab_size=source.vocab_size)
        overlap = target_overlap(docs, data, args.target, args.allow_target_overlap)
    targets = None  # a target store is compared (and read) before anything is written
    if args.target_store and METHODS.lookup(config.method).gradient:
        targets = _target_store_rows(args, stores, tags)
    elif METHODS.lookup(config.method).gradient:  # the targets' gradients (and Adam moments)
        check_checkpoints(source, tags)  # are read from these: their files whole first
    if rank == 0:
        check_dir(args.out, flag="--out", force=args.force,
                  overwrites=OUTPUTS[:5] + SUBSET_FILES)
    inputs = {"run": args.run, "model": args.model, "store": args.store,
              "pool": list(pool.paths), "target": args.target,
              "target_store": args.target_store, "target_overlap": overlap,
              "seq_len": data.seq_len, "with_text": args.with_text, "world": world}
    return _run(args, config, source, stores, tags, pool, docs, targets, inputs, rank, world)


def _run(args, config, source: Source, stores, tags, pool, docs, targets, inputs, rank, world):
    method = METHODS.lookup(config.method)
    if method.gradient and targets is None:
        targets = _target_rows(args, source, stores, tags, config, docs)
    target_counts = None
    if method(config).content:
        b = docs.batch(torch.arange(len(docs)))
        target_counts = ngram_counts(b["input_ids"], b["attention_mask"]).sum(0)
    weights = {t: float(source.checkpoint(t)["lr"]) for t in tags}
    result = curate(config, stores, pool, targets=targets, weights=weights,
                    target_counts=target_counts, out=args.out if rank == 0 else None,
                    with_text=args.with_text, resolved={"inputs": inputs, "lr_weights": weights},
                    rank=rank, world=world)
    for s in stores.values():
        s.close()
    if rank == 0:
        logger.info("kept %d of %d rows -> %s", len(result.chosen), len(pool), args.out)
    return result.summary or {}


if __name__ == "__main__":
    sys.exit(cli.run(main))
