"""Offline attribution tools on a real (tiny) DeepSpeed run: collect -> fit -> attribute -> report.

Invariants: TracIn equals ``sum_c lr_c <g_n^c, g_q^c>`` computed independently here (plain
autograd per example, learning rates from the run's trajectory); EK-FAC tends to grad-dot /
lambda as its damping lambda grows, with grad-dot also from plain autograd; the default
``ekfac-trajectory`` equals the sum of per-checkpoint EK-FAC scores (normalized per query); collect
resumes without recomputing or duplicating; bad input (missing checkpoint, store of another
model, query longer than the context, empty query file) fails with an error naming the file
and the fix.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _deps import require

from dattri_ds.errors import ConfigError, StoreMismatchError

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
TINY = str(ROOT / "data/tiny/train.jsonl")
QUERIES = str(ROOT / "data/tiny/target.jsonl")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    require("deepspeed", "deepspeed")
    from test_launch import ENV, SMALL, _config

    tmp = tmp_path_factory.mktemp("tools")
    out = tmp / "run"
    cmd = [sys.executable, str(ROOT / "launch/train.py"), "--deepspeed_config",
           str(_config(tmp, 3)), "--out", str(out), "--steps", "4", "--save-every", "2", *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _collect(run_dir, out, n=16):
    from dattri_ds.tools import collect
    return collect.main(["--run", str(run_dir), "--data", TINY, "--max-docs", str(n), "--out",
                         str(out), "--projection-dim", "32", "--batch-size", "8"])


def test_collect_fit_attribute_report(run_dir, tmp_path):
    """The whole offline pipeline on a projected store runs end to end: TracIn is the
    lr-weighted sum of the tool's own per-checkpoint grad-dot runs (consistency between the
    tool's modes; the numbers themselves are checked against independent references in
    test_tracin_and_ekfac_match_independent_references), EK-FAC runs on fitted factors, and
    the report is written."""
    from dattri_ds.tools import attribute, fit, report

    grads = tmp_path / "grads"
    assert _collect(run_dir, grads) == {"step2": 16, "step4": 16}
    base = ["--run", str(run_dir), "--store", str(grads), "--queries", QUERIES,
            "--query-max-docs", "2", "--truncate"]
    attribute.main([*base, "--method", "tracin", "--out", str(tmp_path / "tracin")])
    tr = np.load(tmp_path / "tracin/scores.npy")
    per = np.load(tmp_path / "tracin/per_checkpoint.npy")
    assert tr.shape == (16, 2) and per.shape == (2, 16, 2)
    lrs = {c["tag"]: c["lr"] for c in json.loads((run_dir / "trajectory.json").read_text())
           ["checkpoints"]}
    for c, tag in enumerate(["step2", "step4"]):
        attribute.main([*base, "--method", "graddot", "--checkpoints", tag, "--out",
                        str(tmp_path / f"gd-{tag}")])
        gd = np.load(tmp_path / f"gd-{tag}/scores.npy")
        np.testing.assert_allclose(per[c], lrs[tag] * gd, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tr, per.sum(0), rtol=1e-6)
    fit.main(["--run", str(run_dir), "--data", TINY, "--max-docs", "16", "--store",
              str(grads / "step4"), "--out", str(tmp_path / "f.pt")])
    attribute.main([*base, "--method", "ekfac", "--factors", str(tmp_path / "f.pt"), "--out",
                    str(tmp_path / "ekfac")])
    ek = np.load(tmp_path / "ekfac/scores.npy")
    assert np.isfinite(ek).all() and not np.allclose(ek, 0)
    # trajectory: exact factors at every checkpoint; == sum of per-checkpoint ekfac runs
    written = fit.main(["--run", str(run_dir), "--data", TINY, "--max-docs", "16",
                        "--checkpoint", "all", "--out", str(tmp_path / "factors")])
    assert [p.name for p in written] == ["step2.pt", "step4.pt"]
    attribute.main([*base, "--factors", str(tmp_path / "factors"), "--out",
                    str(tmp_path / "traj")])  # the default method: ekfac-trajectory
    traj = np.load(tmp_path / "traj/model_scores.npy")  # its own scores (before the prior)
    summary = json.loads((tmp_path / "traj/summary.json").read_text())
    assert summary["method"] == "ekfac-trajectory" and summary["text_weight"] == 0.25
    parts = []
    for tag in ("step2", "step4"):
        attribute.main([*base, "--method", "ekfac", "--checkpoints", tag, "--factors",
                        str(tmp_path / "factors" / f"{tag}.pt"), "--text-weight", "0",
                        "--out", str(tmp_path / f"ek-{tag}")])
        parts.append(np.load(tmp_path / f"ek-{tag}/scores.npy"))
    # default weighting "normalized": each checkpoint's scores at unit std per query
    want = sum(p / p.std(0, ddof=1, keepdims=True) for p in parts)
    np.testing.assert_allclose(traj, want, rtol=1e-4, atol=1e-6)
    md = report.main(["--attribution", str(tmp_path / "tracin"), "--train-data", TINY])
    text = md.read_text()
    assert "Top proponents" in text and "Top opponents" in text
    assert (tmp_path / "tracin/tracin_checkpoints.png").exists()
    assert (tmp_path / "tracin/report.html").exists()


def _full_grads(model, data) -> "torch.Tensor":
    """``[N, P]``: per-example gradients of the summed token loss over every trainable
    parameter (one backward per example; nothing of dattri-ds's capture involved)."""
    import torch
    from reference import token_losses

    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(data)):
        b = data.batch(torch.tensor([i]))
        ll, _ = token_losses(model, b["input_ids"], b["attention_mask"], b["labels"])
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(ll.sum(), params)]))
    return torch.stack(rows).double()


def test_tracin_and_ekfac_match_independent_references(run_dir, tmp_path):
    """The tools' TracIn (store kept exact: the projection size exceeds every layer) equals
    ``sum_c lr_c G_train^c G_query^c^T`` from plain per-example autograd over all parameters
    and the trajectory's learning rates; EK-FAC with an absolute damping far above the
    curvature equals that checkpoint's grad-dot / damping. Breaks if a checkpoint's lr is
    dropped or replaced, a checkpoint is skipped, rows are misaligned with their ids, a
    layer is lost, or the damping / preconditioning is applied wrongly."""
    import torch

    from dattri_ds.tools import attribute, collect, fit
    from dattri_ds.tools.sources import Run
    from dattri_ds.tools.texts import load_texts

    grads = tmp_path / "exact"
    collect.main(["--run", str(run_dir), "--data", TINY, "--max-docs", "6", "--out",
                  str(grads), "--projection-dim", str(1 << 22), "--batch-size", "3"])
    base = ["--run", str(run_dir), "--store", str(grads), "--queries", QUERIES,
            "--query-max-docs", "2", "--truncate"]
    attribute.main([*base, "--method", "tracin", "--out", str(tmp_path / "tracin")])
    got = np.load(tmp_path / "tracin/scores.npy")
    ids = [i.split("#")[0] for i in json.loads((tmp_path / "tracin/train_ids.json").read_text())]

    run = Run.open(run_dir)
    tok = run.tokenizer()
    train = load_texts(TINY, tok, run.seq_len, 6)
    queries = load_texts(QUERIES, tok, run.context, 2, context=run.context, truncate=True)
    order = [[d.id for d in train.docs].index(i) for i in ids]
    trajectory = json.loads((run_dir / "trajectory.json").read_text())["checkpoints"]
    assert [c["tag"] for c in trajectory] == ["step2", "step4"]
    want, dots = 0, {}
    for c in trajectory:
        model = run.model(c["tag"])
        dots[c["tag"]] = _full_grads(model, train)[order] @ _full_grads(model, queries).T
        want = want + c["lr"] * dots[c["tag"]]
    assert len({c["lr"] for c in trajectory}) == 2  # distinct lrs: weighting is observable
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-4, atol=1e-6 * float(abs(want).max()))

    damping = 1e9
    fit.main(["--run", str(run_dir), "--data", TINY, "--max-docs", "6", "--store",
              str(grads / "step4"), "--damping", str(damping), "--damping-mode", "absolute",
              "--power", "1", "--out", str(tmp_path / "f.pt")])
    attribute.main([*base, "--method", "ekfac", "--factors", str(tmp_path / "f.pt"),
                    "--text-weight", "0", "--out", str(tmp_path / "ekfac")])
    ek = np.load(tmp_path / "ekfac/scores.npy")
    ref = (dots["step4"] / damping).numpy()
    np.testing.assert_allclose(ek, ref, rtol=1e-3, atol=1e-4 * float(abs(ref).max()))


def test_whitened_store_scores_equal_the_exact_store(run_dir, tmp_path):
    """collect --factors DIR (whitening defaults to ekfac) stores rows whitened by each
    checkpoint's exact factors; with k above every layer's size (kept exactly) the default
    ekfac-trajectory scores them as it scores the exact store (the query is whitened by the
    same factors),
    and a whitened store refuses a method it was not whitened for. Breaks if collect and
    attribute whiten with different factors or checkpoints, or attribute treats whitened
    rows as raw gradients."""
    from dattri_ds.tools import attribute, collect, fit

    factors = tmp_path / "factors"
    fit.main(["--run", str(run_dir), "--data", TINY, "--max-docs", "6", "--checkpoint", "all",
              "--out", str(factors)])
    stores = {}
    for name, extra in (("exact", []), ("white", ["--factors", str(factors)])):  # ekfac
        stores[name] = tmp_path / name
        collect.main(["--run", str(run_dir), "--data", TINY, "--max-docs", "6", "--out",
                      str(stores[name]), "--projection-dim", str(1 << 22), "--batch-size", "3",
                      *extra])
    got = {}
    for name, store in stores.items():
        base = ["--run", str(run_dir), "--store", str(store), "--queries", QUERIES,
                "--query-max-docs", "2", "--truncate", "--factors", str(factors)]
        attribute.main([*base, "--out", str(tmp_path / f"attr-{name}")])
        got[name] = np.load(tmp_path / f"attr-{name}/scores.npy")
    np.testing.assert_allclose(got["white"], got["exact"], rtol=1e-3,
                               atol=1e-5 * float(abs(got["exact"]).max()))
    with pytest.raises(ConfigError, match="whitened"):
        attribute.main([*base, "--method", "tracin", "--out", str(tmp_path / "bad")])
    # factors refitted at another power whiten differently: the whitened store refuses them
    other = tmp_path / "factors-p05"
    fit.main(["--run", str(run_dir), "--data", TINY, "--max-docs", "6", "--checkpoint", "all",
              "--power", "0.5", "--out", str(other)])
    white = ["--run", str(run_dir), "--store", str(stores["white"]), "--queries", QUERIES,
             "--query-max-docs", "2", "--truncate"]
    with pytest.raises(StoreMismatchError, match="whitened_by: stored factors"):
        attribute.main([*white, "--factors", str(other), "--out", str(tmp_path / "bad2")])


def test_collect_resumes_without_duplicates(run_dir, tmp_path):
    """A second collect adds nothing; a larger one adds only the new documents."""
    from dattri_ds.store import GradientStore

    grads = tmp_path / "g"
    _collect(run_dir, grads, 8)
    assert _collect(run_dir, grads, 8) == {"step2": 0, "step4": 0}
    assert _collect(run_dir, grads, 12) == {"step2": 4, "step4": 4}
    with GradientStore.open(grads / "step4") as s:
        assert len(s) == 12 and len(set(s.ids)) == 12


def test_bad_input_is_named(run_dir, tmp_path):
    """Missing checkpoint, store of another model, long or empty queries: clear errors."""
    from dattri_ds.tools import attribute, collect

    grads = tmp_path / "g"
    _collect(run_dir, grads, 4)
    args = ["--run", str(run_dir), "--store", str(grads), "--out", str(tmp_path / "a")]
    with pytest.raises(ConfigError, match="not in .*trajectory.json"):
        collect.main(["--run", str(run_dir), "--checkpoints", "step99", "--out", str(grads)])
    with pytest.raises(ConfigError, match=r"longer than .* --truncate"):
        attribute.main([*args, "--queries", str(ROOT / "data/target/hamlet.jsonl")])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty.jsonl.*no documents"):
        attribute.main([*args, "--queries", str(empty)])
    other = tmp_path / "other"
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("checkpoints"))
    (other / "checkpoints").symlink_to(run_dir / "checkpoints")
    cfg = json.loads((other / "model/config.json").read_text())
    cfg["dattri_note"] = "another model family"
    (other / "model/config.json").write_text(json.dumps(cfg))
    with pytest.raises(StoreMismatchError, match="another model or checkpoint"):
        attribute.main(["--run", str(other), "--store", str(grads), "--out",
                        str(tmp_path / "b"), "--queries", QUERIES, "--query-max-docs", "1",
                        "--truncate"])


def test_damaged_or_foreign_stores_are_refused(run_dir, tmp_path):
    """attribute never falls back or scores part of a store: a deleted info.json of the
    newest checkpoint, a deleted checkpoint store under TracIn, a store without shards, a
    store of another run are errors naming them; collect resuming over a bit-flipped data
    file refuses it instead of reporting 'all stored'."""
    from dattri_ds.errors import StoreCorruptError
    from dattri_ds.tools import attribute

    grads = tmp_path / "g"
    _collect(run_dir, grads, 4)
    q = ["--queries", QUERIES, "--query-max-docs", "1", "--truncate"]

    outs = iter(range(100))

    def attr(store, *extra, run=run_dir):  # tracin: needs no factors (the default method does)
        attribute.main(["--run", str(run), "--store", str(store), "--out",
                        str(tmp_path / f"a{next(outs)}"), *q, "--method", "tracin", *extra])

    def damaged(name, damage):
        dst = tmp_path / name
        shutil.copytree(grads, dst)
        damage(dst)
        return dst

    g = damaged("noinfo", lambda d: (d / "step4/info.json").unlink())
    with pytest.raises(StoreCorruptError, match=r"step4/info\.json' is missing"):
        attr(g)
    g = damaged("nockpt", lambda d: shutil.rmtree(d / "step2"))
    with pytest.raises(StoreCorruptError, match=r"No store for checkpoint 'step2'"):
        attr(g, "--method", "tracin")
    with pytest.raises(StoreCorruptError, match=r"No store for checkpoint 'step4'"):
        attr(damaged("nonewest", lambda d: shutil.rmtree(d / "step4")))
    g = damaged("noshards", lambda d: [p.unlink() for p in (d / "step4").glob("shard-*")])
    with pytest.raises(StoreCorruptError, match=r"step4.*no committed shard"):
        attr(g)
    g = damaged("noindex", lambda d: (d / "step4/shard-00000.index.json").unlink())
    with pytest.raises(StoreCorruptError, match=r"step4.*shard-00000\.index\.json"):
        attr(g)
    assert _collect(run_dir, g, 4) == {"step2": 0, "step4": 4}  # the advice: rerun collect
    attr(g)
    other = tmp_path / "other"  # the same model family, another run (its own run id)
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("checkpoints"))
    (other / "checkpoints").symlink_to(run_dir / "checkpoints")
    traj = json.loads((other / "trajectory.json").read_text())
    traj["run_id"] = "run:another"
    (other / "trajectory.json").write_text(json.dumps(traj))
    with pytest.raises(StoreMismatchError, match=r"run_id: stored .*requested 'run:another'"):
        attr(grads, run=other)
    swapped = tmp_path / "swapped"  # same run id and tags, but step4 holds step2's weights
    shutil.copytree(run_dir, swapped, ignore=shutil.ignore_patterns("step4"))
    shutil.copytree(run_dir / "checkpoints/step2", swapped / "checkpoints/step4")
    with pytest.raises(StoreMismatchError, match=r"step4' does not hold .*weights_hash"):
        attr(grads, run=swapped)
    data = grads / "step2/shard-00000.data"
    buf = bytearray(data.read_bytes())
    buf[len(buf) // 2] ^= 0x10
    data.write_bytes(bytes(buf))
    with pytest.raises(StoreCorruptError, match=r"step2/shard-00000\.data"):
        _collect(run_dir, grads, 4)


def test_target_store_that_differs_fails_at_launch_start(run_dir, tmp_path):
    """launch/train.py with a selection.target_store collected under another projection
    exits 2 before the first step, one line naming selection.projection.dim and both values
    (it failed with a ShapeError at the first scoring step). Breaks if the selector is built
    without comparing the store with its probe."""
    from test_launch import ENV, SMALL, _config

    grads = tmp_path / "g"
    _collect(run_dir, grads, 4)  # --projection-dim 32
    cfg = _config(tmp_path, 2, selection={"enabled": True, "score": "alignment",
                                          "target_store": str(grads / "step4"),
                                          "projection": {"dim": 16}})
    cmd = [sys.executable, str(ROOT / "launch/train.py"), "--deepspeed_config", str(cfg),
           "--out", str(tmp_path / "run"), "--steps", "2", *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("dattri-ds: error")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "projection.dim: stored 32, requested 16" in lines[0]
    assert "selection.projection.dim = 32" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run/checkpoints").exists()
