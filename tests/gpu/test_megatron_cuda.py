"""CUDA only (skipped without a GPU): ``--backend megatron`` on one GPU uses NCCL, Megatron's
DistributedDataParallel and Megatron's own optimizer (``get_megatron_optimizer``).

Invariant: 3 SGD steps with capture and online selection on CUDA end at the same weights
as the same run on CPU (torch SGD on the same synchronized ``main_grad``), within fp32
GPU/CPU rounding (rel. err <= 1e-4), and store the same examples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _deps import require
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")]
require("megatron.core", "megatron")
ROOT = Path(__file__).resolve().parents[2]


def _run(tmp: Path, name: str, env_extra: dict) -> Path:
    cfg = json.loads((ROOT / "configs/zero1_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
               gradient_clipping=0.0, optimizer={"type": "SGD", "params": {"lr": 0.5}})
    cfg.pop("scheduler")
    cfg["dattri_ds"]["capture"]["projection"]["dim"] = 64
    (tmp / "ds.json").write_text(json.dumps(cfg))
    (tmp / "model.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}))
    out = tmp / name
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node",
           "1", str(ROOT / "launch/train.py"), "--backend", "megatron",
           "--deepspeed_config", str(tmp / "ds.json"), "--model-config", str(tmp / "model.json"),
           "--out", str(out), "--steps", "3", "--capture", "--online-selection",
           "--selection-score", "alignment",
           "--target-data", str(ROOT / "data/tiny/target.jsonl"), "--target-max-docs", "4",
           "--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "32",
           "--seq-len", "32", "--vocab-size", "512", "--save-every", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_megatron_optimizer_on_cuda_matches_cpu(tmp_path):
    gpu = _run(tmp_path, "gpu", {})
    cpu = _run(tmp_path, "cpu", {"CUDA_VISIBLE_DEVICES": ""})
    name = "checkpoints/step3/megatron_consolidated.pt"
    a = torch.load(gpu / name, weights_only=True)
    b = torch.load(cpu / name, weights_only=True)
    errs = {k: float((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12))
            for k in b}
    assert max(errs.values()) <= 1e-4, errs
    from dattri_ds.selection import read_selection_log

    chosen = [sorted(r["chosen"]) for r in read_selection_log(gpu / "selection.jsonl")]
    assert chosen == [sorted(r["chosen"]) for r in read_selection_log(cpu / "selection.jsonl")]


def _train(tmp: Path, out: Path, steps: int, *extra: str) -> list[float]:
    """One-GPU ``--backend megatron`` run with AdamW and a warmup schedule (Megatron's own
    optimizer on CUDA); its per-step losses."""
    cfg = json.loads((ROOT / "configs/zero1_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    cfg["optimizer"]["params"]["lr"] = 0.01
    cfg["scheduler"]["params"].update(warmup_num_steps=2, total_num_steps=8)
    (tmp / "resume.json").write_text(json.dumps(cfg))
    (tmp / "model.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}))
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node",
           "1", str(ROOT / "launch/train.py"), "--backend", "megatron",
           "--deepspeed_config", str(tmp / "resume.json"), "--model-config",
           str(tmp / "model.json"), "--out", str(out), "--steps", str(steps),
           "--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "32",
           "--seq-len", "32", "--vocab-size", "512", "--save-every", "2", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r["loss"] for r in json.loads((out / "trajectory.json").read_text())["lrs"]]


def test_megatron_optimizer_resume_on_cuda(tmp_path):
    """Megatron's own optimizer state round-trips through a checkpoint: 2 steps then
    ``--resume step2`` to 4 equals 4 steps in one go (losses and weights, rel. err <= 1e-5:
    CUDA's atomic adds, e.g. in the embedding backward, are not bitwise reproducible; on CPU,
    tests/dist/test_resume.py holds 1e-6). Breaks if the Megatron optimizer's state or the
    lr schedule is not restored (about 1e-3 on CPU)."""
    full = _train(tmp_path, tmp_path / "full", 4)
    _train(tmp_path, tmp_path / "part", 2)
    part = _train(tmp_path, tmp_path / "part", 4, "--resume", "step2")
    assert len(full) == len(part) == 4
    err = float((torch.tensor(part) - torch.tensor(full)).norm() / torch.tensor(full).norm())
    assert err <= 1e-5, (full, part)
    name = "checkpoints/step4/megatron_consolidated.pt"
    a = torch.load(tmp_path / "full" / name, weights_only=True)
    b = torch.load(tmp_path / "part" / name, weights_only=True)
    errs = {k: float((b[k].double() - a[k].double()).norm()
                     / a[k].double().norm().clamp_min(1e-30)) for k in a}
    assert max(errs.values()) <= 1e-5, errs
