"""End-to-end runs of launch/train.py as users run it (subprocesses; the slowest tests).

Invariants: the real ``deepspeed`` launcher trains 2 CPU ranks under ZeRO-3 and writes
reloadable checkpoints; a capturing run killed with SIGKILL and restarted ends with exactly
the store of an uninterrupted run (no example lost, none duplicated), also when it was
killed while writing its final checkpoint (``--resume latest`` skips the half-written one);
the offline curation recipe trains its subset model with the warm-up run's tokenizer
(``--init-from``); ranks of one launch print a shared error once.
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
        assert proc.returncode == 1, proc.stderr[-2000:]  # a runtime error (dattri_ds/cli/exits.py)
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
    from dattri_ds.tools.sources import Run
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
    from dattri_ds.tools.sources import Run
    wa, wb = Run.open(full).model("step4").state_dict(), Run.open(part).model("step4").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_engine_flags_are_config_fields(tmp_path, monkeypatch):
    """--backend and the tensor-parallel flags are fields of RunConfig.engine (parsed from
    the flags and the JSON's "engine" block alike), and parallel sizes without --backend
    megatron are refused naming the flags and the fix."""
    from dattri_ds.errors import ConfigError
    from dattri_ds.launch.args import load_run_config, parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")  # TP 2 is parsed in a launch of 2 processes

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


def _tool(script: str, *argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([PY, str(ROOT / script), *argv], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("dattri-ds: error: ")]


def test_curation_recipe_trains_the_subset_with_the_warmup_tokenizer(tmp_path):
    """The LESS recipe of the README end to end: warm up, collect the pool, select 25%, train
    on the subset with ``--init-from`` the warm-up run: the subset model reads text with the
    warm-up's tokenizer (same bytes, vocabulary and fingerprint in its model config), not a
    tokenizer fitted to the selected texts. ``--init-checkpoint latest`` starts from the
    warm-up's weights (lr 0: the trained weights equal them bitwise); a model config that
    differs is refused naming the key. Breaks if launch trains its own tokenizer again."""
    cfg = _config(tmp_path, 0)
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join((ROOT / "data/tiny/train.jsonl").read_text().splitlines(True)[:64]))
    warm, sub = tmp_path / "warm", tmp_path / "subset"
    base = ["--backend", "torch", "--deepspeed_config", str(cfg), "--seq-len", "32",
            "--log-every", "1"]
    _tool("launch/train.py", *base, "--train-data", str(pool), "--vocab-size", "512",
          "--steps", "3", "--out", str(warm))
    _tool("tools/collect.py", "--run-dir", str(warm), "--data", str(pool), "--checkpoints",
          "last", "--projection", "sparse", "--projection-dim", "32", "--out", str(warm / "grads"))
    _tool("tools/curate.py", "--run-dir", str(warm), "--store", str(warm / "grads"), "--target",
          str(ROOT / "data/tiny/target.jsonl"), "--fraction", "0.25", "--with-text", "--out",
          str(warm / "subset"))
    subset = warm / "subset" / "subset.jsonl"
    assert len(subset.read_text().splitlines()) == 16
    _tool("launch/train.py", *base, "--train-data", str(subset), "--steps", "2", "--out",
          str(sub), "--init-from", str(warm))
    assert (sub / "tokenizer.model").read_bytes() == (warm / "tokenizer.model").read_bytes()
    a, b = (json.loads((d / "model/config.json").read_text()) for d in (warm, sub))
    assert a["vocab_size"] == b["vocab_size"] == 512
    assert a["tokenizer_fingerprint"] == b["tokenizer_fingerprint"]

    frozen = json.loads(cfg.read_text())
    frozen["optimizer"] = {"type": "SGD", "params": {"lr": 0.0}}
    frozen.pop("scheduler", None)
    (tmp_path / "lr0.json").write_text(json.dumps(frozen))
    base[base.index(str(cfg))] = str(tmp_path / "lr0.json")
    _tool("launch/train.py", *base, "--train-data", str(subset), "--steps", "1", "--out",
          str(tmp_path / "warm_start"), "--init-from", str(warm), "--init-checkpoint", "latest")
    from dattri_ds.tools.sources import Run
    wa = Run.open(warm).model("step3").state_dict()
    wb = Run.open(tmp_path / "warm_start").model("step1").state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32,
                                 "n_positions": 64}))
    proc = subprocess.run([PY, str(ROOT / "launch/train.py"), *base, "--train-data", str(subset),
                           "--out", str(tmp_path / "bad"), "--init-from", str(warm),
                           "--init-checkpoint", "step3", "--model-config", str(other)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and len(_errors(proc)) == 1, proc.stderr[-2000:]
    assert "n_embd=128 there, 32 here" in _errors(proc)[0]


#: launch/train.py whose torch backend is SIGKILLed while saving checkpoint $KILL_AT (its
#: temporary folder, launch/save.py): the weights are written, the training state is not
#: (the 0.02-0.05 s window of a real save).
_KILLED_IN_SAVE = """
import os, runpy, signal, sys
from dattri_ds.launch.torch_backend import TorchBackend
save = TorchBackend.save
def dying_save(self, ckpt_dir, tag, meta, data):
    if tag == os.environ["KILL_AT"]:
        self.model.save_pretrained(str(ckpt_dir / tag))
        os.kill(os.getpid(), signal.SIGKILL)
    save(self, ckpt_dir, tag, meta, data)
TorchBackend.save = dying_save
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("save_every", [2, 0])
def test_killed_during_final_checkpoint_resumes_with_resume_latest(tmp_path, save_every):
    """`launch/train.py --capture` killed while writing its final checkpoint (step4, into
    `checkpoints/step4.tmp`): no `step4` exists; the same command is refused with a
    suggestion (`--resume latest`) that works: it skips the half-written folder with a
    warning and resumes from step2 (with --save-every 2) or, when no checkpoint was
    completed, starts again at step 0; the run then ends with the losses and the gradient
    store of an uninterrupted run, the temporary folder removed. Breaks if a half-written
    checkpoint is taken for complete, or if the suggested command fails."""
    cfg = _config(tmp_path, 0, store={"flush_every": 2})
    cmd = [str(ROOT / "launch/train.py"), "--backend", "torch", "--deepspeed_config", str(cfg),
           "--steps", "4", "--save-every", str(save_every), "--capture", *SMALL]
    full, part = tmp_path / "full", tmp_path / "part"
    _tool(*cmd[:1], *cmd[1:], "--out", str(full))
    killed = subprocess.run([PY, "-c", _KILLED_IN_SAVE, *cmd, "--out", str(part)], cwd=ROOT,
                            env={**ENV, "KILL_AT": "step4.tmp"}, capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (part / "checkpoints" / "step4.tmp").is_dir()
    assert not (part / "checkpoints" / "step4").exists()
    assert not (part / "checkpoints" / "step4.tmp" / "training_state.pt").exists()
    again = subprocess.run([PY, *cmd, "--out", str(part)], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and len(_errors(again)) == 1, again.stderr[-2000:]
    assert "pass --resume latest to continue it" in _errors(again)[0]
    resumed = _tool(*cmd, "--out", str(part), "--resume", "latest")
    assert "skipping step4.tmp" in resumed.stderr
    assert ("resuming from step2" if save_every else "starts again at step 0") in resumed.stderr
    assert not (part / "checkpoints" / "step4.tmp").exists()  # removed by the next save
    a, b = (json.loads((d / "trajectory.json").read_text()) for d in (full, part))
    assert [r["loss"] for r in a["lrs"]] == [r["loss"] for r in b["lrs"]]
    assert a["checkpoints"] == b["checkpoints"]
    from dattri_ds.store import GradientStore
    with GradientStore.open(full / "grad_store") as sa, \
            GradientStore.open(part / "grad_store") as sb:
        assert len(sa) == len(sb) == 4 * 2 and set(sa.ids) == set(sb.ids)
        assert torch.allclose(sa.read(slice(None)), sb.read([sb.index_of(i) for i in sa.ids]),
                              rtol=1e-5, atol=1e-7)


def test_ranks_failing_alike_print_the_error_once(tmp_path):
    """Two torchrun ranks refusing the same input (a whitespace-only --target-data) print
    one `dattri-ds: error:` line between them, not one per rank."""
    require("deepspeed", "deepspeed")
    from dist._dist import free_port

    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"id": "a", "source": "s", "title": "t", "text": " \n "}) + "\n")
    cmd = [str(Path(PY).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "launch/train.py"), "--deepspeed_config",
           str(_config(tmp_path, 2)), "--out", str(tmp_path / "run"), "--online-selection",
           "--target-data", str(blank), *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    errors = _errors(proc)
    assert len(errors) == 1 and "--target-data" in errors[0], proc.stderr[-3000:]
