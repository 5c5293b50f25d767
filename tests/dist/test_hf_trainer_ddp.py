"""HF Trainer under DDP (2 gloo processes): captured rows still equal per-example autograd.

Invariant: with ``average_tokens_across_devices`` Trainer counts ``num_items_in_batch``
over both ranks and multiplies each rank's loss by the world size; TrainerCapture undoes
both, so every rank's rows equal the single-example reference, for accumulation 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from _dist import run  # noqa: E402
from _deps import require

pytestmark = pytest.mark.dist


def _train(rank, world, out):
    import torch

    from dattri_ds import CaptureConfig
    from dattri_ds.integrations.hf import TrainerCapture
    from test_hf_trainer import Recorder, _args, _assert_rows_match, _examples, _reference
    from reference import tiny_gpt2
    from transformers import Trainer

    torch.manual_seed(0)
    model = tiny_gpt2()
    rows = _examples(8)
    ref = _reference(model, rows)
    trainer = Trainer(model=model, args=_args(Path(out), gradient_accumulation_steps=2,
                                              max_steps=1), train_dataset=rows)
    assert trainer.accelerator.num_processes == world
    rec = Recorder()
    TrainerCapture(trainer, CaptureConfig(), callbacks=[rec])
    trainer.train()
    return {"rows": _assert_rows_match(rec.batches, ref),
            "ids": [i for b in rec.batches for i in b.sample_ids]}


def test_trainer_ddp_capture_matches_reference(tmp_path):
    """Each rank captures its own 4 examples exactly; the ranks' examples are disjoint."""
    require("transformers", "hf")
    got = run(_train, world_size=2, out=str(tmp_path))
    assert [g["rows"] for g in got] == [4, 4]
    assert not set(got[0]["ids"]) & set(got[1]["ids"])
