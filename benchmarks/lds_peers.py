"""The peers on the LDS benchmark: kronfluence's EK-FAC and LogIX's LoGra EK-FAC scored
against the ground truth that ``benchmarks/lds.py`` saved (no subset is retrained).

For each seed of ``--out`` (``<out>/seed<s>/lds.json`` written by ``benchmarks/lds.py`` with
the same regime flags), the full run is trained again from the same initialization
(``lds.full_run``: deterministic; its query losses are checked against the saved ones), the
final model's GPT-2 ``Conv1D`` layers are swapped for equivalent ``nn.Linear`` (with their
biases: the peers hook only ``nn.Linear``), and every peer point attributes the N training
documents to the queries with the library's own pipeline (fit + gradients + scores, single
thread, ``time.process_time`` of that region only, a fresh copy of the model each). Per-
example loss: the summed token loss of the document (dattri-ds's ``per_example_loss="sum"``),
padding masked. Points (each library's own defaults unless named):

* ``kronfluence ekfac``: EK-FAC, true Fisher (labels sampled from the model), damping 1e-8
  (its defaults); ``kronfluence ekfac emp-0.1``: empirical Fisher, damping 0.1 x mean
  eigenvalue (``benchmarks/peers.py``'s setting). Unprojected: it stores no rows; bytes per
  row = the fp32 gradient of its tracked layers that it materializes.
* ``logix ekfac:<k>``: ``add_lora`` with rank r (k = r^2 per layer, random LoGra
  projection), covariances then EK-FAC eigenvalues in the projected space, the projected
  rows logged, the query preconditioned (damping 0.1 x mean eigenvalue, its default).

The peers attribute the model's ``nn.Linear`` layers (attention, MLP, the LM head); the
embeddings and norms, which dattri-ds also attributes, are not hookable by them. Writes
``<out>/peers.json`` (LDS per seed, mean +- s.e., CPU seconds, bytes per row), read by
``benchmarks/lds_frontier.py``. Run it with the peers' virtualenv, with the regime flags of
the ``lds.py`` run, e.g.::

    .venv-peers/bin/python benchmarks/lds_peers.py --out runs/frontier/A --repeats 3 \\
        --subsets 24 --seeds 1
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

import lds as bench  # noqa: E402  (benchmarks/lds.py)

from dattri_ds.models.causal_lm import build_model  # noqa: E402
from dattri_ds.eval import lds, predicted  # noqa: E402

logger = logging.getLogger("benchmarks.lds_peers")
BATCH = 16


def linearized(model: nn.Module) -> nn.Module:
    """``model`` with every HF ``Conv1D`` (``x @ W + b``, W ``[I, O]``) replaced by the
    equivalent ``nn.Linear`` (weight ``W^T``, same bias)."""
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                lin = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                lin.weight.data.copy_(child.weight.data.T)
                lin.bias.data.copy_(child.bias.data)
                setattr(parent, name, lin)
    return model


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def token_losses(model: nn.Module, batch: dict, sample: bool = False) -> torch.Tensor:
    """Summed next-token loss of the batch (padding, ``labels == -100``, masked); ``sample``:
    against labels drawn from the model's own next-token distribution (the true Fisher's),
    from the same forward."""
    logits = model(input_ids=batch["input_ids"],
                   attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    if sample:
        with torch.no_grad():
            draw = torch.multinomial(logits.detach().softmax(-1).flatten(0, 1), 1)
        labels = torch.where(labels != -100, draw.view(labels.shape), -100)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def rows_of(ds) -> list[dict]:
    return [{k: v[i] for k, v in ds.batch(slice(0, len(ds))).items()} for i in range(len(ds))]


# ---- peers --------------------------------------------------------------------------------
def kronfluence_ekfac(model: nn.Module, ds, qds, tmp: str, empirical: bool,
                      damping: float | None) -> tuple[torch.Tensor, int]:
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    names = linear_names(model)

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            return token_losses(model, batch, sample)

        def compute_measurement(self, batch, model):
            return token_losses(model, batch)

        def get_influence_tracked_modules(self):
            return names

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

    task = LMTask()
    train, query = rows_of(ds), rows_of(qds)
    model = prepare_model(model, task)
    an = Analyzer(analysis_name="lds", model=model, task=task, output_dir=tmp,
                  disable_tqdm=True, disable_model_save=True)
    an.fit_all_factors(factors_name="ekfac", dataset=train, per_device_batch_size=BATCH,
                       factor_args=FactorArguments(strategy="ekfac",
                                                   use_empirical_fisher=empirical),
                       overwrite_output_dir=True)
    an.compute_pairwise_scores(scores_name="s", factors_name="ekfac", query_dataset=query,
                               train_dataset=train, per_device_query_batch_size=len(query),
                               per_device_train_batch_size=BATCH,
                               score_args=ScoreArguments(damping_factor=damping),
                               overwrite_output_dir=True)
    scores = an.load_pairwise_scores("s")["all_modules"].T.float()
    dim = sum(m.original_module.weight.numel() + (m.original_module.bias.numel()
                                                 if m.original_module.bias is not None else 0)
              for m in model.modules() if hasattr(m, "original_module"))
    return scores, 4 * dim


def logix_ekfac(model: nn.Module, ds, qds, tmp: str, rank: int) -> tuple[torch.Tensor, int]:
    from logix import LogIX

    cfg = os.path.join(tmp, "logix.yaml")
    Path(cfg).write_text(f"root_dir: {tmp}\nlora:\n  rank: {rank}\n  init: random\n")
    names = linear_names(model)

    def backward(run, batch: dict, tags: list[str]) -> None:
        with run(data_id=tags, mask=batch["attention_mask"]):
            model.zero_grad(set_to_none=True)
            token_losses(model, batch).backward()

    tags = [f"t{i}" for i in range(len(ds))]
    parts = [(tags[s:s + BATCH], ds.batch(slice(s, s + BATCH))) for s in range(0, len(ds), BATCH)]
    run = LogIX("lds", config=cfg)
    run.watch(model, name_filter=names)
    run.add_lora()
    run.setup({"forward": ["covariance"], "backward": ["covariance"]})
    for t, b in parts:
        backward(run, b, t)
    run.setup({"grad": ["log", "corrected_eigval"]})
    run.save(True)
    for t, b in parts:
        backward(run, b, t)
    run.finalize()
    run.eval()
    run.setup({"grad": ["log"]})
    backward(run, qds.batch(slice(0, len(qds))), [f"q{i}" for i in range(len(qds))])
    result = run.compute_influence_all(run.get_log(), run.build_log_dataloader(BATCH))
    where = {t: i for i, t in enumerate(result["tgt_ids"])}
    dim = sum(m.logix_lora_B.weight.numel() for m in model.modules()
              if hasattr(m, "logix_lora_B"))
    return result["influence"].T[[where[t] for t in tags]].float(), 4 * dim


def points(ranks: list[int]) -> dict:
    """``{(method, projection): fn(model, ds, qds, tmp) -> (scores [N, Q], bytes per row)}``."""
    out = {("kronfluence ekfac", "exact"):
           lambda m, d, q, t: kronfluence_ekfac(m, d, q, t, empirical=False, damping=1e-8),
           ("kronfluence ekfac emp-0.1", "exact"):
           lambda m, d, q, t: kronfluence_ekfac(m, d, q, t, empirical=True, damping=None)}
    for r in ranks:
        out[("logix ekfac", f"logra:{r * r}")] = (
            lambda m, d, q, t, r=r: logix_ekfac(m, d, q, t, rank=r))
    return out


# ---- driver -------------------------------------------------------------------------------
def one_seed(args: argparse.Namespace, todo: dict) -> list[dict]:
    saved = json.loads((Path(args.out) / "lds.json").read_text())
    tok, ds, qds = bench.load_data(args)
    if saved["train_ids"] != list(ds.ids) or saved["query_ids"] != list(qds.ids):
        raise SystemExit(f"{args.out}: the saved run holds other documents; rerun lds.py")
    init = build_model(bench.model_config(args), tokenizer=tok, seed=args.seed)
    states, full_loss = bench.full_run(bench.make_trainer(init, ds, args), init, ds, qds, args)
    diff = float((torch.tensor(saved["full_model_query_loss"]) - full_loss).abs().max())
    logger.info("seed %d: full run retrained, query losses within %.2e of the saved run",
                args.seed, diff)
    if diff > 1e-3:
        raise SystemExit(f"seed {args.seed}: the retrained full model differs from the saved "
                         f"one (query loss diff {diff:.2e}); same torch/transformers needed")
    final = copy.deepcopy(init)
    final.load_state_dict(states[-1][1])
    final = linearized(final.eval())
    masks = torch.tensor(saved["masks"], dtype=torch.bool)
    actual = torch.tensor(saved["retrained_query_loss"])
    rows = []
    for (method, projection), fn in todo.items():
        model = copy.deepcopy(final)
        torch.manual_seed(args.seed)
        with tempfile.TemporaryDirectory(prefix="lds_peers_") as tmp:
            t0 = time.process_time()
            scores, nbytes = fn(model, ds, qds, tmp)
            seconds = time.process_time() - t0
        res = lds(predicted(scores, masks), actual)
        rows.append({"method": method, "projection": projection, "lds_mean": res.mean,
                     "time_s": seconds, "bytes_per_row": nbytes, "seed": args.seed,
                     "full_loss_diff": diff})
        logger.info("seed %d %-26s %-12s LDS %+.3f in %.2f CPU s, %d bytes/row", args.seed,
                    method, projection, res.mean, seconds, nbytes)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for key in dict.fromkeys((r["method"], r["projection"]) for r in rows):
        rs = [r for r in rows if (r["method"], r["projection"]) == key]
        lds_t = torch.tensor([r["lds_mean"] for r in rs], dtype=torch.float64)
        t = torch.tensor([r["time_s"] for r in rs], dtype=torch.float64)
        se = (lambda x: float(x.std() / len(x) ** 0.5) if len(x) > 1 else 0.0)
        out.append({"method": key[0], "projection": key[1], "lds_mean": float(lds_t.mean()),
                    "lds_se": se(lds_t), "time_s": float(t.mean()), "time_se": se(t),
                    "bytes_per_row": rs[0]["bytes_per_row"], "seeds": len(rs),
                    "per_seed": lds_t.tolist()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--logix-ranks", default="16,32,64",
                   help="LogIX LoGra ranks r per side (k = r^2 per layer)")
    own, rest = p.parse_known_args()
    args = bench.parse_args(rest)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    todo = points([int(r) for r in own.logix_ranks.split(",") if r.strip()])
    rows = []
    for seed in range(args.seed, args.seed + args.repeats):
        one = argparse.Namespace(**{**vars(args), "seed": seed, "repeats": 1,
                                    "out": str(Path(args.out) / f"seed{seed}")
                                    if args.repeats > 1 else args.out})
        rows += one_seed(one, todo)
    summary = {"seeds": list(range(args.seed, args.seed + args.repeats)),
               "results": summarize(rows), "per_seed": rows,
               "versions": _versions()}
    (Path(args.out) / "peers.json").write_text(json.dumps(summary, indent=1))
    for r in summary["results"]:
        print(f"{r['method']:28s} {r['projection']:12s} LDS {r['lds_mean']:+.3f} ± "
              f"{r['lds_se']:.3f}  CPU s {r['time_s']:.2f} ± {r['time_se']:.2f}  "
              f"bytes/row {r['bytes_per_row']}")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "kronfluence", "logix-ai"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    main()
