"""Megatron training through launch/train.py: tensor x data parallel (4 gloo ranks) == 1 rank.

Invariant: ``--backend megatron`` with TP=2 x DP=2 and sequence parallelism (4 forked ranks,
micro-batch 2, no accumulation), capture and online selection on, trains exactly what one
TP=1 rank with micro-batch 2 and 2 accumulation steps trains (the same examples per step in
the same micro-batches): the per-step losses, the chosen examples of every micro-batch, the
stored projected per-example gradients and the consolidated weights after 3 SGD steps agree
(rel. err <= 1e-5), and every trained example is stored and logged exactly once.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from _deps import require
import torch

require("megatron.core", "megatron")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|Torch Norm).*")
import megatron.core  # noqa: E402,F401  (imported once in the parent, before forking)

from reference import rel_err  # noqa: E402

from _dist import run  # noqa: E402

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
STEPS, MICRO = 3, 2


def _train(rank, world, argv):
    from dattri_ds.launch.train import main

    return main(argv)


def _launch(tmp: Path, name: str, world: int, tp: int, gas: int, *extra: str):
    cfg = json.loads((ROOT / "configs/zero1_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=gas,
               gradient_clipping=0.0, optimizer={"type": "SGD", "params": {"lr": 0.5}})
    cfg.pop("scheduler")
    cfg["dattri_ds"]["capture"]["projection"]["dim"] = 64
    (tmp / f"{name}.json").write_text(json.dumps(cfg))
    model = tmp / "model.json"
    model.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32,
                                 "n_positions": 64}))
    out = tmp / name
    argv = ["--backend", "megatron", "--tensor-model-parallel-size", str(tp),
            "--deepspeed_config", str(tmp / f"{name}.json"), "--model-config", str(model),
            "--out", str(out), "--steps", str(STEPS), "--capture", "--verify-checkpoints",
            "--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "32",
            "--seq-len", "32", "--vocab-size", "512", "--log-every", "1",
            "--save-every", str(STEPS), "--online-selection", "--selection-score",
            "alignment", "--target-data",
            str(ROOT / "data/tiny/target.jsonl"), "--target-max-docs", "4",
            # neighbour smoothing and the content prior (its n-gram counts of the candidate
            # stream) keep a per-rank memory of earlier candidates, so their choice depends on
            # how micro-batches are dealt to DP ranks: compared without them
            "--selection-smooth-neighbors", "null", "--selection-content-weight", "0", *extra]
    summaries = run(_train, world, timeout=300, argv=argv)
    return out, summaries


def _chosen(out: Path) -> dict[int, set[str]]:
    from dattri_ds.selection import read_selection_log

    per_step: dict[int, set[str]] = {}
    for r in read_selection_log(out / "selection.jsonl"):
        per_step.setdefault(r["step"], set()).update(r["chosen"])
    return per_step


def test_tp2_dp2_sequence_parallel_equals_one_rank(tmp_path):
    """TP=2 x DP=2 with sequence parallelism == TP=1 x DP=1 with 2 accumulation steps:
    losses, choices, stored gradients and final weights; both DP ranks log and store their
    own examples (TP rank 1 writes nothing)."""
    big, sums = _launch(tmp_path, "tp2dp2", 4, 2, 1, "--sequence-parallel")
    one, (ref,) = _launch(tmp_path, "tp1", 1, 1, 2)
    s = sums[0]
    assert (s["tensor_model_parallel_size"], s["data_parallel_size"], s["world"]) == (2, 2, 4)
    assert all(x["selection"] == sums[0]["selection"] for x in sums)  # reduced over DP
    assert s["selection"]["chosen"] == ref["selection"]["chosen"] == STEPS * MICRO * 2
    assert s["selection"]["candidates"] == ref["selection"]["candidates"]
    assert abs(s["selection"]["mean_chosen_score"] / ref["selection"]["mean_chosen_score"]
               - 1) < 1e-4
    assert json.loads((big / "model/config.json").read_text())["trained_sequence_parallel"]

    la = [r["loss"] for r in json.loads((big / "trajectory.json").read_text())["lrs"]]
    lb = [r["loss"] for r in json.loads((one / "trajectory.json").read_text())["lrs"]]
    assert len(la) == STEPS and np.allclose(la, lb, rtol=1e-5)

    assert (big / "selection.dp1.jsonl").is_file()  # DP rank 1 logs its own choices
    ca, cb = _chosen(big), _chosen(one)
    assert ca == cb and all(len(v) == MICRO * 2 for v in ca.values())

    from dattri_ds.store import GradientStore

    assert (big / "grad_store/shard-00001.ids").exists()  # one shard per DP rank
    assert not list((big / "grad_store").glob("shard-00002*"))  # TP rank 1 wrote nothing
    with GradientStore.open(big / "grad_store") as a, GradientStore.open(one / "grad_store") as b:
        assert len(a) == len(set(a.ids)) == len(b) == STEPS * MICRO * 2
        assert set(a.ids) == set(b.ids)
        va = a.read([a.index_of(i) for i in b.ids])
        assert rel_err(va, b.read(slice(None))) <= 1e-5

    name = "megatron_consolidated.pt"
    wa = torch.load(big / f"checkpoints/step{STEPS}" / name, weights_only=True)
    wb = torch.load(one / f"checkpoints/step{STEPS}" / name, weights_only=True)
    assert wa.keys() == wb.keys()
    errs = {k: rel_err(wa[k], wb[k]) for k in wb}
    assert max(errs.values()) <= 1e-5, errs
