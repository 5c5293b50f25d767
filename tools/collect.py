"""Collect projected per-example gradients of a dataset at checkpoints into gradient stores.

    python tools/collect.py --run-dir runs/main/selection --data data/corpus/train.jsonl \
        --max-docs 500 --checkpoints all --out runs/main/grads
    torchrun --standalone --nproc_per_node 2 tools/collect.py --run-dir ...  # shard per rank
    deepspeed --num_gpus 2 tools/collect.py --run-dir ...
    python tools/collect.py --model hf_folder --data tokens.jsonl --out grads  # any causal LM
    python tools/collect.py --checkpoints 'hf_out/checkpoint-*' --data ... --out grads
        # Hugging Face checkpoint folders read as a run (docs/offline_tools.md)
    python tools/collect.py --model hf_folder --data-path runs/data/corpus --out grads
        # prepared data: the examples and ids a training run on it has (docs/data.md)

Rows are projected per layer (``--projection``, default ``ProjectionConfig()``). For the
curvature methods fit the factors first and collect whitened rows (``--whiten ekfac
--factors DIR``; docs/attribution_fidelity.md measures why). Each checkpoint gets its own
store ``<out>/<tag>/``; an existing store is attached by its spec first, stored examples are
skipped, a run killed at any moment loses at most ``--flush-every`` rows per rank, and a
finished store is sealed (docs/offline_tools.md, docs/store.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dattri_ds import CaptureConfig, KFACFactors, ProjectionConfig  # noqa: E402

from dattri_ds.cli import exits as cli  # noqa: E402
from dattri_ds.errors import ConfigError  # noqa: E402
from dattri_ds.ops.cost import explain_projection  # noqa: E402
from dattri_ds.io.outputs import check_dir  # noqa: E402
from dattri_ds.plan import check_tool  # noqa: E402
from dattri_ds.store import (  # noqa: E402
    GradientStoreWriter, StoreConfig, StoreRequest, StoreSpec, attach, seal_store,
)
from dattri_ds.store.attach import check, model_layers  # noqa: E402
from dattri_ds.store.format import store_files  # noqa: E402
from dattri_ds.store.spec import capture_semantics  # noqa: E402
from dattri_ds.tools.configs import COLLECT, DATA, add_flags, values  # noqa: E402
from dattri_ds.tools.datasets import source_data  # noqa: E402
from dattri_ds.tools.gradients import example_ids, gradients  # noqa: E402
from dattri_ds.tools.provenance import (  # noqa: E402
    recorded_data, training_data, write_config,
)
from dattri_ds.tools.runtime import (  # noqa: E402
    announce, init_distributed, logger, setup_logging,
)
from dattri_ds.tools.sources import (  # noqa: E402
    Source, add_checkpoint_args, add_source_args, open_source, source_tags,
)
from dattri_ds.tools.stores import (  # noqa: E402
    check_data, check_factors, factors_path, store_origin,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds collect", description=__doc__.splitlines()[0])
    add_source_args(p)
    p.add_argument("--data", default=None, help="jsonl of documents or token ids to collect "
                   "(default: with --run-dir, the run's own training data and --max-docs)")
    add_flags(p, DATA)  # --data-path (prepared data) and --packing
    add_checkpoint_args(p, "checkpoints to collect (default all)")
    p.add_argument("--out", required=True, help="store root (one store per checkpoint)")
    p.add_argument("--factors", default=None,
                   help="exact factors file, or folder of <tag>.pt (tools/fit.py --checkpoint "
                        "all): the rows are whitened by them")
    add_flags(p, COLLECT)  # ProjectionConfig, CaptureConfig.whiten, StoreConfig, CollectOptions
    return p


def prepare(run: Source, tag: str, args):
    """``(model, capture, factors, origin, request)`` of checkpoint ``tag``: what its store
    gets, and the StoreRequest an existing store there must match."""
    proj = ProjectionConfig(**values(args, COLLECT, ProjectionConfig))
    capture = CaptureConfig(projection=proj, **values(args, COLLECT, CaptureConfig))
    factors = _factors(args, tag)
    model = run.model(tag)
    if factors is not None:
        check_factors(factors, args.factors, model, args)
    origin = store_origin(run, tag, model)
    whitened_by = None if factors is None else factors.fingerprint()
    return model, capture, factors, origin, _request(args, model, capture, origin, whitened_by)


def check_stores(run: Source, tags: list[str], args, data=None) -> None:
    """Compare every existing store under ``--out`` with this collect before any gradient
    is computed (a mismatch at the last checkpoint must not come after hours on the first):
    every store there must hold rows of ``data`` (they share one collect record), the
    checkpoints' stores also this model, projection and capture.

    Raises:
        StoreMismatchError: one line per store, every differing field with both values.
        StoreCorruptError: a damaged manifest (named).
    """
    out = Path(args.out)
    if data is not None and out.is_dir():
        check_data({p.name: p for p in sorted(out.iterdir()) if store_files(p)}, data,
                   "this collect", f"collect into another --out (not {args.out})")
    for tag in tags:
        path = Path(args.out) / tag
        if store_files(path):  # a new store needs no model loaded twice
            check(path, prepare(run, tag, args)[-1])


def collect_checkpoint(run: Source, tag: str, data, args, rank: int, world: int,
                       data_record: dict | None = None) -> int:
    """Write the store of one checkpoint; return how many rows this rank added.

    An existing store is attached first (``dattri_ds.store.attach``): a store collected with
    another projection, dtype, whitening, layer set, capture semantics or checkpoint is
    refused before any gradient is computed; its intact rows are kept and skipped. The
    store records ``data_record`` (the data's ``data`` record).
    """
    model, capture, factors, origin, request = prepare(run, tag, args)
    proj, path = capture.projection, Path(args.out) / tag
    whitened_by = request.whitening[1]
    rows = torch.arange(rank, len(data), world)
    done = _stored_ids(path, request)
    if done:
        ids = example_ids(data, rows)
        rows = rows[torch.tensor([i not in done for i in ids], dtype=torch.bool)]
    logger.info("%s: %d examples already stored in %s, %d to go", tag, len(done), path,
                rows.numel())
    if rows.numel() == 0:
        return 0
    writer, added = None, 0
    cfg = StoreConfig(path=str(path), **values(args, COLLECT, StoreConfig))
    try:
        for batch in gradients(model, data, rows, capture=capture, factors=factors,
                               batch_size=args.batch_size, progress=f"collect {tag}"):
            if writer is None:
                spec = StoreSpec.from_batch(batch, projection=proj, capture=capture, **origin,
                                            whitened_by=whitened_by, data=data_record)
                if rank == 0 and proj.strategy.per_layer:
                    _log_projection(spec, proj, args.verbose)
                writer = GradientStoreWriter(cfg, spec, rank=rank, world=world)
            added += writer.append(batch)
        if writer is not None:
            with _signals_deferred():  # a stop never lands inside the final commit
                writer.close()
    except BaseException as err:  # commit what is buffered, then say what is kept
        kept = _commit_kept(writer, len(done) if world == 1 else None)
        if isinstance(err, KeyboardInterrupt):
            raise Interrupted(kept, path) from None
        logger.warning("%s: %s rows committed in %s before this error; rerun the same "
                       "command to resume after them", tag, "?" if kept is None else kept,
                       path)
        raise
    return added


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a collect, after its buffered rows were committed."""

    def __init__(self, rows: int | None, path: Path) -> None:
        super().__init__(rows, path)
        self.rows, self.path = rows, path


def _commit_kept(writer, stored: int | None) -> int | None:
    """Close ``writer`` (committing its buffered rows; after a failed write only releasing
    its files) and return the rows this rank's shard keeps (``stored`` when no writer was
    opened; None when unknown)."""
    if writer is None:
        return stored
    try:
        with _signals_deferred():
            writer.close()
    except KeyboardInterrupt:  # another stop during this commit: it finished; one is handled
        pass
    except Exception as e:  # noqa: BLE001 - the first error is the one reported
        logger.warning("committing the buffered rows of %s failed: %s", writer.path, e)
    try:
        return writer.committed_rows
    except Exception:  # noqa: BLE001
        return None


def _log_projection(spec, proj, verbose: bool) -> None:
    """The per-layer projection choice: one summary line, the table with --verbose."""
    table = explain_projection({ls.name: tuple(ls.shape) for ls in spec.layers}, proj.dim,
                               proj.kron_speedup)
    if verbose:
        logger.info("projection per layer (ops.cost.choose_projection):\n%s", table)
        return
    kinds = Counter(line.split("-> ")[1].split()[0] for line in table.splitlines()
                    if "-> " in line)
    logger.info("projection auto k=%d per layer: %s (--verbose: the table)", proj.dim,
                ", ".join(f"{n} {k}" for k, n in kinds.most_common()))


#: The collect flag that sets each compared field (``{stored}``: the store's value).
_FIXES = {
    "projection.kind": "--projection {stored}", "projection.dim": "--projection-dim {stored}",
    "projection.seed": "--seed {stored}", "projection": "the store's projection (no collect "
    "flag sets this field)", "dtype": "--dtype {stored}",
    "whitened": "--whiten / --factors as the store was collected (whitened: {stored})",
    "whitened_by": "--factors with the factors that whitened the store ({stored})",
    "semantics": "no collect flag sets it: the store was written by the library or during "
    "training", "layers": "no collect flag sets them: the store was written by the library "
    "or during training, or for another model",
    "fingerprint": "--run-dir / --model of the model the store was collected from",
    "run_id": "--run-dir of the run the store was collected from",
    "weights_hash": "--run-dir / --model whose checkpoint the store was collected at",
}


def _request(args, model, capture, origin: dict, whitened_by: str | None):
    """What this collect appends: compared with an existing store before any work."""
    return StoreRequest(consumer="collect", projection=capture.projection, dtype=args.dtype,
                        layers=model_layers(model, capture),
                        semantics=capture_semantics(capture),
                        whitening=(capture.whiten, whitened_by), origin=origin, fixes=_FIXES,
                        otherwise=f"write a new store: --out <another folder> (not "
                                  f"{args.out})")


def _stored_ids(path: Path, request) -> set[str]:
    """Ids of the intact rows already in the store at ``path`` (none when there is none)."""
    old = attach(path, request, mode="resume")
    if old is None:
        return set()
    with old:
        return set(old.ids)


def _factors(args, tag: str):
    """The exact curvature factors of checkpoint ``tag`` for ``--whiten`` (else None)."""
    if args.whiten is None:
        return None
    path = factors_path(args.factors, tag)
    if path is None or not path.is_file():
        raise ConfigError(f"--whiten {args.whiten} needs the exact factors of checkpoint "
                          f"'{tag}' (--factors {args.factors!r}, looked for {path}); fit them "
                          f"with tools/fit.py --checkpoint all --out <dir>, then --factors <dir>")
    factors = KFACFactors.load(path)
    if any(lf.projection is not None for lf in factors.layers.values()):
        raise ConfigError(f"{path}: --whiten needs exact factors (fit without --store or "
                          f"--projection-dim); these were fitted in a projected space")
    return factors


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.whiten is None and args.factors:  # factors given: the default method's rows
        args.whiten = "ekfac"
    rank, world = init_distributed()
    setup_logging(rank, args.verbose)
    run = open_source(args)
    tags = source_tags(run, args, "all")
    check_dir(args.out, flag="--out", folders=tags)  # the output door, before any work
    data = _data(args, run)
    proj = ProjectionConfig(**values(args, COLLECT, ProjectionConfig))
    check_stores(run, tags, args, data)
    check_tool(run.root, args, seq_len=data.seq_len, examples=len(data))  # the size door
    announce("collect", data=data.origin.describe(len(data)), checkpoints=",".join(tags),
             projection=f"{proj.kind} k={proj.dim} seed {proj.seed}",
             rows=f"whitened by {args.whiten} factors {args.factors}" if args.whiten
             else "plain (not whitened)", out=args.out)  # once nothing refuses it
    if rank == 0:
        write_config(Path(args.out), "collect", args)
    summary = {}
    _sigterm_interrupts()
    try:
        for tag in tags:
            t0 = time.perf_counter()
            added = collect_checkpoint(run, tag, data, args, rank, world, data.record())
            _seal(Path(args.out) / tag, rank, world)
            summary[tag] = added
            logger.info("%s: stored %d examples in %.1f s (rank %d/%d)", tag, added,
                        time.perf_counter() - t0, rank, world)
    except Interrupted as stop:
        done = f", checkpoints finished: {', '.join(summary)}" if summary else ""
        sys.stderr.write(f"interrupted: {'?' if stop.rows is None else stop.rows} rows "
                         f"committed in {stop.path}{done}; rerun the same command to "
                         f"resume\n")
        raise SystemExit(130) from None
    return summary


def _data(args, run: Source):
    """The data collect reads (``--data``, ``--data-path``, else the run's own), its
    resolved values written back into ``args`` (recorded: what was read)."""
    origin = training_data("--data", args.data, data_path=args.data_path, packing=args.packing,
                           max_docs=args.max_docs, source=run)
    data = source_data(origin, run, args)
    args.data, args.data_path = recorded_data(data.origin)
    args.packing, args.max_docs, args.seq_len = data.origin.packing, data.origin.max_docs, \
        data.seq_len
    return data


@contextmanager
def _signals_deferred():
    """SIGINT/SIGTERM that arrive while rows are being committed wait until the commit is
    done, then interrupt as usual (``KeyboardInterrupt``): a stop never lands between a
    commit taking the buffered rows and writing them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in old:
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if got:
        raise KeyboardInterrupt


def _sigterm_interrupts() -> None:
    """SIGTERM (a scheduler's stop) takes Ctrl-C's path: the buffered rows are committed."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _seal(path: Path, rank: int, world: int) -> None:
    """Once every rank has closed its writer, rank 0 records the store as complete."""
    if world > 1:
        torch.distributed.barrier()
    if rank == 0 and store_files(path):  # nothing was written when no rank had rows
        seal_store(path)
    if world > 1:
        torch.distributed.barrier()


if __name__ == "__main__":
    sys.exit(cli.run(main))
