"""Fit K-FAC / EK-FAC curvature factors of checkpoints on a dataset.

    python tools/fit.py --run-dir runs/main/selection --checkpoint all \
        --data data/corpus/train.jsonl --max-docs 500 --out runs/main/factors
    torchrun --standalone --nproc_per_node 2 tools/fit.py --run-dir ...  # summed over ranks
    deepspeed --num_gpus 2 tools/fit.py --run-dir ...

``--checkpoint all`` (or a comma list) fits every checkpoint, one ``<out>/<tag>.pt`` each,
for ``attribute --method ekfac-trajectory --factors <out>``; one tag with an ``--out``
ending in ``.pt`` writes that file. With ``--store`` (a store, or the folder of
per-checkpoint stores of ``collect``) the factors live in the store's Kronecker-projected
space (LoGra): the most faithful way to score a projected store (README, "Attribution
fidelity"). Without it they are exact, for attributing exact (unprojected) gradients.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dattri_ds.ops.kronecker import KFACConfig  # noqa: E402
from dattri_ds.ops.projection import ProjectionConfig  # noqa: E402
from dattri_ds.schema import add_flag, field_flag  # noqa: E402
from dattri_ds.tools.common import (  # noqa: E402
    add_source_args, gradients, init_distributed, load_texts, logger, open_source,
    projection_from_tag, seq_len_of, setup_logging, write_config,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds fit", description=__doc__.splitlines()[0])
    add_source_args(p)
    p.add_argument("--checkpoint", default="last",
                   help="'last', 'all' or comma-separated tags (several: --out is a folder)")
    p.add_argument("--data", default="data/corpus/train.jsonl")
    add_flag(p, "--max-docs", int, ge=1, default=None)
    p.add_argument("--store", help="fit in this store's space if it is Kronecker-projected "
                   "(LoGra; a folder of per-checkpoint stores for several checkpoints); "
                   "exact factors for other projections")
    p.add_argument("--projection-dim",
                   type=field_flag(ProjectionConfig, "dim", name="--projection-dim"), default=None,
                   help="Kronecker projection size (default: exact, or from --store)")
    p.add_argument("--seed", type=field_flag(ProjectionConfig, "seed", name="--seed"), default=0)
    p.add_argument("--damping", type=field_flag(KFACConfig, "damping", name="--damping"),
                   default=None,
                   help="relative or absolute damping (default: KFACConfig's)")
    p.add_argument("--damping-mode", choices=["relative", "absolute"], default=None)
    p.add_argument("--power", type=field_flag(KFACConfig, "power", name="--power"),
                   default=None, help="exponent of the curvature inverse (default: "
                   "KFACConfig's)")
    p.add_argument("--kfac-only", action="store_true", help="skip the EK-FAC pass")
    add_flag(p, "--batch-size", int, ge=1, default=8)
    p.add_argument("--out", required=True, help="factors file (.pt, one checkpoint) or folder")
    return p


def _projection(args, tag: str):
    from dattri_ds import ProjectionConfig
    if args.store:
        root = Path(args.store)
        info_path = root / "info.json" if (root / "info.json").exists() \
            else root / tag / "info.json"
        info = json.loads(info_path.read_text())
        proj = projection_from_tag(info["spec"]["projection"])
        if proj.kind == "kronecker":
            return proj
        logger.info("store %s is %s-projected (no Kronecker structure): fitting exact factors; "
                    "attribute preconditions the query exactly and projects it", args.store,
                    proj.kind)
        return None
    if args.projection_dim:
        return ProjectionConfig(kind="kronecker", dim=args.projection_dim, seed=args.seed)
    return None  # exact factors


def _config(args):
    from dattri_ds import KFACConfig
    given = {k: v for k, v in (("damping", args.damping), ("damping_mode", args.damping_mode),
                               ("power", args.power)) if v is not None}
    return KFACConfig(**given)


def main(argv: list[str] | None = None) -> list[Path]:
    from dattri_ds import CaptureConfig, Projector, fit_factors
    from dattri_ds.distributed import ParallelContext

    args = build_parser().parse_args(argv)
    rank, world = init_distributed()
    setup_logging(rank)
    run = open_source(args)
    tags = run.tags(args.checkpoint)
    data = load_texts(args.data, run.tokenizer, seq_len_of(run, args), args.max_docs)
    rows = torch.arange(rank, len(data), world)
    one_file = len(tags) == 1 and Path(args.out).suffix == ".pt"
    written = []
    for tag in tags:
        t0 = time.perf_counter()
        model = run.model(tag)
        proj = _projection(args, tag)

        # exact factorized gradients, captured once (fit_factors spills them for EK-FAC)
        batches = gradients(model, data, rows, capture=CaptureConfig(),
                            batch_size=args.batch_size, progress=f"fit {tag}")
        factors = fit_factors(batches, config=_config(args),
                              projector=Projector(proj) if proj else None,
                              ekfac=not args.kfac_only, ctx=ParallelContext.from_default_group())
        out = Path(args.out) if one_file else Path(args.out) / f"{tag}.pt"
        written.append(out)
        if rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
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
    from dattri_ds.cli import run

    sys.exit(run(main))
