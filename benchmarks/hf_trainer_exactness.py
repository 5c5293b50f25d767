"""Captured vs. exact per-example squared norms inside an HF Trainer: naive attach vs TrainerCapture.

    python benchmarks/hf_trainer_exactness.py

A tiny GPT-2 (default loss, labels = inputs with padding and masked prompts) is trained
for 2 steps at learning rate 0 (so every micro-batch sees the initial weights) with
gradient accumulation 1 and 2. "naive" attaches a plain ``GradientCapture`` to the model
(what users did before ``integrations/hf.py``); "TrainerCapture" uses the callback. The
ratio mean(captured ||g_b||^2 / exact ||g_b||^2) over all captured rows is printed per
setting, with its spread (min..max); exact = one backward per example. Run it with an
older checkout first on ``PYTHONPATH`` to see the "before" numbers (naive only).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests/unit"))


def ratios(accumulation: int, mode: str) -> list[float]:
    from transformers import Trainer

    from dattri_ds import CaptureConfig, GradientCapture, materialize
    from reference import tiny_gpt2
    from test_hf_trainer import Recorder, _args, _examples, _reference

    model = tiny_gpt2()
    rows = _examples()
    ref = _reference(model, rows)
    args = _args(Path(tempfile.mkdtemp()), gradient_accumulation_steps=accumulation)
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    rec = Recorder()
    if mode == "naive":
        cap = GradientCapture(model, CaptureConfig(), callbacks=[rec]).attach()
        trainer.train()
        getattr(cap, "close", cap.detach)()  # older versions: detach closed callbacks
    else:
        from dattri_ds.integrations.hf import TrainerCapture

        TrainerCapture(trainer, CaptureConfig(), callbacks=[rec])
        trainer.train()
    out = []
    for b in rec.batches:
        for i, sid in enumerate(b.sample_ids):
            got = sum(float(materialize(lg.index(torch.tensor([i])))[0].square().sum())
                      for lg in b.layers.values())
            want = sum(float(v.square().sum()) for v in ref[sid].values())
            out.append(got / want)
    return out


def main() -> None:
    torch.manual_seed(0)
    print("| accumulation | capture | mean ratio | min | max |")
    print("|---:|---|---:|---:|---:|")
    try:
        import dattri_ds.integrations.hf  # noqa: F401
        modes = ("naive", "TrainerCapture")
    except ImportError:  # an older dattri_ds (before the integration): naive only
        modes = ("naive",)
    for acc in (1, 2):
        for mode in modes:
            r = ratios(acc, mode)
            print(f"| {acc} | {mode} | {sum(r) / len(r):.4f} | {min(r):.4f} | {max(r):.4f} |")


if __name__ == "__main__":
    main()
