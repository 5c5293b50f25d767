"""Score a saved attribution against retraining: its Linear Datamodeling Score (LDS).

    dattri-ds lds --attribution runs/main/attr --ground-truth truth.json

``truth.json`` is what you measured by retraining: ``{"subsets": [[id, ...], ...],
"losses": [[loss, ...], ...]}``, the S subsets' training document ids and the query losses
of the model retrained on each (``[S][Q]``, queries in the order of the attribution's
``queries.json``). A training row belongs to subset s when its document id (the sample id
before ``#``) is listed. The LDS (``dattri_ds.eval.lds``: mean over queries of the Spearman
correlation between ``-(mask @ scores)`` and the retrained losses) is printed with its
standard deviation over queries and every query's correlation (``--json`` for machines).
The benchmark that trains the models and retrains them on subsets is
``benchmarks/lds.py`` (docs/attribution_fidelity.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dattri_ds.cli import exits as cli  # noqa: E402
from dattri_ds.io import files  # noqa: E402
from dattri_ds.sample_id import SampleId  # noqa: E402
from dattri_ds.errors import InputFileError  # noqa: E402
from dattri_ds.eval import lds, predicted  # noqa: E402
from dattri_ds.tools.report import read_attribution  # noqa: E402

_FIX = ('pass --ground-truth a JSON object {"subsets": [[doc id, ...] per subset], "losses": '
        '[[query loss, ...] per subset]}')
#: ``--scores`` choices: the attribution's scores.npy (with its text prior, if any) or the
#: method's own scores (model_scores.npy, written when a text prior was mixed in).
SCORE_FILES = {"scores": "scores.npy", "model": "model_scores.npy"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds lds", description=__doc__.splitlines()[0])
    p.add_argument("--attribution", required=True, help="output folder of dattri-ds attribute")
    p.add_argument("--ground-truth", required=True,
                   help='JSON {"subsets": [[doc id, ...], ...], "losses": [[loss, ...], ...]}')
    p.add_argument("--scores", choices=sorted(SCORE_FILES), default="scores",
                   help="score the attribution's scores.npy or the method's own model_scores.npy")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def read_truth(path: str, train_ids: list[str], n_queries: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """``(masks [S, N], losses [S, Q])`` from the ground-truth file, checked against the
    attribution's training rows and queries."""
    truth = files.read_json(path, "--ground-truth file", flag="--ground-truth", fix=_FIX)
    subsets, losses = (truth.get(k) if isinstance(truth, dict) else None
                       for k in ("subsets", "losses"))
    if not (isinstance(subsets, list) and subsets and all(isinstance(s, list) for s in subsets)):
        raise InputFileError(f"--ground-truth file {path}: 'subsets' must be a non-empty list "
                             f"of id lists. Fix: {_FIX}")
    if not (isinstance(losses, list) and len(losses) == len(subsets) and all(
            isinstance(r, list) and len(r) == n_queries for r in losses)):
        raise InputFileError(f"--ground-truth file {path}: 'losses' must hold one list of "
                             f"{n_queries} query losses per subset ({len(subsets)} subsets). "
                             f"Fix: {_FIX}")
    bad = next(((s, q, v) for s, row in enumerate(losses) for q, v in enumerate(row)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)),
               None)
    if bad is not None:
        raise InputFileError(f"--ground-truth file {path}: losses[{bad[0]}][{bad[1]}] is "
                             f"{bad[2]!r}, not a finite number (a retrained model's loss on "
                             f"query {bad[1]}). Fix: measure that loss again, or leave subset "
                             f"{bad[0]} out of the file")
    docs = [SampleId.parse(i).doc for i in train_ids]
    known = set(docs)
    unknown = sorted({str(i) for s in subsets for i in s} - known)
    if unknown:
        raise InputFileError(f"--ground-truth file {path}: {len(unknown)} subset id(s) are not "
                             f"training rows of the attribution, e.g. {unknown[:3]}. Fix: list "
                             f"the document ids the attribution scored (its train_ids.json)")
    members = [set(map(str, s)) for s in subsets]
    masks = torch.tensor([[d in m for d in docs] for m in members])
    return masks, torch.tensor(losses, dtype=torch.float64)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    att = Path(args.attribution)
    summary, queries, _, train_ids, scores = read_attribution(att)
    if args.scores != "scores":
        scores = files.load_array(att / SCORE_FILES[args.scores], "method scores",
                                  "attribute writes model_scores.npy only with a text prior; "
                                  "use --scores scores")
    masks, actual = read_truth(args.ground_truth, train_ids, len(queries))
    result = lds(predicted(torch.as_tensor(scores).double(), masks), actual)
    out = {"method": summary["method"], "scores": SCORE_FILES[args.scores],
           "subsets": int(masks.shape[0]), "lds_mean": result.mean, "lds_std": result.std,
           "per_query": {q["id"]: float(r) for q, r in zip(queries, result.per_query)}}
    if args.json:
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        sys.stdout.write(f"LDS of {out['method']} ({out['scores']}, {out['subsets']} subsets): "
                         f"{result.mean:.3f} +- {result.std:.3f} over {len(queries)} queries\n")
        for qid, r in out["per_query"].items():
            sys.stdout.write(f"  {qid}: {r:.3f}\n")
    return out


if __name__ == "__main__":
    sys.exit(cli.run(main))
