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


def _train_cmd(out: Path, cfg: Path, steps: int, *extra: str) -> list[str]:
    return [PY, str(ROOT / "launch/train.py"), "--deepspeed_config", str(cfg), "--out",
            str(out), "--steps", str(steps), *SMALL, *extra]


def _ok(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_torch_backend_trains_what_deepspeed_trains(tmp_path):
    """`--backend torch` (one process, no DeepSpeed engine) trains the same steps as a
    one-process DeepSpeed ZeRO-0 run of the same JSON: equal losses and lrs per step, equal
    captured gradients, equal final weights; the resolved config records the backend.
    Breaks if the plain backend's optimizer, schedule, clipping, accumulation or capture
    scale drifts from the DeepSpeed engine's."""
    require("deepspeed", "deepspeed")
    cfg = _config(tmp_path, 0)
    raw = json.loads(cfg.read_text())
    raw["gradient_accumulation_steps"] = 2
    cfg.write_text(json.dumps(raw))
    ds, pt = tmp_path / "ds", tmp_path / "pt"
    _ok(_train_cmd(ds, cfg, 5, "--capture"))
    _ok(_train_cmd(pt, cfg, 5, "--capture", "--backend", "torch"))
    a, b = (json.loads((d / "trajectory.json").read_text())["lrs"] for d in (ds, pt))
    assert [x["lr"] for x in a] == pytest.approx([x["lr"] for x in b], rel=1e-12)
    assert [x["loss"] for x in a] == pytest.approx([x["loss"] for x in b], rel=1e-5)
    resolved = json.loads((pt / "resolved_dattri_ds_config.json").read_text())
    assert resolved["engine"]["backend"] == "torch"
    assert json.loads((ds / "resolved_dattri_ds_config.json").read_text())["engine"] == {
        "backend": "deepspeed", "tensor_model_parallel_size": 1, "sequence_parallel": False,
        "pipeline_model_parallel_size": 1, "verify_checkpoints": False}
    from dattri_ds.store import GradientStore
    with GradientStore.open(ds / "grad_store") as sa, GradientStore.open(pt / "grad_store") as sb:
        assert list(sa.ids) == list(sb.ids) and len(sa) == 5 * 2 * 2
        va, vb = sa.read(slice(None)), sb.read(slice(None))
        assert float(((va - vb).norm(dim=1) / va.norm(dim=1)).max()) < 1e-4
    from dattri_ds.tools.common import Run
    wa = Run.open(ds).model("step5").state_dict()
    wb = Run.open(pt).model("step5").state_dict()
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6) for k in wa)


def test_torch_backend_resume_equals_uninterrupted(tmp_path):
    """A `--backend torch` run stopped at step 2 and resumed (`--resume latest`) to step 4
    ends with the weights and losses of an uninterrupted 4-step run (optimizer, schedule,
    RNG and data position restored from its save_pretrained checkpoint)."""
    require("deepspeed", "deepspeed")  # the JSON's lr schedule is DeepSpeed's class
    cfg = _config(tmp_path, 0)
    full, part = tmp_path / "full", tmp_path / "part"
    _ok(_train_cmd(full, cfg, 4, "--backend", "torch"))
    _ok(_train_cmd(part, cfg, 2, "--backend", "torch"))
    _ok(_train_cmd(part, cfg, 4, "--backend", "torch", "--resume", "latest"))
    a, b = (json.loads((d / "trajectory.json").read_text())["lrs"] for d in (full, part))
    assert [x["loss"] for x in a] == [x["loss"] for x in b]
    from dattri_ds.tools.common import Run
    wa, wb = Run.open(full).model("step4").state_dict(), Run.open(part).model("step4").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_engine_flags_are_config_fields(tmp_path):
    """--backend and the tensor-parallel flags are fields of RunConfig.engine (parsed from
    the flags and the JSON's "engine" block alike), and parallel sizes without --backend
    megatron are refused naming the flags and the fix."""
    from dattri_ds.errors import ConfigError
    from dattri_ds.launch.args import parse_args
    from dattri_ds.launch.config import load_run_config

    cfg = _config(tmp_path, 2, engine={"backend": "megatron"})
    args = parse_args(["--deepspeed_config", str(cfg), "--tensor-model-parallel-size", "2",
                       "--sequence-parallel"])
    _, run = load_run_config(cfg, args.overrides)
    assert (run.engine.backend, run.engine.tensor_model_parallel_size,
            run.engine.sequence_parallel) == ("megatron", 2, True)
    args = parse_args(["--deepspeed_config", str(cfg), "--backend", "deepspeed",
                       "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="need --backend megatron"):
        load_run_config(cfg, args.overrides)
    args = parse_args(["--deepspeed_config", str(cfg), "--backend", "nope"])
    with pytest.raises(ConfigError, match="'nope' is not known"):
        load_run_config(cfg, args.overrides)
