"""A long Megatron run with --capture keeps no captured batch waiting (the README's example).

``launch/train.py --backend megatron --tensor-model-parallel-size 2 --capture
--online-selection --target-data ...`` on 2 forked gloo ranks (TP=2), with
``capture.max_pending`` lowered to 4 and 10 steps, so each rank captures more than twice as
many micro-batches as the threshold. TP rank 1 captures (its projections all-reduce over TP)
but writes no store shard: TP rank 0 stores the same rows.

Invariants, on both ranks: every captured batch is consumed as it is built (the capture's
queue of batches waiting for ``pop()`` stays empty, so memory does not grow with the run), no
``captured batches are waiting`` warning is emitted, and the store holds every trained
example once. Breaks if a rank without a store shard queues its batches (the README's
example logged 336 such warnings, the queue climbing to 400 batches).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from _deps import require

require("megatron.core", "megatron")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|Torch Norm).*")
import megatron.core  # noqa: E402,F401  (imported once in the parent, before forking)

from _dist import run  # noqa: E402

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
STEPS, MICRO, MAX_PENDING = 10, 2, 4
WAITING = "captured batches are waiting"


def _train(rank, world, argv):
    """Train, recording the capture's queue length after every delivered batch and every
    warning (the warning filter reset: each one is kept)."""
    from dattri_ds.capture.hooks import GradientCapture
    from dattri_ds.launch.train import main

    seen = {"delivered": 0, "peak": 0}
    deliver = GradientCapture._deliver

    def counted(self, batch):
        deliver(self, batch)
        seen["delivered"] += 1
        seen["peak"] = max(seen["peak"], len(self._pending))

    GradientCapture._deliver = counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = main(argv)
    return {**seen, "summary": summary, "warnings": [str(w.message) for w in caught]}


def test_tp2_capture_keeps_no_batch_waiting(tmp_path):
    cfg = json.loads((ROOT / "configs/zero1_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=1)
    cfg["dattri_ds"]["capture"]["projection"]["dim"] = 32
    cfg["dattri_ds"]["capture"]["max_pending"] = MAX_PENDING
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    (tmp_path / "model.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 32}))
    out = tmp_path / "run"
    argv = ["--backend", "megatron", "--tensor-model-parallel-size", "2", "--deepspeed_config",
            str(tmp_path / "ds.json"), "--model-config", str(tmp_path / "model.json"),
            "--out", str(out), "--steps", str(STEPS), "--capture", "--online-selection",
            "--target-data", str(ROOT / "data/target/hamlet.jsonl"), "--target-max-docs", "4",
            "--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "32",
            "--seq-len", "16", "--vocab-size", "256", "--log-every", "5"]
    results = run(_train, 2, timeout=600, argv=argv)
    for rank, r in enumerate(results):
        assert r["delivered"] >= STEPS > 2 * MAX_PENDING, (rank, r["delivered"])
        assert r["peak"] == 0, (rank, r["peak"])
        assert not [w for w in r["warnings"] if WAITING in w], (rank, r["warnings"][:3])
    assert results[0]["summary"]["captured"]

    from dattri_ds.store import GradientStore

    with GradientStore.open(out / "grad_store") as store:
        assert len(store) == len(set(store.ids)) == STEPS * MICRO
