"""End to end: ``launch/train.py --backend megatron`` with TP=2 on 2 CPU ranks, then offline tools.

Invariants: a TP=2 run with capture and online selection stores every trained example
exactly once (TP rank 0 writes shard 0, TP rank 1 writes nothing), a DP=2 run one shard
per replica with replicas kept identical; the TP=2 run's consolidated
checkpoint equals the live TP=2 shards (checked bitwise in the run by
``--verify-checkpoints``) and the TP=1 model rebuilt from it reproduces the live TP=2
per-example losses; offline attribution (tools collect + attribute graddot) from that
checkpoint equals graddot of per-example gradients computed by plain autograd on a TP=1
model built from the same consolidated weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from _deps import require
import torch

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}, "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}  # warnings as a user sees them
pytestmark = pytest.mark.slow
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|Torch Norm).*")
require("megatron.core", "megatron")
STEPS, MICRO, MAX_DOCS = 3, 2, 32


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind():
    """The offline tools build a TP=1 Megatron model in this process (a 1-process gloo group
    and Megatron's parallel state): tear both down so later forked multi-process tests start
    from a clean parent, as tests/dist requires."""
    yield
    import torch.distributed as dist
    try:
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One 3-step TP=2 run: capture, online selection, eval, checkpoints at steps 2 and 3."""
    tmp = tmp_path_factory.mktemp("megatron")
    cfg = json.loads((ROOT / "configs/zero1_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=1)
    cfg["scheduler"]["params"].update(warmup_num_steps=2, warmup_type="linear",
                                      warmup_min_ratio=0.5)
    cfg["dattri_ds"]["capture"]["projection"]["dim"] = 64
    (tmp / "ds.json").write_text(json.dumps(cfg))
    (tmp / "model.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}))
    return _train(tmp, tmp / "run", 2, "--save-every", "2", "--online-selection",
                  "--selection-score", "alignment", "--target-data",
                  str(ROOT / "data/tiny/target.jsonl"), "--target-max-docs", "4",
                  "--eval-every", "3", "--eval-data", str(ROOT / "data/tiny/target.jsonl"))


def _train(tmp: Path, out: Path, tp: int, *extra: str) -> Path:
    """torchrun 2 ranks of launch/train.py --backend megatron (capture, verified checkpoints)."""
    cmd = [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
           str(ROOT / "launch/train.py"), "--backend", "megatron",
           "--tensor-model-parallel-size", str(tp), "--deepspeed_config", str(tmp / "ds.json"),
           "--model-config", str(tmp / "model.json"), "--out", str(out), "--steps", str(STEPS),
           "--capture", "--verify-checkpoints", "--train-data",
           str(ROOT / "data/tiny/train.jsonl"), "--max-docs", str(MAX_DOCS), "--seq-len", "32",
           "--vocab-size", "512", "--log-every", "1", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (tmp / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    return out


def test_tp2_run_captures_each_trained_example_once(run_dir):
    """Summary, trajectory and consolidated checkpoints are written; the store holds exactly
    the examples the selector chose, once each, in shard 0 only (TP rank 1 wrote nothing)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "megatron" and summary["tensor_model_parallel_size"] == 2
    assert summary["data_parallel_size"] == 1 and summary["checkpoints"] == ["step2", "step3"]
    assert summary["captured"] and summary["selection"]["chosen"] == STEPS * MICRO
    assert np.isfinite(summary["final_loss"]) and len(summary["eval"]) == 2
    traj = json.loads((run_dir / "trajectory.json").read_text())
    assert [r["step"] for r in traj["lrs"]] == list(range(STEPS))
    # DeepSpeed's schedulers start at iteration -1 (lr 0 on the first step), as under DeepSpeed
    assert all(r["lr"] > 0 for r in traj["lrs"][1:])
    assert [c["lr"] for c in traj["checkpoints"]] == [traj["lrs"][1]["lr"], traj["lrs"][2]["lr"]]
    for tag in ("step2", "step3"):
        assert (run_dir / "checkpoints" / tag / "megatron_consolidated.pt").is_file()
    assert json.loads((run_dir / "model/config.json").read_text())["backend"] == "megatron"
    log = (run_dir.parent / "run.log").read_text()  # third-party noise only with --verbose
    assert f"step {STEPS}/{STEPS}" in log and "megatron: TP=2" in log
    for noise in ("Params for bucket", "Warning", "Apex", "[WARNING]", "Number of buckets"):
        assert noise not in log, (noise, log[-3000:])
    chosen = [json.loads(line) for line in (run_dir / "selection.jsonl").read_text().splitlines()]
    assert [c["step"] for c in chosen] == list(range(STEPS))  # logged once, by TP rank 0
    want = {f"{c.split('#')[0]}@{r['step']}#{c.split('#')[1]}" for r in chosen
            for c in r["chosen"]}
    from dattri_ds.store import GradientStore

    assert not list((run_dir / "grad_store").glob("shard-00001*"))
    with GradientStore.open(run_dir / "grad_store") as store:
        ids = list(store.ids)
        assert len(ids) == len(set(ids)) == STEPS * MICRO
        assert set(ids) == want
        assert torch.isfinite(store.read(slice(None))).all()


def test_dp2_run_writes_one_shard_per_replica(run_dir):
    """TP=1 x DP=2: each DP rank writes its own shard, every example once; the verified
    checkpoint (each rank's parameters equal rank 0's saved ones) shows that the DP gradient
    all-reduce kept the replicas identical."""
    out = _train(run_dir.parent, run_dir.parent / "dp2", 1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_parallel_size"] == 2 and summary["examples"] == STEPS * MICRO * 2
    from dattri_ds.store import GradientStore

    assert (out / "grad_store/shard-00001.ids").exists()
    with GradientStore.open(out / "grad_store") as store:
        assert len(store) == len(set(store.ids)) == STEPS * MICRO * 2


@pytest.fixture(scope="module")
def tp1_megatron():
    """Megatron groups in this process (TP=1, 1-process gloo), torn down afterwards."""
    from dattri_ds.tools.sources.megatron import megatron_single_process

    megatron_single_process()
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _reference_model(run_dir: Path, tag: str):
    """A TP=1 GPTModel from the consolidated weights, built with launch's own helpers."""
    from dattri_ds.integrations.megatron_checkpoint import load_consolidated, read_consolidated
    from dattri_ds.models.megatron_gpt import MegatronLM, build_gpt

    cfg = json.loads((run_dir / "model/config.json").read_text())
    gpt = build_gpt(cfg["transformer_config"], cfg["vocab_size"],
                    cfg["max_position_embeddings"], seed=123)
    load_consolidated(gpt, read_consolidated(run_dir / "checkpoints" / tag))
    return MegatronLM(gpt).eval()


def _autograd_grads(lm, data) -> torch.Tensor:
    """``[B, D]``: d(sum of example b's token losses)/d(all parameters), one backward each."""
    params = [p for p in lm.parameters() if p.requires_grad]
    rows = []
    for b in range(len(data)):
        batch = data.batch([b])
        lm.zero_grad(set_to_none=True)
        lm(input_ids=batch["input_ids"], labels=batch["labels"]).token_losses.sum().backward()
        rows.append(torch.cat([p.grad.flatten() for p in params]))
    lm.zero_grad(set_to_none=True)
    return torch.stack(rows)


def test_offline_attribution_from_tp2_checkpoint_equals_tp1(run_dir, tmp_path, tp1_megatron):
    """tools collect + attribute (graddot, identity projection) on 8 training docs from the
    TP=2 run's consolidated checkpoint equal autograd graddot on a TP=1 model built from the
    same weights; that model reproduces the live TP=2 losses recorded at save time."""
    from dattri_ds.tools import attribute, collect
    from dattri_ds.tools.sources import Run
    from dattri_ds.tools.texts import load_texts

    tag = "step3"
    collect.main(["--run", str(run_dir), "--data", str(ROOT / "data/tiny/train.jsonl"),
                  "--max-docs", "8", "--checkpoints", tag, "--out", str(tmp_path / "grads"),
                  "--projection-dim", str(1 << 20)])  # larger than every layer: identity
    attribute.main(["--run", str(run_dir), "--store", str(tmp_path / "grads"), "--queries",
                    str(ROOT / "data/tiny/target.jsonl"), "--query-max-docs", "2", "--method",
                    "graddot", "--truncate", "--out", str(tmp_path / "attr")])
    scores = torch.from_numpy(np.load(tmp_path / "attr/scores.npy")).double()
    train_ids = json.loads((tmp_path / "attr/train_ids.json").read_text())

    run = Run.open(run_dir)
    tok = run.tokenizer()
    lm = _reference_model(run_dir, tag)
    train = load_texts(str(ROOT / "data/tiny/train.jsonl"), tok, run.seq_len, MAX_DOCS)
    meta = json.loads((run_dir / "checkpoints" / tag / "megatron_consolidated.json").read_text())
    from dattri_ds.data import PackedDataset  # the run's own examples (its prepared windows)

    trained = PackedDataset.of_record(json.loads((run_dir / "data.json").read_text())["record"])
    check = trained.batch(meta["check"]["rows"])
    with torch.no_grad():
        out = lm(input_ids=check["input_ids"], labels=check["labels"])
    n = (check["labels"][:, 1:] != -100).sum(1)
    live = torch.tensor(meta["check"]["example_loss"])
    assert torch.allclose(out.token_losses.sum(1) / n, live, rtol=1e-5, atol=1e-6)

    train8 = train.subset(range(8))
    queries = load_texts(str(ROOT / "data/tiny/target.jsonl"), tok, run.context, 2,
                         context=run.context, truncate=True)
    ref = (_autograd_grads(lm, train8).double() @ _autograd_grads(lm, queries).double().T)
    order = [[d.id for d in train8.docs].index(i.split("#")[0]) for i in train_ids]
    ref = ref[order]
    assert scores.shape == ref.shape == (8, 2)
    err = float((scores - ref).abs().max() / ref.abs().max())
    assert err <= 1e-4, (err, scores, ref)


def test_bad_parallel_sizes_fail_at_start():
    """A TP size that does not divide the model, pipeline parallelism, sequence parallelism
    without tensor parallelism (or with a sequence length TP does not divide), and TP/SP flags
    without --backend megatron are refused before any process group exists, with the
    offending value and the fix."""
    from dattri_ds.errors import ConfigError
    from dattri_ds.launch.megatron_backend import setup_parallel, transformer_kwargs

    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by the "
                                          "tensor-parallel size 3"):
        transformer_kwargs({"model_type": "gpt2", "n_embd": 48, "n_head": 4}, 3)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 2 is not supported"):
        setup_parallel(2, 2)
    with pytest.raises(ConfigError, match="model_type='llama'"):
        transformer_kwargs({"model_type": "llama"}, 1)
    with pytest.raises(ConfigError, match="--sequence-parallel needs --tensor-model-parallel"):
        transformer_kwargs({"model_type": "gpt2", "n_embd": 32, "n_head": 4}, 1, True)
    from dattri_ds.launch.train import main

    base = ["--deepspeed_config", str(ROOT / "configs/zero1_cpu.json"), "--train-data",
            str(ROOT / "data/tiny/train.jsonl")]
    with pytest.raises(ConfigError, match="--seq-len 33 must be divisible by 2"):
        main([*base, "--backend", "megatron", "--tensor-model-parallel-size", "2",
              "--sequence-parallel", "--seq-len", "33"])
    with pytest.raises(ConfigError, match="need --backend megatron"):
        main([*base, "--sequence-parallel"])
