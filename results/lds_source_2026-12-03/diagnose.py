"""Why SOURCE scores as it does on benchmark A: eta K lambda per segment, and variants.

Rebuilds one seed of ``tools/lds.py`` (same full run, checkpoints and captures: the training
is deterministic per seed), fits EK-FAC at every checkpoint (library defaults), prints per
segment the horizon ``eta K`` and how much of the damped EK-FAC spectrum has ``eta K h``
above 0.1 / 1 (where SOURCE departs from ``eta K`` x grad-dot), and scores SOURCE variants
against the seed's saved subsets and retrained losses (``<runs>/seed<s>/lds.json``): the
learning rate multiplied by m (Adam's per-coordinate step ``eta / sqrt(v)`` is far larger
than ``eta``), each segment normalized per query, the final segment alone, and each
segment scored alone against its own checkpoint's query (no propagation), normalized.

    python results/lds_source_2026-12-03/diagnose.py --runs /work/runs/lds_source --seed 0
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dattri_ds import Checkpoint, make_attributor  # noqa: E402
from dattri_ds.eval import lds, predicted  # noqa: E402
from dattri_ds.recipe import Recipe  # noqa: E402
from tools import lds as bench  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="/work/runs/lds_source")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    saved = json.loads((Path(a.runs) / f"seed{a.seed}" / "lds.json").read_text())
    args = bench.parse_args(["--seed", str(a.seed), "--projections", "exact"])
    tok, ds, qds = bench.load_data(args)
    init = bench.build_model(bench.model_config(args), tokenizer=tok, seed=args.seed)
    states, _ = bench.full_run(bench.make_trainer(init, ds, args), init, ds, qds, args)
    grads = bench.capture_checkpoints(states, copy.deepcopy(init), ds, qds)
    assert ds.ids == saved["train_ids"], "not the saved seed's data"
    masks = torch.tensor(saved["masks"], dtype=torch.bool)
    actual = torch.tensor(saved["retrained_query_loss"])
    recipe = Recipe(method="source")
    per_epoch = -(-len(ds) // args.batch_size)
    cks = []
    for g in grads:
        cks.append(Checkpoint(g["train"], g["query"][0], g["lr"], recipe.fit(g["train"]),
                              step=g["epoch"] * per_epoch))
    report = {"seed": a.seed, "segments": [], "variants": {}}
    horizons = make_attributor("source").horizons(cks)
    for c, (ck, hz) in enumerate(zip(cks, horizons)):
        hs = []
        for lf in ck.factors.layers.values():
            ev = ck.factors._eigenvalues(lf, "ekfac").flatten()
            hs.append(ev + ck.factors.config.damping * ev.mean())
        h = torch.cat(hs).double()
        x = hz * h
        seg = {"checkpoint_step": ck.step, "eta_K": hz, "h_max": float(h.max()),
               "h_median": float(h.median()), "x_max": float(x.max()),
               "frac_x_gt_0.1": float((x > 0.1).double().mean()),
               "frac_x_gt_1": float((x > 1).double().mean()),
               "trace_share_x_gt_1": float(h[x > 1].sum() / h.sum())}
        report["segments"].append(seg)
        print(json.dumps(seg))

    def score(name, checkpoints, **kw):
        per: list[torch.Tensor] = []
        v = make_attributor("source", **kw).trajectory_scores(checkpoints, per_checkpoint=per)
        res = lds(predicted(v.values, masks), actual)
        std = [float(s.std()) for s in per]
        report["variants"][name] = {"lds": res.mean, "segment_std": std}
        print(f"{name:28s} LDS {res.mean:+.3f}  per-segment score std {['%.2g' % s for s in std]}")

    for m in (1, 10, 100, 1000, 10000):
        score(f"source lr x{m}", [ck._replace(lr=ck.lr * m) for ck in cks])
    for m in (1, 100):
        score(f"source lr x{m} normalized", [ck._replace(lr=ck.lr * m) for ck in cks],
              weighting="normalized")
    score("source final segment only", cks[-1:])
    # each segment alone with its own checkpoint's query (no propagation, no final query):
    # the unrolled f(h) in place of ekfac-trajectory's (h)^-p, normalized as it is
    for m in (1, 100):
        total = 0.0
        prev = 0
        for ck in cks:
            one = ck._replace(lr=ck.lr * m, step=ck.step - prev)
            prev = ck.step
            v = make_attributor("source").trajectory_scores([one]).values
            total = total + v / v.std(0, keepdim=True)
        res = lds(predicted(total, masks), actual)
        report["variants"][f"per-segment own query lr x{m} normalized"] = {"lds": res.mean}
        print(f"per-segment own query lr x{m} normalized  LDS {res.mean:+.3f}")
    out = Path(a.runs) / f"diagnose_seed{a.seed}.json"
    out.write_text(json.dumps(report, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
