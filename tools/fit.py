"""Fit K-FAC / EK-FAC curvature factors of checkpoints on a dataset.

    python tools/fit.py --run-dir runs/main/selection --checkpoint all \
        --data data/corpus/train.jsonl --max-docs 500 --out runs/main/factors
    torchrun --standalone --nproc_per_node 2 tools/fit.py --run-dir ...  # summed over ranks
    deepspeed --num_gpus 2 tools/fit.py --run-dir ...
    python tools/fit.py --checkpoints 'hf_out/checkpoint-*' --data ... --out factors
        # every listed Hugging Face checkpoint folder (docs/offline_tools.md)

``--checkpoint all`` (or a comma list) fits every checkpoint, one ``<out>/<tag>.pt`` each,
for ``attribute --method ekfac-trajectory --factors <out>``; one tag with an ``--out``
ending in ``.pt`` writes that file. With ``--store`` (a store, or the folder of
per-checkpoint stores of ``collect``, attached by its spec: plain rows of this run's
checkpoint and weights) the factors live in the store's Kronecker-projected space (LoGra:
cheaper and less faithful than rows whitened by exact factors, docs/attribution_fidelity.md);
without it they are exact.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dattri_ds import (  # noqa: E402
    CaptureConfig, KFACConfig, ProjectionConfig, Projector, fit_factors,
)
from dattri_ds.cli import exits as cli  # noqa: E402
from dattri_ds.distributed import ParallelContext  # noqa: E402
from dattri_ds.errors import ConfigError  # noqa: E402
from dattri_ds.io.outputs import check_dir, check_file, writing  # noqa: E402
from dattri_ds.plan import check_tool  # noqa: E402
from dattri_ds.store import StoreRequest, attach  # noqa: E402
from dattri_ds.store.attach import model_layers  # noqa: E402
from dattri_ds.tools.configs import DATA, FIT, add_flags, values  # noqa: E402
from dattri_ds.tools.datasets import source_data  # noqa: E402
from dattri_ds.tools.gradients import gradients  # noqa: E402
from dattri_ds.tools.provenance import (  # noqa: E402
    recorded_data, training_data, write_config,
)
from dattri_ds.tools.runtime import (  # noqa: E402
    announce, init_distributed, logger, setup_logging,
)
from dattri_ds.tools.sources import (  # noqa: E402
    add_checkpoint_args, add_source_args, open_source, source_tags, tag_choice,
)
from dattri_ds.tools.stores import store_of, store_origin  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds fit", description=__doc__.splitlines()[0])
    add_source_args(p)
    p.add_argument("--checkpoint", default=None,
                   help="'last' (default), 'all' or comma-separated tags of --run-dir (several: "
                        "--out is a folder)")
    add_checkpoint_args(p, "checkpoints to fit, as --checkpoint")
    p.add_argument("--data", default=None, help="jsonl of documents or token ids to fit on "
                   "(default: with --run-dir, the run's own training data and --max-docs)")
    add_flags(p, DATA)  # --data-path (prepared data) and --packing
    p.add_argument("--store", help="fit in this store's space if it is Kronecker-projected "
                   "(LoGra; a folder of per-checkpoint stores for several checkpoints); "
                   "exact factors for other projections")
    add_flags(p, FIT)  # the Kronecker ProjectionConfig, KFACConfig, FitOptions
    p.add_argument("--out", required=True, help="factors file (.pt, one checkpoint) or folder")
    p.add_argument("--force", action="store_true", help="replace existing factor files")
    return p


#: The fit flag that sets each compared field (``{stored}``: the store's value).
_FIXES = {
    "projection.kind": "drop --projection-dim: the store is {stored}-projected, its factors "
    "are exact", "projection.dim": "--projection-dim {stored}, or drop it (the store's)",
    "projection.seed": "--seed {stored}, or drop it (the store's)",
    "whitened": "fit on a store of plain projected gradients (collect without --whiten), "
    "or without --store",
    "layers": "fit with the model the store was collected from",
    "checkpoint": "--checkpoint {stored}, or --store the store of this checkpoint",
    "weights_hash": "--run-dir / --model whose checkpoint the store was collected at",
    "fingerprint": "--run-dir / --model of the model the store was collected from",
    "run_id": "--run-dir of the run the store was collected from",
}


def store_request(args, run, tag: str, model):
    """What ``fit --store`` takes from the store of ``tag``: rows of this model, checkpoint
    and weights, plain (not whitened), with the Kronecker size and seed given by flag."""
    projection = values(args, FIT, ProjectionConfig)  # the fields given by flag
    if "dim" in projection:
        projection["kind"] = "kronecker"
    return StoreRequest(
        consumer="fit --store", projection=projection, layers=model_layers(model),
        whitening=(None, None), fixes=_FIXES,
        origin=store_origin(run, tag, model),
        otherwise=f"fit without --store (exact factors), or --store a store of checkpoint "
                  f"'{tag}'")


def store_space(args, run, tag: str, model):
    """``(projection, capture)`` of ``fit --store``: the store's projection when it is
    Kronecker-projected (else None: exact factors), and its capture semantics; without
    ``--store``, ``--projection-dim`` (Kronecker) or exact. The store is attached (compared
    with this fit) through ``dattri_ds.store.attach``.

    Raises:
        StoreMismatchError: the store was collected from another model, checkpoint or
            weights, holds whitened rows, or differs from --projection-dim / --seed.
        StoreCorruptError: its manifest or a shard is damaged (named).
    """
    if not args.store:
        given = values(args, FIT, ProjectionConfig)
        if "dim" in given:
            return ProjectionConfig(kind="kronecker", **given), CaptureConfig()
        return None, CaptureConfig()  # exact factors
    path = store_of(Path(args.store), tag)
    with attach(path, store_request(args, run, tag, model), mode="read") as store:
        proj, semantics = store.spec.projection_cfg(), store.spec.semantics or {}
    if proj.strategy.factorized:
        return proj, CaptureConfig(**semantics)
    logger.info("store %s is %s-projected (no Kronecker structure): fitting exact factors; "
                "attribute preconditions the query exactly and projects it", path, proj.kind)
    return None, CaptureConfig(**semantics)


def _config(args) -> KFACConfig:
    return KFACConfig(**values(args, FIT, KFACConfig))


def main(argv: list[str] | None = None) -> list[Path]:
    args = build_parser().parse_args(argv)
    rank, world = init_distributed()
    setup_logging(rank, args.verbose)
    run = open_source(args)
    if args.checkpoint is not None and tag_choice(args) is not None:
        raise ConfigError(f"Give one of --checkpoint {args.checkpoint} and --checkpoints "
                          f"{' '.join(args.checkpoints)}: both choose the checkpoints to fit")
    tags = source_tags(run, args, "last", "--checkpoint" if args.checkpoint else "--checkpoints",
                       chosen=args.checkpoint)
    origin = training_data("--data", args.data, data_path=args.data_path, packing=args.packing,
                           max_docs=args.max_docs, source=run)
    data = source_data(origin, run, args)
    args.data, args.data_path = recorded_data(data.origin)  # recorded: what was read
    args.max_docs, args.seq_len, args.packing = origin.max_docs, data.seq_len, \
        data.origin.packing
    rows = torch.arange(rank, len(data), world)
    given = values(args, FIT, ProjectionConfig)
    announce("fit", data=data.origin.describe(len(data)), checkpoints=",".join(tags),
             method="kfac" if args.kfac_only else "ekfac",
             projection=f"the store {args.store}'s (LoGra if Kronecker)" if args.store else
             f"kronecker k={given['dim']} (LoGra)" if "dim" in given else "none (exact factors)",
             out=args.out)
    check_tool(run.root, args, seq_len=data.seq_len, examples=len(data),  # the size door
               method="kfac" if args.kfac_only else "ekfac")
    one_file = len(tags) == 1 and Path(args.out).suffix == ".pt"
    if one_file:  # the output door, before any work
        check_file(args.out, flag="--out", force=args.force)
    else:
        check_dir(args.out, flag="--out", force=args.force, overwrites=[f"{t}.pt" for t in tags])
    written = []
    for tag in tags[1:] if args.store else ():  # every store is checked before any work
        store_space(args, run, tag, run.model(tag))
    for tag in tags:
        t0 = time.perf_counter()
        model = run.model(tag)
        proj, capture = store_space(args, run, tag, model)

        # exact factorized gradients, captured once (fit_factors spills them for EK-FAC)
        batches = gradients(model, data, rows, capture=capture,
                            batch_size=args.batch_size, progress=f"fit {tag}")
        factors = fit_factors(batches, config=_config(args),
                              projector=Projector(proj) if proj else None,
                              ekfac=not args.kfac_only, ctx=ParallelContext.from_default_group())
        out = Path(args.out) if one_file else Path(args.out) / f"{tag}.pt"
        written.append(out)
        if rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            with writing(out, new_file=True):
                factors.save(out)
            logger.info("factors of %s (%s, %d examples x %d ranks) -> %s in %.1f s", tag,
                        "ekfac" if not args.kfac_only else "kfac", rows.numel(), world, out,
                        time.perf_counter() - t0)
    if rank == 0:
        base = Path(args.out)
        write_config(base.parent if one_file else base, (base.stem + "_" if one_file else "")
                     + "fit", args)
    return written


if __name__ == "__main__":
    sys.exit(cli.run(main))
