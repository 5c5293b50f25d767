"""End-to-end runs of launch/train.py as users run it (subprocesses; the slowest tests).

Invariants: the real ``deepspeed`` launcher trains 2 CPU ranks under ZeRO-3 and writes
reloadable checkpoints; a capturing run killed with SIGKILL and restarted ends with exactly
the store of an uninterrupted run (no example lost, none duplicated).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _deps import require
import torch

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
pytestmark = pytest.mark.slow


def _config(tmp: Path, stage: int, **block) -> Path:
    cfg = json.loads((ROOT / f"configs/zero{stage}_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["gradient_accumulation_steps"] = 1
    cfg["dattri_ds"].update(block)
    path = tmp / f"zero{stage}.json"
    path.write_text(json.dumps(cfg))
    return path


SMALL = ["--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "64", "--seq-len",
         "32", "--vocab-size", "512", "--log-every", "1"]


def test_deepspeed_launcher_zero3_two_ranks(tmp_path):
    """`deepspeed --num_gpus 2 launch/train.py` trains, captures, and its ZeRO-3 checkpoint
    consolidates into full weights that load into the saved model config."""
    require("deepspeed", "deepspeed")
    out = tmp_path / "run"
    from dist._dist import free_port  # not DeepSpeed's fixed 29500: other runs may hold it

    cmd = [str(Path(PY).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
           str(free_port()), str(ROOT / "launch/train.py"),
           "--deepspeed_config", str(_config(tmp_path, 3)), "--out", str(out), "--steps", "3",
           "--capture", *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world"] == 2 and summary["checkpoints"] == ["step3"]
    assert summary["status"] == "ok" and summary["capture_dropped_examples"] == 0
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step3")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out / "model"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("attn.bias" in m or "masked_bias" in m for m in missing)
    ids = torch.randint(0, 512, (2, 16))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    from dattri_ds.store import GradientStore
    with GradientStore.open(out / "grad_store") as store:
        assert len(store) == 3 * 2 * 2  # steps x ranks x micro-batch
        assert all("@" in i for i in store.ids)


def _run_train(out: Path, cfg: Path) -> subprocess.Popen:
    cmd = [PY, str(ROOT / "launch/train.py"), "--deepspeed_config", str(cfg), "--out", str(out),
           "--steps", "8", "--capture", *SMALL]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _committed_rows(out: Path) -> int:
    idx = out / "grad_store" / "shard-00000.index.json"
    try:
        return int(json.loads(idx.read_text())["rows"])
    except (OSError, ValueError, KeyError):
        return 0


def test_killed_capture_run_resumes_to_identical_store(tmp_path):
    """SIGKILL a capturing training run midway, rerun it: the store equals an uninterrupted
    run's (same ids, same vectors, each id once)."""
    require("deepspeed", "deepspeed")
    cfg = _config(tmp_path, 2, store={"flush_every": 2})
    full = tmp_path / "full"
    p = _run_train(full, cfg)
    assert p.wait(timeout=600) == 0, p.stderr.read()[-3000:]
    killed = tmp_path / "killed"
    p = _run_train(killed, cfg)
    deadline = time.time() + 600
    while _committed_rows(killed) < 4 and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    rows_at_kill = _committed_rows(killed)
    assert 0 < rows_at_kill < 16, rows_at_kill
    p = _run_train(killed, cfg)
    assert p.wait(timeout=600) == 0, p.stderr.read()[-3000:]
    from dattri_ds.store import GradientStore
    with GradientStore.open(full / "grad_store") as a, \
            GradientStore.open(killed / "grad_store") as b:
        assert len(a) == len(b) == 16 and set(a.ids) == set(b.ids)
        va = a.read(slice(None))
        vb = b.read([b.index_of(i) for i in a.ids])
        assert torch.allclose(va, vb, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("limit", [3, 0])
def test_diverging_run_fails_after_nonfinite_steps(tmp_path, limit):
    """A run whose loss turns NaN/inf (learning rate 1e30) exits non-zero after
    train.max_nonfinite_steps consecutive non-finite steps, and summary.json says why;
    with 0 it runs to the end and counts them. Breaks if divergence exits 0 unnoticed."""
    require("deepspeed", "deepspeed")
    cfg = json.loads(_config(tmp_path, 2, train={"max_nonfinite_steps": limit}).read_text())
    cfg["optimizer"]["params"]["lr"] = 1e30
    cfg.pop("scheduler", None)
    path = tmp_path / "diverge.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "run"
    cmd = [PY, str(ROOT / "launch/train.py"), "--deepspeed_config", str(path), "--out", str(out),
           "--steps", "8", *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    if limit:
        assert proc.returncode == 1, proc.stderr[-2000:]  # a runtime error (dattri_ds/cli.py)
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("dattri-ds: error: ")]
        assert len(errors) == 1 and f"{limit} consecutive optimizer steps" in errors[0], errors
        assert "Traceback" not in proc.stderr and summary["status"] == "failed"
        assert f"{limit} consecutive optimizer steps" in summary["error"]
        assert summary["nonfinite_steps"] == limit
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert summary["status"] == "ok" and summary["nonfinite_steps"] >= 3
