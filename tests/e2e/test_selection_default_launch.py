"""launch/train.py --online-selection as users run it: the default score and the probe flag.

Invariants: ``--online-selection --target-data`` alone ranks by the content score (no
target gradient is ever computed) and records ``"score": "content"`` in
``resolved_dattri_ds_config.json`` and the summary; ``--selection-score alignment`` runs the
gradient probe (the target gradient is refreshed) and records ``"alignment"``. Breaks if the
default goes back to the gradient probe or the flag stops selecting it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _deps import require

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
pytestmark = pytest.mark.slow


def _run(tmp: Path, name: str, *extra: str) -> Path:
    cfg = json.loads((ROOT / "configs/zero0_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    (tmp / "ds.json").write_text(json.dumps(cfg))
    out = tmp / name
    cmd = [sys.executable, str(ROOT / "launch/train.py"), "--backend", "torch",
           "--deepspeed_config", str(tmp / "ds.json"), "--out", str(out), "--steps", "2",
           "--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "32",
           "--seq-len", "32", "--vocab-size", "512", "--online-selection", "--target-data",
           str(ROOT / "data/tiny/target.jsonl"), "--target-max-docs", "4", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_default_is_content_and_the_flag_selects_the_probe(tmp_path):
    """Two 2-step runs on --backend torch: the default (content, no target refresh) and
    --selection-score alignment (probe, target refreshed at step 0)."""
    require("deepspeed", "deepspeed")  # the JSON's lr schedule is DeepSpeed's class
    for name, extra, score, refreshes in (("content", (), "content", 0),
                                          ("alignment", ("--selection-score", "alignment"),
                                           "alignment", 1)):
        out = _run(tmp_path, name, *extra)
        resolved = json.loads((out / "resolved_dattri_ds_config.json").read_text())
        summary = json.loads((out / "summary.json").read_text())["selection"]
        assert resolved["selection"]["score"] == score, name
        assert summary["score"] == score and summary["target_refreshes"] == refreshes, summary
