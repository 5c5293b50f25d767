"""Offline curation (dattri_ds.selection.curate, dattri-ds curate).

Invariants: the streamed scores equal the cross_gram references (cosine, the
Adam-preconditioned target, the lr-weighted trajectory), and the projected ones stay within
the projection's documented error of the exact ones; every budget is met exactly; a small
block size gives the scores and subset of a one-block read; bad inputs are one-line errors
(exit 2) that write nothing; subset.jsonl with --with-text is train data launch/ accepts.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dattri_ds
from dattri_ds import CaptureConfig, GradBatch, ProjectionConfig
from dattri_ds.selection.curate import CurateConfig, Pool, choose, curate, get_method, resolve_budget
from dattri_ds.selection.curate.pool import JsonlTexts
from dattri_ds.selection.curate.scoring import score_pool
from dattri_ds.errors import ConfigError
from dattri_ds.ops.inner import cross_gram, materialize, sq_norms
from dattri_ds.store import GradientStore, StoreConfig, seal_store
from dattri_ds.store.spec import StoreSpec
from dattri_ds.store.writer import GradientStoreWriter
from reference import tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]
T = 12
SOURCES = ("alpha", "beta", "gamma")
PROJ = ProjectionConfig(kind="sparse", dim=32, seed=0)


def tokenize(texts):
    """Characters -> ids 1..96 (0 pads), T tokens: a tokenizer for the test's texts."""
    ids = torch.zeros(len(texts), T, dtype=torch.long)
    mask = torch.zeros(len(texts), T, dtype=torch.long)
    for i, t in enumerate(texts):
        codes = [(ord(c) % 96) + 1 for c in t[:T]]
        ids[i, :len(codes)] = torch.tensor(codes)
        mask[i, :len(codes)] = 1
    return ids, mask


def _docs(n: int, seed: int = 0) -> list[dict]:
    g = np.random.default_rng(seed)
    words = ["to be", "or not", "import os", "def f():", "the king", "return x", "lorem"]
    out = []
    for i in range(n):
        text = f"{i} " + " ".join(g.choice(words, size=4))  # distinct within T characters
        out.append({"id": f"d{i}", "source": SOURCES[i % 3], "title": "t", "text": text})
    return out


def _batch(docs):
    ids, mask = tokenize([d["text"] for d in docs])
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def _grads(model, docs, projection):
    cfg = CaptureConfig(projection=projection)
    return GradBatch.cat(list(dattri_ds.collect(model, [_batch(docs)], cfg,
                                                user_ids=[[d["id"] for d in docs]])))


def _write_store(path: Path, batch: GradBatch, *, fingerprint="model:test@step1",
                 projection=PROJ, seal=True) -> Path:
    spec = StoreSpec.from_batch(batch, projection=projection, fingerprint=fingerprint,
                                capture=CaptureConfig(projection=projection), checkpoint="step1")
    w = GradientStoreWriter(StoreConfig(path=str(path)), spec)
    if batch.batch_size:
        w.append(batch)
    w.close()
    if seal:
        seal_store(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model, a 24-document pool in a store, 3 target documents (projected + exact)."""
    tmp = tmp_path_factory.mktemp("curate")
    model = tiny_gpt2()
    docs = _docs(24)
    pool_file = tmp / "pool.jsonl"
    pool_file.write_text("".join(json.dumps(d) + "\n" for d in docs))
    target = _docs(3, seed=7)
    train = _grads(model, docs, PROJ)
    store = GradientStore.open(_write_store(tmp / "store", train), require_complete=True)
    pool = Pool.build(store.ids, store.token_counts,
                      JsonlTexts.open([str(pool_file)], store.ids, tokenize))
    q = _grads(model, target, PROJ)
    return {"tmp": tmp, "model": model, "docs": docs, "pool_file": pool_file, "target": target,
            "train": train, "store": store, "pool": pool, "q": q,
            "q_rows": _rows(q, store.spec)}


def _rows(batch, spec):
    from dattri_ds.selection.curate.targets import target_rows

    return target_rows(batch, spec)


def _cos_ref(train: GradBatch, q: GradBatch) -> torch.Tensor:
    """``[N, Q]`` cosines through the library's cross_gram / sq_norms."""
    g = cross_gram(train, q).double()
    return g / (sq_norms(train).double().sqrt()[:, None] * sq_norms(q).double().sqrt()[None])


def _score(setup, config, targets=None, weights=None, stores=None, **kw):
    method = get_method(config.method)(config)
    return score_pool(method, stores or {"step1": setup["store"]}, setup["pool"],
                      targets=targets or {"step1": setup["q_rows"]}, weights=weights, **kw)


def test_cosine_equals_cross_gram(setup):
    """Streamed cosine (mean and max over targets) equals cross_gram / norms on the stored
    rows: breaks if the column layout, the normalization or the aggregation drifts."""
    ref = _cos_ref(setup["store"].to_gradbatch(slice(None)), setup["q"])
    for agg, want in (("mean", ref.mean(1)), ("max", ref.max(1).values)):
        got = _score(setup, CurateConfig(method="cosine", examples=3, aggregate=agg,
                                          block_rows=5)).scores
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


def test_projected_cosine_within_projection_error(setup):
    """Projected-store cosines stay within the projection's documented inner-product error
    (``error(k) = sqrt(2/k)`` in units of |x||y|, 5x per pair as test_projection checks) of
    the exact cosines: breaks if the target is captured in another space than the rows."""
    model, docs, target = setup["model"], setup["docs"], setup["target"]
    exact = _cos_ref(_grads(model, docs, None), _grads(model, target, None)).mean(1)
    proj = ProjectionConfig(kind="dense", dim=512, seed=3)
    rows = _grads(model, docs, proj)
    store = GradientStore.open(_write_store(setup["tmp"] / "dense", rows, projection=proj))
    got = score_pool(get_method("cosine")(CurateConfig(examples=1)), {"step1": store},
                     setup["pool"], targets={"step1": _rows(_grads(model, target, proj),
                                                              store.spec)}).scores
    err = math.sqrt(2 / proj.dim)
    diff = np.abs(got - exact.numpy())
    assert diff.max() <= 3 * 5 * err and diff.mean() <= 2 * err, (diff.max(), diff.mean())


def test_adam_moments_of_a_folder_without_optimizer_state_is_a_usage_error(tmp_path):
    """adam-cosine on a checkpoint with no optimizer state (a Hugging Face model folder, or
    weights only) is one ConfigError naming the folder and the files it looks for."""
    from dattri_ds.selection.curate.targets import load_adam_moments

    with pytest.raises(ConfigError, match=r"has none .*_optim_states.pt.*--method cosine"):
        load_adam_moments(tiny_gpt2(), tmp_path)


def test_adam_target_equals_preconditioned_reference(setup, tmp_path):
    """The target preconditioned from a checkpoint's training_state.pt equals the reference
    ``<g_b, D g_q>`` computed per parameter from the optimizer's exp_avg_sq (D = 1 /
    (sqrt(v / (1 - beta2^t)) + eps); captured rows carry the token-sum scale n_b n_q),
    exactly before projection and within the documented error ``5 sqrt(2/k) |g_b| |D g_q|``
    after it: breaks if the canonical layout and the parameter layout drift apart."""
    from dattri_ds.capture.hooks import GradientCapture
    from dattri_ds.selection.curate.targets import adam_precondition, adam_target, load_adam_moments

    model = tiny_gpt2(seed=1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    b = _batch(setup["docs"][:8])
    for _ in range(2):
        opt.zero_grad()
        model(**b).loss.backward()
        opt.step()
    opt.zero_grad()
    torch.save({"optimizer": opt.state_dict()}, tmp_path / "training_state.pt")
    moments = load_adam_moments(model, tmp_path)
    target, train = setup["docs"][8:10], setup["docs"][:5]
    ex_q, ex_t = _grads(model, target, None), _grads(model, train, None)
    probe = GradientCapture(model, CaptureConfig(), probe_only=True).attach()
    try:
        layers = dict(probe.layers)
        dq = adam_precondition(ex_q, layers, moments)
        proj = ProjectionConfig(kind="dense", dim=1024, seed=1)
        pq = adam_target(ex_q, layers, moments, proj)
    finally:
        probe.detach()
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    step = int(next(iter(opt.state.values()))["step"])
    ref = torch.zeros(len(train), len(target), dtype=torch.float64)
    for name, (module, _kind) in layers.items():
        d = torch.cat([1.0 / ((opt.state[p]["exp_avg_sq"] / (1 - beta2 ** step)).sqrt() + eps)
                       .flatten() for _, p in module.named_parameters(recurse=False)])
        gq = _param_rows(model, module, target)
        gt = _param_rows(model, module, train)
        ref += (gt.double() @ (gq.double() * d.double()).T)
    ref *= ex_t.token_counts.double()[:, None] * ex_q.token_counts.double()[None]
    exact = cross_gram(ex_t, dq).double()
    assert float((exact - ref).abs().max() / ref.abs().max()) <= 1e-4
    got = cross_gram(_grads(model, train, proj), pq).double()
    bound = 5 * math.sqrt(2 / proj.dim) * (sq_norms(ex_t).double().sqrt()[:, None]
                                           * sq_norms(dq).double().sqrt()[None])
    assert bool(((got - ref).abs() <= bound).all())


def _param_rows(model, module, docs) -> torch.Tensor:
    """``[B, D]`` per-example gradients of ``module``'s own parameters (flattened, in
    named_parameters order) by one backward per example."""
    rows = []
    for d in docs:
        b = _batch([d])
        model.zero_grad()
        model(**b).loss.backward()
        rows.append(torch.cat([p.grad.flatten() for _, p in module.named_parameters(recurse=False)]))
    model.zero_grad()
    return torch.stack(rows)


def test_trajectory_is_lr_weighted_sum(setup):
    """``trajectory`` over two checkpoints = sum_c lr_c * cosine_c (the stores' rows in
    different orders are aligned by sample id)."""
    store = setup["store"]
    perm = list(reversed(range(len(store))))
    other = setup["train"].index(perm)
    s2 = GradientStore.open(_write_store(setup["tmp"] / "step2", other))
    q2 = setup["q_rows"] * 2 + 0.1
    cfg = CurateConfig(method="trajectory", examples=2, block_rows=7)
    got = _score(setup, cfg, targets={"a": setup["q_rows"], "b": q2},
                 weights={"a": 0.5, "b": 2.0}, stores={"a": store, "b": s2}).scores
    one = _score(setup, CurateConfig(method="cosine", examples=2)).scores
    ref_b = _cos_ref(store.to_gradbatch(slice(None)), setup["q"]).numpy()  # q2: same layout
    del ref_b
    two = score_pool(get_method("cosine")(CurateConfig(examples=2)), {"b": store},
                     setup["pool"], targets={"b": q2}).scores
    np.testing.assert_allclose(got, 0.5 * one + 2.0 * two, rtol=1e-6, atol=1e-9)


def test_budget_met_exactly():
    """fraction / examples give exactly round(f N) / N rows; tokens never exceeds the budget
    and leaves no unselected row that would still fit; source and cluster caps hold."""
    g = np.random.default_rng(0)
    n = 50
    scores = g.normal(size=n)
    tokens = g.integers(1, 40, size=n)
    sources = np.arange(n) % 3
    for cfg, want in ((CurateConfig(fraction=0.1), 5), (CurateConfig(examples=17), 17),
                      (CurateConfig(fraction=1.0), n)):
        b = resolve_budget(cfg, n, tokens)
        got = choose(scores, b, tokens=tokens, sources=sources, clusters=None, hashes=None,
                     config=cfg)
        assert len(got) == want and len(set(got.tolist())) == want
    cfg = CurateConfig(tokens=200)
    got = choose(scores, resolve_budget(cfg, n, tokens), tokens=tokens, sources=sources,
                 clusters=None, hashes=None, config=cfg)
    used = int(tokens[got].sum())
    rest = np.setdiff1d(np.arange(n), got)
    assert used <= 200 and (tokens[rest] > 200 - used).all()
    cfg = CurateConfig(examples=12, max_source_share=0.5, max_per_cluster=2)
    clusters = np.arange(n) % 10
    got = choose(scores, resolve_budget(cfg, n, tokens), tokens=tokens, sources=sources,
                 clusters=clusters, hashes=None, config=cfg)
    assert len(got) == 12 and np.bincount(sources[got]).max() <= 6
    assert np.bincount(clusters[got]).max() <= 2
    with pytest.raises(ConfigError, match="diversity caps leave"):
        cfg = CurateConfig(examples=12, max_per_cluster=1)  # 10 clusters
        choose(scores, resolve_budget(cfg, n, tokens), tokens=tokens, sources=sources,
               clusters=clusters, hashes=None, config=cfg)


def test_dedupe_keeps_one_per_content_hash():
    """Rows sharing a content hash: only the best ranked is kept (unless --no-dedupe)."""
    scores = np.array([3.0, 2.0, 1.0, 0.5])
    hashes = ["h1", "h1", "h2", "h3"]
    args = dict(tokens=np.ones(4, int), sources=np.zeros(4, int), clusters=None,
                hashes=hashes)
    cfg = CurateConfig(examples=2)
    assert choose(scores, resolve_budget(cfg, 4, args["tokens"]), config=cfg,
                  **args).tolist() == [0, 2]
    cfg = CurateConfig(examples=2, dedupe=False)
    assert choose(scores, resolve_budget(cfg, 4, args["tokens"]), config=cfg,
                  **args).tolist() == [0, 1]


def test_streaming_equals_in_memory(setup):
    """block_rows=2 (many reads) gives the scores and the subset of one block of all rows,
    for a gradient method and for the combination with the content prior and clusters."""
    from dattri_ds.selection.curate.pool import ngram_counts

    ids, mask = tokenize([d["text"] for d in setup["target"]])
    tc = ngram_counts(ids, mask).sum(0)
    for method in ("cosine", "combined", "content"):
        outs = []
        for block in (2, 10**6):
            cfg = CurateConfig(method=method, fraction=0.25, block_rows=block,
                               max_per_cluster=1)
            r = curate(cfg, {"step1": setup["store"]}, setup["pool"],
                       targets={"step1": setup["q_rows"]}, target_counts=tc)
            outs.append(r)
        np.testing.assert_array_equal(outs[0].scores, outs[1].scores)
        assert outs[0].chosen.tolist() == outs[1].chosen.tolist()
        assert len(outs[0].chosen) == 6


def test_content_prior_is_dsir_log_ratio(setup):
    """``content`` = mean over a row's hashed n-grams of log p_target - log p_pool (add-one
    smoothed, p_pool over the whole pool)."""
    from dattri_ds.selection.curate.pool import ngram_counts

    ids, mask = tokenize([d["text"] for d in setup["target"]])
    tc = ngram_counts(ids, mask).sum(0).double()
    pids, pmask = tokenize([d["text"] for d in setup["docs"]])
    pc = ngram_counts(pids, pmask).double()
    dim = tc.numel()
    lt = torch.log((tc + 1) / (tc.sum() + dim))
    ls = torch.log((pc.sum(0) + 1) / (pc.sum() + dim))
    want = (pc @ (lt - ls)) / pc.sum(1)
    got = _score(setup, CurateConfig(method="content", examples=1),
                 target_counts=tc.float()).scores
    order = [setup["pool"].ids.index(i) for i in setup["store"].ids]
    np.testing.assert_allclose(got[order], want.numpy(), rtol=1e-6)


# ---- the command line -----------------------------------------------------------------------
def _fake_run(tmp: Path, model) -> Path:
    """A run folder the tool opens (model config, trajectory) without training."""
    run = tmp / "run"
    (run / "model").mkdir(parents=True)
    model.config.to_json_file(str(run / "model/config.json"))
    (run / "trajectory.json").write_text(json.dumps(
        {"checkpoints": [{"tag": "step1", "step": 1, "lr": 1e-3}]}))
    (run / "resolved_dattri_ds_config.json").write_text(json.dumps({"train": {"seq_len": T}}))
    return run


@pytest.fixture(scope="module")
def cli(setup):
    """A run folder, its pool store and a target store of its fingerprint."""
    from dattri_ds.tools.sources import Run

    tmp = setup["tmp"] / "cli"
    run = _fake_run(tmp, setup["model"])
    fp = f"{Run.open(run).fingerprint()}@step1"
    _write_store(tmp / "grads/step1", setup["train"], fingerprint=fp)
    _write_store(tmp / "tstore", setup["q"], fingerprint=fp)
    return {"run": run, "grads": tmp / "grads", "tstore": tmp / "tstore", "tmp": tmp,
            "pool": setup["pool_file"]}


def _curate(cli, *extra, method: str | None = "cosine"):
    """``dattri-ds curate`` on the fixture's run and pool store (the tests' target is a
    target store, so a gradient method: ``method=None`` leaves the default)."""
    from dattri_ds.cli.exits import run
    from dattri_ds.tools.curate import main

    base = ["--run-dir", str(cli["run"]), "--store", str(cli["grads"]), "--pool",
            str(cli["pool"])] + (["--method", method] if method else [])
    return run(main, base + list(extra))


def test_default_method_travels_from_the_config():
    """The tool's --method default and help come from CurateConfig.method (one source of
    truth), and it is the content prior, the method the curation benchmark supports
    (docs/curation.md): breaks if the flag table or the config drifts."""
    from dattri_ds.tools.curate import build_parser

    p = build_parser()
    args = p.parse_args(["--store", "s", "--out", "o", "--examples", "1"])
    assert args.method == CurateConfig(examples=1).method == "content"
    action = next(a for a in p._actions if a.dest == "method")
    assert "default 'content'" in action.help and "Measured effect" in action.help


def test_cli_default_method_needs_target_documents(cli, capsys):
    """The default (content prior) with only a --target-store is a one-line usage error
    that names the fix (--method cosine) and writes nothing."""
    out = cli["tmp"] / "sel-default"
    capsys.readouterr()
    assert _curate(cli, "--target-store", str(cli["tstore"]), "--examples", "5",
                   "--out", str(out), method=None) == 2
    err = capsys.readouterr().err.strip()
    assert "(the default)" in err and "--method cosine" in err and "\n" not in err, err
    assert not out.exists()


def test_cli_curates_writes_and_refuses_overwrite(cli, setup, capsys):
    """`dattri-ds curate` with a target store writes the subset (ids = the library's choice),
    scores, config and report; a second run into the same --out is refused (exit 2)
    unless --force."""
    out = cli["tmp"] / "sel"
    assert _curate(cli, "--target-store", str(cli["tstore"]), "--examples", "5",
                   "--with-text", "--out", str(out)) == 0
    lines = [json.loads(x) for x in (out / "subset.jsonl").read_text().splitlines()]
    want = curate(CurateConfig(method="cosine", examples=5), {"step1": setup["store"]},
                  setup["pool"],
                  targets={"step1": setup["q_rows"]})
    assert [x["sample_id"] for x in lines] == want.sample_ids(setup["pool"])
    assert all(set(x) >= {"id", "source", "title", "text"} for x in lines)
    assert np.load(out / "scores.npy").shape == (24,)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["config"]["examples"] == 5 and cfg["result"]["kept_rows"] == 5
    report = (out / "report.md").read_text()
    assert "## Per-source shares" in report and "budget 5 examples;" in report
    assert "<table>" in (out / "report.html").read_text()
    capsys.readouterr()
    assert _curate(cli, "--target-store", str(cli["tstore"]), "--examples", "5",
                   "--out", str(out)) == 2
    assert "already holds" in capsys.readouterr().err
    assert _curate(cli, "--target-store", str(cli["tstore"]), "--examples", "5",
                   "--out", str(out), "--force") == 0


@pytest.mark.parametrize("case", ["fraction0", "fraction_big", "examples0", "examples_big",
                                  "tokens_big", "two_budgets", "other_projection",
                                  "other_model", "empty_store"])
def test_cli_bad_inputs_are_one_line_and_write_nothing(cli, setup, capsys, case):
    """Each bad input exits 2 with one `dattri-ds: error:` line naming the value, and
    leaves --out unwritten."""
    tstore, grads = str(cli["tstore"]), None
    budget = ["--examples", "3"]
    if case == "fraction0":
        budget = ["--fraction", "0"]
    elif case == "fraction_big":
        budget = ["--fraction", "1.5"]
    elif case == "examples0":
        budget = ["--examples", "0"]
    elif case == "examples_big":
        budget = ["--examples", "25"]
    elif case == "tokens_big":
        budget = ["--tokens", "100000"]
    elif case == "two_budgets":
        budget = ["--examples", "3", "--fraction", "0.5"]
    elif case == "other_projection":
        from dattri_ds.tools.sources import Run

        fp = f"{Run.open(cli['run']).fingerprint()}@step1"
        proj = ProjectionConfig(kind="sparse", dim=16, seed=0)
        tstore = str(_write_store(cli["tmp"] / f"t-{case}", _grads(
            setup["model"], setup["target"], proj), fingerprint=fp, projection=proj))
    elif case == "other_model":
        tstore = str(_write_store(cli["tmp"] / f"t-{case}", setup["q"],
                                  fingerprint="model:other@step1"))
    elif case == "empty_store":
        from dattri_ds.tools.sources import Run

        fp = f"{Run.open(cli['run']).fingerprint()}@step1"
        grads = cli["tmp"] / "empty/step1"
        _write_store(grads, setup["train"].index([]), fingerprint=fp)
    out = cli["tmp"] / f"out-{case}"
    args = ["--target-store", tstore, *budget, "--out", str(out)]
    if grads is not None:
        args = ["--store", str(grads.parent)] + args
    capsys.readouterr()
    assert _curate(cli, *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dattri-ds: error:") and "\n" not in err, err
    assert not out.exists()


def test_subset_trains_with_launch(cli, tmp_path):
    """subset.jsonl written with --with-text is train data: launch/train.py --backend torch
    trains one step on it."""
    out = tmp_path / "sel"
    assert _curate(cli, "--target-store", str(cli["tstore"]), "--examples", "8",
                   "--with-text", "--out", str(out)) == 0
    cfg = json.loads((ROOT / "configs/zero0_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 2, 1
    cfg.pop("scheduler", None)
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch/train.py"), "--deepspeed_config",
         str(tmp_path / "ds.json"), "--out", str(tmp_path / "run"), "--steps", "1",
         "--train-data", str(out / "subset.jsonl"), "--seq-len", "16", "--vocab-size", "64",
         "--backend", "torch"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 1
