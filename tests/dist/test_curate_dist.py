"""Offline curation over 2 gloo ranks selects what 1 rank selects.

Invariant: each rank scores its contiguous slice of the pool store's rows (gradient
cosines, content prior with pool-wide n-gram counts all-reduced, MinHash signatures) and
the per-row columns are all-gathered, so the scores, the subset and the written files are
those of one process, on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _dist import run  # noqa: E402

pytestmark = pytest.mark.dist


def _select(rank, world, store, pool_file, q_rows, tc, out, method):
    import torch.distributed as dist

    from dattri_ds.selection.curate import CurateConfig, Pool, curate
    from dattri_ds.selection.curate.pool import JsonlTexts
    from dattri_ds.store import GradientStore
    from test_curate import tokenize

    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    s = GradientStore.open(store, require_complete=True)
    pool = Pool.build(s.ids, s.token_counts, JsonlTexts.open([pool_file], s.ids, tokenize))
    cfg = CurateConfig(method=method, fraction=0.25, block_rows=3, max_per_cluster=1,
                       max_source_share=0.5)
    r = curate(cfg, {"step1": s}, pool, targets={"step1": q_rows}, weights={"step1": 1e-3},
               target_counts=tc, out=out, rank=rank, world=world)
    s.close()
    return {"scores": r.scores, "chosen": r.chosen}


@pytest.mark.parametrize("method", ["combined", "trajectory"])
def test_two_ranks_equal_one_rank(tmp_path, method):
    """Scores and subset of 2 ranks equal 1 rank's on both ranks; rank 0 writes the same
    subset.jsonl."""
    import json

    import test_curate as tc
    from dattri_ds.selection.curate.pool import ngram_counts
    from dattri_ds.selection.curate.targets import target_rows
    from dattri_ds.store import GradientStore

    model = tc.tiny_gpt2()
    docs = tc._docs(23)  # odd: the ranks' slices differ in size
    pool_file = tmp_path / "pool.jsonl"
    pool_file.write_text("".join(json.dumps(d) + "\n" for d in docs))
    store = tc._write_store(tmp_path / "store", tc._grads(model, docs, tc.PROJ))
    with GradientStore.open(store) as s:
        q_rows = target_rows(tc._grads(model, tc._docs(3, seed=7), tc.PROJ), s.spec)
    ids, mask = tc.tokenize([d["text"] for d in tc._docs(3, seed=7)])
    counts = ngram_counts(ids, mask).sum(0)
    kw = dict(store=str(store), pool_file=str(pool_file), q_rows=q_rows, tc=counts,
              method=method)
    one = run(_select, 1, out=str(tmp_path / "one"), **kw)[0]
    two = run(_select, 2, out=str(tmp_path / "two"), **kw)
    for got in two:
        np.testing.assert_allclose(got["scores"], one["scores"], rtol=1e-12, atol=1e-12)
        assert got["chosen"].tolist() == one["chosen"].tolist()
    a, b = ([json.loads(x) for x in (tmp_path / d / "subset.jsonl").read_text().splitlines()]
            for d in ("one", "two"))
    assert [x["sample_id"] for x in a] == [x["sample_id"] for x in b]
    np.testing.assert_allclose([x["score"] for x in a], [x["score"] for x in b], rtol=1e-12)


def _zero_train_save(rank, world, stage, out):
    """Train a tiny GPT-2 3 steps under ZeRO-``stage`` (AdamW), save a checkpoint, and
    return (rank 0) the engine's own full ``exp_avg_sq`` per named parameter."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_optimizer_state

    from reference import tiny_gpt2

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_gpt2(seed=0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True,
                                                     "betas": [0.9, 0.95]}},
           "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(1, 97, (2, 8), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(out, tag="step3")
    full = {n: safe_get_full_optimizer_state(p, "exp_avg_sq").clone()
            for n, p in engine.module.named_parameters()}
    return full if rank == 0 else None


@pytest.mark.parametrize("stage,world", [(3, 3), (2, 2)])
def test_adam_moments_from_zero_checkpoint_equal_engine_state(tmp_path, stage, world,
                                                              need_deepspeed):
    """The Adam moments read offline from a multi-rank ZeRO checkpoint (every rank's flat
    ``exp_avg_sq`` partition mapped onto named parameters) equal the engine's own state
    gathered in-process, exactly; so the LESS preconditioner ``D g_q`` that ``curate
    --method adam-cosine`` builds from the checkpoint equals the one built from that
    gathered state. 3 ranks under ZeRO-3: most parameter sizes do not divide by 3, so every
partition's zero padding is crossed. Breaks if a partition offset, the padding or the
parameter order drift."""
    import torch

    import test_curate as tc
    from dattri_ds import CaptureConfig
    from dattri_ds.capture.hooks import GradientCapture
    from dattri_ds.selection.curate.targets import adam_precondition, load_adam_moments
    from dattri_ds.integrations.optim_state import read_adam_state
    from dattri_ds.ops.inner import materialize
    from dattri_ds.selection.curate.precondition import TorchAdamMoments
    from reference import tiny_gpt2

    full = run(_zero_train_save, world, timeout=300, stage=stage, out=str(tmp_path / "ckpt"))[0]
    folder = tmp_path / "ckpt" / "step3"
    state = read_adam_state(folder)
    assert state.source == f"deepspeed-zero{stage}" and state.step == 3
    assert (state.beta2, state.eps) == (0.95, 1e-8)
    assert set(state.exp_avg_sq) == set(full)
    for name, want in full.items():
        assert torch.equal(state.exp_avg_sq[name], torch.as_tensor(want)), name
    import shutil

    from dattri_ds.errors import ConfigError

    short = shutil.copytree(folder, tmp_path / "short")
    next(short.glob("*rank_1*optim_states.pt")).unlink()
    with pytest.raises(ConfigError, match="a rank's file is missing"):
        read_adam_state(short)

    model = tiny_gpt2(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for n, p in model.named_parameters():
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.as_tensor(full[n])}
    ex_q = tc._grads(model, tc._docs(3, seed=7), None)
    probe = GradientCapture(model, CaptureConfig(), probe_only=True).attach()
    try:
        layers = dict(probe.layers)
        got = adam_precondition(ex_q, layers, load_adam_moments(model, folder))
        want = adam_precondition(ex_q, layers, TorchAdamMoments(opt))
    finally:
        probe.detach()
    for name in want.layers:
        assert torch.equal(got.layers[name].data.values, want.layers[name].data.values), name
        assert not torch.allclose(want.layers[name].data.values,
                                  materialize(ex_q.layers[name]).reshape(3, -1)), name


def _megatron_train(rank, world, argv):
    from dattri_ds.launch.train import main

    return main(argv)


def _megatron_moments(rank, world, run_dir):
    """The Adam moments of a Megatron run's last checkpoint, read offline onto the TP=1 model
    the tools rebuild (in a worker: Megatron's groups are per process)."""
    from dattri_ds.integrations.optim_state import read_adam_state
    from dattri_ds.tools.sources import Run

    run_ = Run.open(run_dir)
    tag = run_.tags("last")[0]
    model = run_.model(tag)
    st = read_adam_state(Path(run_dir) / "checkpoints" / tag, model)
    return {"v": st.exp_avg_sq, "meta": [st.source, st.step, st.beta2, st.eps],
            "tp": [n for n, p in model.named_parameters()
                   if getattr(p, "tensor_model_parallel", False)]}


def test_adam_moments_from_megatron_tp2_equal_tp1_run(tmp_path):
    """``launch/train.py --backend megatron`` with TP=2 (2 gloo ranks, AdamW) trains what one
    TP=1 rank trains; the Adam moments read offline from its two optimizer files (each
    rank's TP shard, joined on the parameter's partition dim) equal those of the TP=1 run's
    single file (rel. err <= 1e-4: the two runs differ by fp32 rounding only) on every
    parameter, TP-split ones included. Breaks if shards are joined on the wrong dim or in
    the wrong order."""
    import json
    import warnings

    import torch
    from _deps import require

    from reference import rel_err

    require("megatron.core", "megatron")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|Torch Norm).*")
    import megatron.core  # noqa: F401  (imported once in the parent, before forking)

    root = Path(__file__).resolve().parents[2]
    cfg = json.loads((root / "configs/zero1_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
               gradient_clipping=0.0,
               optimizer={"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95]}})
    cfg.pop("scheduler")
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    (tmp_path / "model.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}))
    got = {}
    for tp in (2, 1):
        out = tmp_path / f"tp{tp}"
        run(_megatron_train, tp, timeout=300, argv=[
            "--backend", "megatron", "--tensor-model-parallel-size", str(tp),
            "--deepspeed_config", str(tmp_path / "ds.json"),
            "--model-config", str(tmp_path / "model.json"), "--out", str(out),
            "--steps", "2", "--save-every", "2", "--train-data",
            str(root / "data/tiny/train.jsonl"), "--max-docs", "16", "--seq-len", "32",
            "--vocab-size", "512", "--log-every", "1"])
        got[tp] = run(_megatron_moments, 1, timeout=300, run_dir=str(out))[0]
    assert got[2]["meta"] == ["megatron-tp2", 2, 0.95, 1e-8]
    assert got[1]["meta"] == ["megatron-tp1", 2, 0.95, 1e-8]
    assert got[2]["tp"], "no tensor-parallel parameter: the join is not exercised"
    assert got[2]["v"].keys() == got[1]["v"].keys() and got[1]["v"]
    errs = {n: rel_err(torch.as_tensor(got[2]["v"][n]).double(),
                       torch.as_tensor(got[1]["v"][n]).double()) for n in got[1]["v"]}
    assert max(errs.values()) <= 1e-4, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def _collect_and_curate(rank, world, run_dir, out):
    """``collect`` the last checkpoint's pool store, then ``curate`` with cosine and with
    adam-cosine (the run's Adam state); the two score vectors (store order)."""
    from dattri_ds.cli.exits import run as cli
    from dattri_ds.tools.collect import main as collect
    from dattri_ds.tools.curate import main as curate_main

    root = Path(__file__).resolve().parents[2]
    grads, pool = Path(out) / "grads", str(root / "data/tiny/train.jsonl")
    assert cli(collect, ["--run-dir", run_dir, "--data", pool, "--max-docs", "12",
                         "--checkpoints", "last", "--out", str(grads), "--projection",
                         "sparse", "--projection-dim", "64"]) == 0
    scores = {}
    for method in ("cosine", "adam-cosine"):
        sel = Path(out) / method
        assert cli(curate_main, ["--run-dir", run_dir, "--store", str(grads), "--target",
                            str(root / "data/tiny/target.jsonl"), "--target-max-docs", "4",
                            "--method", method, "--examples", "4", "--out", str(sel)]) == 0
        scores[method] = np.load(sel / "scores.npy")
    return scores


@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
def test_curate_adam_cosine_from_sharded_run(tmp_path, backend, need_deepspeed):
    """``dattri-ds curate --method adam-cosine`` on a 2-rank ZeRO-3 run and on a TP=2
    Megatron run of launch/train.py: the Adam state is read from the sharded checkpoint
    (no training_state.pt there) and changes the scores against plain cosine."""
    import json
    import warnings

    root = Path(__file__).resolve().parents[2]
    if backend == "megatron":
        from _deps import require

        require("megatron.core", "megatron")
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|Torch Norm).*")
        import megatron.core  # noqa: F401  (imported once in the parent, before forking)
    cfg = json.loads((root / "configs/zero3_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    cfg["optimizer"]["params"]["lr"] = 1e-2
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    (tmp_path / "model.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}))
    out = tmp_path / "run"
    parallel = ["--tensor-model-parallel-size", "2"] if backend == "megatron" else []
    run(_megatron_train, 2, timeout=300, argv=[
        "--backend", backend, *parallel, "--deepspeed_config", str(tmp_path / "ds.json"),
        "--model-config", str(tmp_path / "model.json"), "--out", str(out), "--steps", "2",
        "--save-every", "2", "--train-data", str(root / "data/tiny/train.jsonl"),
        "--max-docs", "16", "--seq-len", "32", "--vocab-size", "512", "--log-every", "1"])
    tag = next((out / "checkpoints").glob("step2"))
    assert not (tag / "training_state.pt").exists()
    got = run(_collect_and_curate, 1, timeout=300, run_dir=str(out), out=str(tmp_path))[0]
    assert got["cosine"].shape == got["adam-cosine"].shape == (12,)
    assert not np.allclose(got["cosine"], got["adam-cosine"], rtol=1e-3, atol=0)
