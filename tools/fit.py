"""Fit K-FAC / EK-FAC curvature factors of a checkpoint on a dataset.

    python tools/fit.py --run-dir runs/main/selection --checkpoint last \
        --data data/corpus/train.jsonl --max-docs 500 --out runs/main/factors.pt
    torchrun --standalone --nproc_per_node 2 tools/fit.py --run-dir ...  # summed over ranks
    deepspeed --num_gpus 2 tools/fit.py --run-dir ...

With ``--projection-dim`` (default: that of ``--store``) the factors live in the store's
Kronecker-projected space (LoGra), so ``attribute --method ekfac`` can score a projected
store; ``--projection-dim 0`` fits exact factors.
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

from dattri_ds.tools.common import (  # noqa: E402
    add_source_args, gradients, init_distributed, load_texts, logger, open_source,
    projection_from_tag, seq_len_of, setup_logging, write_config,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds fit", description=__doc__.splitlines()[0])
    add_source_args(p)
    p.add_argument("--checkpoint", default="last", help="tag, or 'last'")
    p.add_argument("--data", default="data/corpus/train.jsonl")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--store", help="fit in this store's projected space (reads its spec)")
    p.add_argument("--projection-dim", type=int, default=None,
                   help="Kronecker projection size (0 = exact; default: from --store)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--damping", type=float, default=0.1)
    p.add_argument("--damping-mode", choices=["relative", "absolute"], default="relative")
    p.add_argument("--kfac-only", action="store_true", help="skip the EK-FAC pass")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", required=True, help="factors file (.pt)")
    return p


def _projection(args):
    from dattri_ds import ProjectionConfig
    if args.store:
        info = json.loads((Path(args.store) / "info.json").read_text())
        return projection_from_tag(info["spec"]["projection"])
    if args.projection_dim:
        return ProjectionConfig(dim=args.projection_dim, seed=args.seed)
    return None


def main(argv: list[str] | None = None) -> Path:
    from dattri_ds import CaptureConfig, KFACConfig, Projector, fit_factors
    from dattri_ds.distributed import ParallelContext

    args = build_parser().parse_args(argv)
    rank, world = init_distributed()
    setup_logging(rank)
    run = open_source(args)
    tag = run.tags(args.checkpoint)[0]
    data = load_texts(args.data, run.tokenizer, seq_len_of(run, args), args.max_docs)
    model = run.model(tag)
    proj = _projection(args)
    rows = torch.arange(rank, len(data), world)
    t0 = time.perf_counter()

    def batches():  # exact factorized gradients; the factors project per side themselves
        return gradients(model, data, rows, capture=CaptureConfig(), batch_size=args.batch_size,
                         progress=f"fit {tag}")

    factors = fit_factors(batches, config=KFACConfig(damping=args.damping,
                                                     damping_mode=args.damping_mode),
                          projector=Projector(proj) if proj else None, ekfac=not args.kfac_only,
                          ctx=ParallelContext.from_default_group())
    out = Path(args.out)
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        factors.save(out)
        write_config(out.parent, out.stem + "_fit", args)
        logger.info("factors of %s (%s, %d examples x %d ranks) -> %s in %.1f s", tag,
                    "ekfac" if not args.kfac_only else "kfac", rows.numel(), world, out,
                    time.perf_counter() - t0)
    return out


if __name__ == "__main__":
    from dattri_ds.cli import run

    sys.exit(run(main))
