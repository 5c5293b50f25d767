"""launch/train.py trains Hugging Face architectures beyond GPT-2 and Llama, as users run it.

Invariants: a tiny Qwen2 (tied head, q/k/v biases) under DeepSpeed ZeRO-3 and ZeRO-1 and a tiny
OLMo-2 (q/k RMSNorms) under ZeRO-2, ZeRO-0 and ``--backend torch`` train a few steps with
``--capture`` to a finite loss and a gradient store holding every example; a Qwen2
``save_pretrained`` folder trains through ``--model-path``; a model capture cannot read
(Mamba) is refused at start in one line naming its model type. Breaks if launch goes back to
a fixed list of architectures.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _deps import require

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
pytestmark = pytest.mark.slow
SMALL = ["--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "16", "--seq-len",
         "32", "--vocab-size", "512", "--steps", "2", "--capture-projection-dim", "64"]


def _launch(tmp: Path, name: str, stage: int, *extra: str) -> subprocess.CompletedProcess:
    cfg = json.loads((ROOT / f"configs/zero{stage}_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    (tmp / f"ds_{name}.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, str(ROOT / "launch/train.py"), "--deepspeed_config",
           str(tmp / f"ds_{name}.json"), "--out", str(tmp / name), *SMALL, *extra]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def _check_run(out: Path, proc: subprocess.CompletedProcess, model_type: str) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and math.isfinite(summary["final_loss"]), summary
    assert summary["capture_dropped_examples"] == 0
    info = json.loads(next(out.glob("**/info.json")).read_text())
    assert info, "empty store info"
    saved = json.loads((out / "model/config.json").read_text())
    assert saved["model_type"] == model_type


@pytest.mark.parametrize("arch,stage,backend", [("qwen2", 3, "deepspeed"),
                                                ("olmo2", 2, "deepspeed"),
                                                ("qwen2", 1, "deepspeed"),
                                                ("olmo2", 0, "deepspeed"),
                                                ("olmo2", 0, "torch")])
def test_tiny_architecture_trains_with_capture(tmp_path, arch, stage, backend):
    """Two steps with --capture: finite loss, a store, the model type saved."""
    require("deepspeed", "deepspeed")
    name = f"{arch}_{backend}{stage}"
    proc = _launch(tmp_path, name, stage, "--backend", backend, "--capture",
                   "--model-config", str(ROOT / f"configs/model_{arch}_tiny.json"))
    _check_run(tmp_path / name, proc, arch)


def test_model_path_folder_and_refusal(tmp_path):
    """A Qwen2 save_pretrained folder with its tokenizer trains through --model-path (and
    tokenizes with that tokenizer); a Mamba config with --capture stops at start naming
    'mamba' and the unsupported modules."""
    require("deepspeed", "deepspeed")
    from _corpora import hf_folder

    from dattri_ds.models.causal_lm import build_model

    model = build_model(ROOT / "configs/model_qwen2_tiny.json", vocab_size=512, seed=0)
    model.save_pretrained(tmp_path / "qwen2")
    texts = [json.loads(line)["text"] for line in
             (ROOT / "data/tiny/train.jsonl").read_text(encoding="utf-8").splitlines()[:200]]
    hf_folder(tmp_path / "qwen2", texts, vocab_size=300)  # the model's own tokenizer
    proc = _launch(tmp_path, "path", 0, "--backend", "torch", "--capture",
                   "--model-path", str(tmp_path / "qwen2"))
    _check_run(tmp_path / "path", proc, "qwen2")
    (tmp_path / "mamba.json").write_text(json.dumps(
        {"model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 1, "state_size": 4,
         "intermediate_size": 32}))
    proc = _launch(tmp_path, "mamba", 0, "--backend", "torch", "--capture",
                   "--model-config", str(tmp_path / "mamba.json"))
    assert proc.returncode != 0
    assert "model_type 'mamba' has trainable layers capture does not support" in proc.stderr
    assert "Traceback" not in proc.stderr
