"""LDS evaluator: Spearman with ties, the sign of the prediction, and the built-in benchmark.

Invariants: ``rankdata`` gives average ranks to ties (as scipy does); ``spearman`` equals
hand-computed values; ``lds`` is ~1 when the actual subset losses are a noisy linear
function ``-(M @ tau)`` of the mask and ~-1 when the scores have the wrong sign; and
``benchmarks/lds.py --quick`` produces a finite LDS for every method and writes its report.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from dattri_ds.errors import ConfigError, ShapeError
from dattri_ds.eval import lds, predicted, rankdata, retrain_losses, spearman, subset_masks

ROOT = Path(__file__).resolve().parents[2]


def test_rankdata_average_ties():
    """Ties share the mean of the ranks they span (scipy.stats.rankdata 'average')."""
    x = torch.tensor([10.0, 20.0, 10.0, 30.0, 20.0, 10.0])
    assert rankdata(x).tolist() == [2.0, 4.5, 2.0, 6.0, 4.5, 2.0]
    cols = torch.tensor([[3.0, 1.0], [1.0, 1.0], [2.0, 5.0]])
    assert rankdata(cols).tolist() == [[3.0, 1.5], [1.0, 1.5], [2.0, 3.0]]


def test_spearman_hand_values():
    """Monotone maps give +-1; hand-computed values with and without ties."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert float(spearman(x, x.exp())) == pytest.approx(1.0)
    assert float(spearman(x, -x ** 3)) == pytest.approx(-1.0)
    # ranks (1,2,3,4,5) vs (2,1,4,3,5): 1 - 6 * sum d^2 / (n (n^2 - 1)) = 1 - 6*4/120 = 0.8
    assert float(spearman(x, torch.tensor([2.0, 1.0, 4.0, 3.0, 5.0]))) == pytest.approx(0.8)
    # ties: y ranks (1.5, 1.5, 3, 4): Pearson with (1, 2, 3, 4) = 4.5 / sqrt(5 * 4.5)
    y = torch.tensor([7.0, 7.0, 8.0, 9.0])
    assert float(spearman(x[:4], y)) == pytest.approx(4.5 / math.sqrt(5 * 4.5))


def test_spearman_columns_and_undefined():
    """Columns are independent; a constant column has no correlation (NaN)."""
    x = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    y = torch.tensor([[3.0, 5.0], [2.0, 5.0], [1.0, 5.0]])
    rho = spearman(x, y)
    assert rho[0].item() == pytest.approx(-1.0) and math.isnan(rho[1].item())
    with pytest.raises(ShapeError):
        spearman(x, y[:2])


def test_subset_masks_sizes_and_seed():
    """Every subset has round(fraction * N) members; the same seed gives the same masks."""
    m = subset_masks(11, 5, 0.5, seed=3)
    assert m.shape == (5, 11) and m.dtype == torch.bool
    assert m.sum(1).tolist() == [6] * 5
    assert torch.equal(m, subset_masks(11, 5, 0.5, seed=3))
    assert not torch.equal(m, subset_masks(11, 5, 0.5, seed=4))
    with pytest.raises(ConfigError):
        subset_masks(10, 5, 1.0)


def _synthetic(n=40, q=6, s=60, noise=0.05, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tau = torch.randn(n, q, generator=gen, dtype=torch.float64)
    masks = subset_masks(n, s, 0.5, seed=seed)
    # Including n lowers q's loss by tau[n, q] (the convention of methods.base).
    actual = 3.0 - masks.double() @ tau + noise * torch.randn(s, q, generator=gen,
                                                             dtype=torch.float64)
    return tau, masks, actual


def test_lds_linear_datamodel_near_one():
    """Scores that are the true per-example effects give LDS ~1 (and the right sign)."""
    tau, masks, actual = _synthetic()
    res = lds(predicted(tau, masks), actual)
    assert res.mean > 0.98 and res.per_query.shape == (6,) and res.std < 0.02
    # Invariant to a per-query positive scale of the scores (e.g. a learning rate).
    assert lds(predicted(tau * torch.tensor([1e-3, 1, 5, 7, 0.1, 2.0]), masks),
               actual).mean == pytest.approx(res.mean)


def test_lds_sign_flip_near_minus_one():
    """Scores with the opposite sign convention give LDS ~-1."""
    tau, masks, actual = _synthetic()
    assert lds(predicted(-tau, masks), actual).mean < -0.98


def test_lds_noise_only_near_zero_and_shapes():
    """Unrelated scores give an LDS near 0; mismatched shapes are refused."""
    tau, masks, actual = _synthetic(s=200)
    other = torch.randn(tau.shape, generator=torch.Generator().manual_seed(9), dtype=tau.dtype)
    assert abs(lds(predicted(other, masks), actual).mean) < 0.2
    with pytest.raises(ShapeError):
        predicted(tau[:-1], masks)
    with pytest.raises(ShapeError):
        lds(actual, actual[:, :2])


def test_retrain_losses_averages_seeds():
    """retrain_losses calls train_fn per (subset, seed) and averages the query losses."""
    masks = subset_masks(6, 3, 0.5, seed=0)
    calls = []

    def train_fn(mask, seed):
        calls.append((mask.clone(), seed))
        m = torch.nn.Linear(1, 1)
        m.value = float(mask.nonzero()[0]) + seed  # "loss" depends on data and seed
        return m

    out = retrain_losses(train_fn, masks, lambda m: torch.tensor([m.value, 2 * m.value]),
                         seeds=(0, 1))
    first = masks.double().argmax(1).double()
    assert out.shape == (3, 2) and len(calls) == 6
    assert torch.allclose(out[:, 0], first + 0.5) and torch.allclose(out[:, 1], 2 * first + 1)


def test_tool_quick_runs(tmp_path):
    """benchmarks/lds.py --quick (tiny settings) gives a finite LDS per method and writes JSON."""
    spec = importlib.util.spec_from_file_location("bench_lds", ROOT / "benchmarks" / "lds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    report = mod.main(["--quick", "--out", str(tmp_path), "--n-train", "32", "--subsets", "4",
                       "--epochs", "2", "--n-hamlet", "3", "--n-code", "1",
                       "--projections", "exact,dense:64,logra:64"])
    saved = json.loads((tmp_path / "lds.json").read_text())
    assert (tmp_path / "lds.md").is_file()
    rows = {(r["method"], r["projection"]): r for r in saved["results"]}
    assert set(rows) == ({(m, k) for m in mod.METHODS for k in ("exact", "dense:64")}
                         | {(m, "logra:64") for m in mod.CURVATURE} | {("tfidf", "exact")})
    assert rows[("graddot", "dense:64")]["bytes_per_row"] < rows[("graddot", "exact")][
        "bytes_per_row"]
    assert sum(r["default"] for r in rows.values()) == 1
    assert any(r["best_at_cost"] for r in rows.values())
    for r in rows.values():
        assert math.isfinite(r["lds_mean"]) and -1 <= r["lds_mean"] <= 1
        assert r["time_s"] >= 0 and len(r["per_query"]) == 4
    assert len(saved["retrained_query_loss"]) == 4 and report["results"] == saved["results"]


def _tool():
    spec = importlib.util.spec_from_file_location("bench_lds", ROOT / "benchmarks" / "lds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_over_seeds_is_mean_and_standard_error(tmp_path):
    """benchmarks/lds.py --repeats: each row's LDS and CPU seconds are the mean and standard error
    over seeds, its share of exact is mean LDS / the same method's mean exact LDS, and the
    best-at-cost mark compares the means. Breaks if seeds are mixed up or s.e. is a std."""
    mod = _tool()

    def rep(seed, exact, proj, t):
        row = {"damping": 0.003, "default": False, "r_vs_exact": None, "bytes_per_row": 8}
        return {"args": {"seed": seed}, "head": "h", "seed_agreement": None, "results": [
            {**row, "method": "ekfac", "projection": "exact", "lds_mean": exact, "time_s": t},
            {**row, "method": "ekfac", "projection": "sparse:4", "lds_mean": proj,
             "time_s": t / 2, "r_vs_exact": 0.9}]}
    out = mod.summarize([rep(0, 0.5, 0.4, 2.0), rep(1, 0.7, 0.6, 4.0)], tmp_path)
    rows = {r["projection"]: r for r in out["results"]}
    assert rows["exact"]["lds_mean"] == pytest.approx(0.6)
    assert rows["exact"]["lds_se"] == pytest.approx(0.1)  # std 0.1414 / sqrt(2)
    assert rows["exact"]["time_s"] == pytest.approx(3.0)
    assert rows["sparse:4"]["pct_exact"] == pytest.approx(0.5 / 0.6)
    assert rows["exact"]["best_at_cost"] and rows["sparse:4"]["best_at_cost"]
    assert out["seeds"] == [0, 1] and (tmp_path / "lds.md").is_file()
    assert "`*` best at its cost" in (tmp_path / "lds.md").read_text()  # the legend


def test_query_sets_and_model_options():
    """--queries heldout takes documents of the pool that are not trained on (all sources);
    --model-config builds that architecture and --tie-embeddings ties its output layer.
    Breaks if a held-out query leaks into the training prefix or the flags are ignored."""
    mod = _tool()
    args = mod.parse_args(["--queries", "heldout", "--n-heldout", "7", "--n-train", "64",
                           "--vocab-size", "128"])
    _, ds, qds = mod.load_data(args)
    assert len(qds) == 7 and not set(qds.ids) & set(ds.ids) and len(ds) == 64
    assert len({d.source for d in qds.docs}) > 1  # in distribution: several of the pool's sources
    target = mod.parse_args(["--n-train", "64", "--vocab-size", "128"])
    assert mod.model_config(target) == mod.MODEL and not mod.MODEL["tie_word_embeddings"]
    llama = mod.parse_args(["--model-config", str(ROOT / "configs/model_llama_tiny.json"),
                            "--tie-embeddings"])
    cfg = mod.model_config(llama)
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert mod._settings(vars(llama)) != mod._settings(vars(target))  # no stale seed reuse
    with pytest.raises(SystemExit):
        mod.parse_args(["--queries", "nope"])


def test_frontier_ignores_ties_within_paired_noise(tmp_path):
    """Over seeds, a row no slower that is higher by less than the paired standard error
    does not push another row off the frontier; one higher by more does. Breaks if the
    best-at-cost mark compares noisy means only."""
    mod = _tool()

    def rep(seed, a, b):
        row = {"damping": 0.003, "default": False, "r_vs_exact": None, "bytes_per_row": 8,
               "projection": "exact"}
        return {"args": {"seed": seed}, "head": "h", "seed_agreement": None, "results": [
            {**row, "method": "ekfac", "lds_mean": a, "time_s": 2.0},
            {**row, "method": "kfac", "lds_mean": b, "time_s": 1.0}]}
    tie = mod.summarize([rep(0, 0.50, 0.52), rep(1, 0.60, 0.59), rep(2, 0.55, 0.56)], tmp_path)
    rows = {r["method"]: r for r in tie["results"]}
    assert rows["kfac"]["lds_mean"] > rows["ekfac"]["lds_mean"]  # higher mean, cheaper ...
    assert rows["ekfac"]["best_at_cost"]  # ... but within its paired s.e.: both on it
    clear = mod.summarize([rep(0, 0.50, 0.56), rep(1, 0.60, 0.65), rep(2, 0.55, 0.61)],
                          tmp_path)
    rows = {r["method"]: r for r in clear["results"]}
    assert rows["kfac"]["best_at_cost"] and not rows["ekfac"]["best_at_cost"]


def test_char_tokenizer_quick(tmp_path):
    """--tokenizer char trains a character vocabulary (the pool's character set plus the 4
    special ids), defaults T to 128, lengthens the model's position table to it, records the
    tokenizer in the report and gives a finite LDS. Breaks if the flag is ignored (a BPE
    vocabulary of 512), the model cannot hold T, or a char seed is reused for a BPE one."""
    mod = _tool()
    report = mod.main(["--quick", "--tokenizer", "char", "--out", str(tmp_path), "--n-train",
                       "16", "--subsets", "3", "--epochs", "1", "--n-hamlet", "2", "--n-code",
                       "1", "--projections", "exact", "--methods", "ekfac,graddot,tfidf"])
    saved = json.loads((tmp_path / "lds.json").read_text())
    regime = saved["regime"]
    assert regime["tokenizer"] == "char" and regime["seq_len"] == 128
    assert 8 < regime["vocab_size"] <= 128 and saved["model"]["n_positions"] == 128
    assert saved["tokenizer"] == regime["tokenizer_fingerprint"]
    assert {r["method"] for r in report["results"]} == {"ekfac", "graddot", "tfidf"}
    assert all(math.isfinite(r["lds_mean"]) for r in report["results"])
    bpe = mod.parse_args(["--quick"])
    assert bpe.tokenizer == "bpe" and bpe.seq_len == 64 and mod.model_config(bpe) == mod.MODEL
    char = vars(mod.parse_args(["--quick", "--tokenizer", "char", "--seq-len", "64"]))
    assert mod._settings(char) != mod._settings(vars(bpe))  # no stale seed reuse
    legacy = {k: v for k, v in vars(bpe).items() if k != "tokenizer"}  # saved before the flag
    assert mod._settings(legacy) == mod._settings(vars(bpe))


def test_ground_truth_reused_when_only_scoring_changes(tmp_path, monkeypatch):
    """A saved seed whose settings differ only in scoring (here --methods) keeps its subset
    masks and retrained losses: the second run never retrains and gives the same LDS for
    the shared methods; a ground-truth setting (--subsets) or --retrain retrains. Breaks if
    adding a method reruns the retraining, or if a seed is reused across ground truths."""
    mod = _tool()
    base = ["--quick", "--out", str(tmp_path), "--n-train", "16", "--subsets", "3",
            "--epochs", "1", "--n-hamlet", "2", "--n-code", "1", "--projections", "exact"]
    first = mod.main(base + ["--methods", "ekfac,tfidf"])
    assert first["ground_truth"] == {"reused_from": None}
    calls = []
    real = mod.retrain_losses
    monkeypatch.setattr(mod, "retrain_losses", lambda *a, **k: calls.append(1) or real(*a, **k))
    second = mod.main(base + ["--methods", "ekfac,graddot,tfidf"])
    assert calls == [] and second["ground_truth"]["reused_from"] == str(tmp_path / "lds.json")
    assert second["ground_truth"]["full_loss_max_diff"] < 1e-5  # the full run is deterministic
    for key in ("masks", "retrained_query_loss", "seed_agreement", "full_model_query_loss",
                "train_ids", "query_ids"):
        assert second[key] == first[key], key
    lds1 = {r["method"]: r["lds_mean"] for r in first["results"]}
    lds2 = {r["method"]: r["lds_mean"] for r in second["results"]}
    assert set(lds2) == {"ekfac", "graddot", "tfidf"}
    assert lds2["ekfac"] == pytest.approx(lds1["ekfac"], abs=1e-6)
    assert lds2["tfidf"] == pytest.approx(lds1["tfidf"], abs=1e-6)
    one = vars(mod.parse_args(base + ["--methods", "ekfac"]))
    other = vars(mod.parse_args(base + ["--methods", "graddot", "--powers", "1"]))
    assert mod._settings(one, mod.TRUTH) == mod._settings(other, mod.TRUTH)
    assert mod._settings(one) != mod._settings(other)
    mod.main(base + ["--methods", "tfidf", "--retrain"])
    assert len(calls) == 1  # --retrain: retrained (one call per training seed; quick: 1)
    calls.clear()
    mod.main(base[:-6] + ["--subsets", "4"] + base[-6:] + ["--methods", "tfidf"])
    assert len(calls) == 1  # another ground truth: retrained


def test_train_data_round_robin_disjoint(tmp_path):
    """--train-data draws N documents round-robin over the file's sources (seeded), never a
    query (same id or same text under another id) nor an --exclude-data document; held-out
    queries come from the same pool; the pool is part of the ground-truth settings. Breaks
    if a query leaks into training, the draw ignores the seed, or a seed of the default pool
    is reused for another pool."""
    mod = _tool()
    tiny = {json.loads(line)["id"] for line in open(ROOT / "data/tiny/train.jsonl")}
    base = ["--train-data", "data/corpus/train.jsonl", "--exclude-data",
            "data/tiny/train.jsonl", "--n-train", "21"]
    args = mod.parse_args(base + ["--queries", "heldout", "--n-heldout", "5"])
    assert args.draw == "round-robin" and args.exclude_data == ["data/tiny/train.jsonl"]
    _, ds, qds = mod.load_data(args)
    assert mod.source_counts(ds.docs) == {s: 3 for s in (
        "austen", "jargon", "kjv", "python_code", "python_docs", "shakespeare", "wordnet")}
    assert not (set(ds.ids) | set(qds.ids)) & tiny and not set(ds.ids) & set(qds.ids)
    assert len({d.text for d in ds.docs} | {d.text for d in qds.docs}) == 26
    _, ds1, _ = mod.load_data(mod.parse_args(base + ["--seed", "1"]))
    assert set(ds1.ids) != set(ds.ids) and mod.source_counts(ds1.docs) == mod.source_counts(
        ds.docs)
    assert mod._settings(vars(args), mod.TRUTH) != mod._settings(
        vars(mod.parse_args(["--queries", "heldout", "--n-heldout", "5", "--n-train", "21"])),
        mod.TRUTH)
    # A pool holding a target query's text under another id: that document is never drawn.
    hamlet = mod.evenly_spaced(mod.load_documents(ROOT / "data/tiny/target.jsonl"), 8)[0]
    pool = tmp_path / "pool.jsonl"
    rows = [{"id": f"d{i}", "source": "ab"[i % 2], "title": "t", "text": f"text number {i}"}
            for i in range(6)] + [{"id": "copy", "source": "a", "title": "t",
                                   "text": hamlet.text}]
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, small, q = mod.load_data(mod.parse_args(["--train-data", str(pool), "--n-train", "6",
                                                "--vocab-size", "40", "--n-code", "0"]))
    assert "copy" not in small.ids and len(small) == 6 and hamlet.id in q.ids
    with pytest.raises(ConfigError):
        mod.load_data(mod.parse_args(["--train-data", str(pool), "--n-train", "7",
                                      "--vocab-size", "40"]))


def test_hybrid_rows_mix_standardized_scores(tmp_path):
    """--hybrid-weights adds 'm+<w>*tfidf' rows scoring z(m) + w z(tfidf) per query from the
    existing score vectors: w = 0 has the method's own LDS (z is a per-query affine map),
    a large w tends to tfidf's ranking, and the weight is recorded. Breaks if the hybrid
    standardizes over queries instead of training rows, or mixes raw scales."""
    mod = _tool()
    s = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 60.0]])
    z = mod.zscore(s)
    assert torch.allclose(z.mean(0), torch.zeros(2), atol=1e-6)
    assert torch.allclose(z.std(0), torch.ones(2))
    assert torch.equal(mod.zscore(torch.ones(3, 1)), torch.zeros(3, 1))
    scores = {("ekfac", "exact", 0.003, 0.8): (s, 1.0),
              ("tfidf", "exact", None, None): (s.flip(0), 0.5)}
    mod.add_hybrids(scores, [0.0, 2.0])
    mixed, seconds = scores[("ekfac+2*tfidf", "exact", 0.003, 0.8)]
    assert seconds == 1.5 and mod.hybrid_weight("ekfac+2*tfidf") == 2.0
    assert torch.allclose(mixed, z + 2 * mod.zscore(s.flip(0)), atol=1e-6)
    assert mod.hybrid_weight("ekfac-trajectory") is None
    with pytest.raises(SystemExit):
        mod.parse_args(["--hybrid-weights", "0.5", "--methods", "ekfac"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--hybrid-weights", "half", "--methods", "ekfac,tfidf"])
    report = mod.main(["--quick", "--out", str(tmp_path), "--n-train", "16", "--subsets", "4",
                       "--epochs", "1", "--n-hamlet", "3", "--n-code", "1", "--projections",
                       "exact", "--methods", "ekfac,tfidf", "--hybrid-weights", "0,1,1000"])
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"ekfac", "tfidf", "ekfac+0*tfidf", "ekfac+1*tfidf",
                         "ekfac+1000*tfidf"}
    assert rows["ekfac+0*tfidf"]["lds_mean"] == pytest.approx(rows["ekfac"]["lds_mean"],
                                                              abs=1e-6)
    assert rows["ekfac+1000*tfidf"]["per_query"] == pytest.approx(rows["tfidf"]["per_query"],
                                                                  abs=1e-3)
    assert rows["ekfac+1*tfidf"]["hybrid_weight"] == 1.0 and rows["ekfac"][
        "hybrid_weight"] is None
    # "(default)" marks what attribute runs: the trajectory with its text prior (0.25)
    report = mod.main(["--quick", "--out", str(tmp_path), "--n-train", "16", "--subsets", "4",
                       "--epochs", "1", "--n-hamlet", "3", "--n-code", "1", "--projections",
                       "exact", "--methods", "ekfac-trajectory,tfidf", "--hybrid-weights",
                       "0.25"])  # ground truth reused: scoring settings only
    assert [r["method"] for r in report["results"] if r["default"]] == [
        "ekfac-trajectory+0.25*tfidf"]


def _attribution(folder: Path, scores, n_queries: int) -> list[str]:
    """An attribute output folder (the files ``dattri-ds report`` and ``lds`` read)."""
    import numpy as np

    folder.mkdir()
    ids = [f"d{n}#0" for n in range(scores.shape[0])]
    queries = [{"id": f"q{j}", "source": "s", "text": "t"} for j in range(n_queries)]
    (folder / "summary.json").write_text(json.dumps(
        {"method": "graddot", "train": len(ids), "queries": n_queries, "checkpoints": ["c"]}))
    (folder / "queries.json").write_text(json.dumps(queries))
    (folder / "topk.json").write_text(json.dumps(
        [{"proponents": [], "opponents": []}] * n_queries))
    (folder / "train_ids.json").write_text(json.dumps(ids))
    np.save(folder / "scores.npy", scores.numpy())
    return ids


def test_lds_command_scores_a_saved_attribution(tmp_path, capsys):
    """``dattri-ds lds``: losses that are exactly ``-(mask @ scores)`` give LDS 1, their
    negation -1, and the per-query values equal ``dattri_ds.eval.lds`` on the same masks.
    Breaks if subsets are matched to the wrong rows (ids before '#') or the sign flips."""
    from dattri_ds.tools import lds as tool

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(8, 3, generator=g, dtype=torch.float64)
    ids = _attribution(tmp_path / "att", scores, 3)
    masks = subset_masks(8, 12, seed=1)
    subsets = [[ids[n].split("#")[0] for n in m.nonzero().flatten().tolist()] for m in masks]
    for sign, want in ((1, 1.0), (-1, -1.0)):
        truth = tmp_path / f"truth{sign}.json"
        truth.write_text(json.dumps({"subsets": subsets, "losses": (
            sign * predicted(scores, masks)).tolist()}))
        out = tool.main(["--attribution", str(tmp_path / "att"), "--ground-truth", str(truth),
                         "--json"])
        assert out["lds_mean"] == pytest.approx(want) and out["subsets"] == 12
        assert json.loads(capsys.readouterr().out)["lds_mean"] == pytest.approx(want)
    noisy = predicted(scores, masks) + torch.randn(12, 3, generator=g, dtype=torch.float64)
    truth.write_text(json.dumps({"subsets": subsets, "losses": noisy.tolist()}))
    out = tool.main(["--attribution", str(tmp_path / "att"), "--ground-truth", str(truth)])
    ref = lds(predicted(scores, masks), noisy)
    assert out["lds_mean"] == pytest.approx(ref.mean)
    assert list(out["per_query"].values()) == pytest.approx(ref.per_query.tolist())


def test_lds_command_refuses_unknown_ids_and_bad_shapes(tmp_path):
    """Subset ids that are not training rows, losses not [S][Q], or a loss that is not a
    finite number (NaN once printed an LDS over the other queries) are one InputFileError
    naming the file, the entry and the fix."""
    from dattri_ds.errors import InputFileError
    from dattri_ds.tools import lds as tool

    _attribution(tmp_path / "att", torch.zeros(4, 2, dtype=torch.float64), 2)
    truth = tmp_path / "t.json"
    for body, words in (({"subsets": [["d0", "nope"]], "losses": [[1.0, 2.0]]}, "not training"),
                        ({"subsets": [["d0"]], "losses": [[1.0]]}, "one list of 2"),
                        ({"losses": [[1.0, 2.0]]}, "'subsets'"),
                        ({"subsets": [["d0"], ["d1"]], "losses": [[1.0, 2.0], [3.0, float("nan")]]},
                         r"losses\[1\]\[1\] is nan, not a finite number"),
                        ({"subsets": [["d0"]], "losses": [[1.0, "2.5"]]},
                         r"losses\[0\]\[1\] is '2.5', not a finite number")):
        truth.write_text(json.dumps(body))
        with pytest.raises(InputFileError, match=words) as err:
            tool.main(["--attribution", str(tmp_path / "att"), "--ground-truth", str(truth)])
        assert str(truth) in str(err.value) and "Fix" in str(err.value)
