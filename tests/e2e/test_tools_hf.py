"""Offline tools on any Hugging Face causal LM folder, and under the real launchers.

Invariants: ``--model`` takes a ``save_pretrained`` folder (tied GPT-2 weights included)
with its own tokenizer or token-id jsonl; a run whose ``checkpoints/`` hold HF folders is
a run; ``seq_len`` comes from the model when no run config exists; missing pieces are
named; ``torchrun`` and ``deepspeed`` launches of collect and fit on 2 processes give the
single-process result.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dattri_ds.errors import ConfigError
from dattri_ds.eval import tfidf_scores, with_text_prior
from _deps import require

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _tiny_folder(path: Path, tokenizer: bool = True) -> Path:
    """A tied GPT-2 (n_positions 24) saved with save_pretrained, plus a word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=24, n_embd=32, n_layer=2,
                                       n_head=4, bos_token_id=2, eos_token_id=3))
    assert model.lm_head.weight is model.transformer.wte.weight
    model.save_pretrained(path)
    if tokenizer:
        tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w1"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="w0", bos_token="w2",
                                eos_token="w3").save_pretrained(path)
    return path


def _texts(path: Path, n: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as fh:
        for i in range(n):
            words = torch.randint(4, 64, (int(torch.randint(5, 12, (1,), generator=g)),),
                                  generator=g)
            fh.write(json.dumps({"id": f"d{i}", "source": "s", "title": "", "text": " ".join(
                f"w{w}" for w in words)}) + "\n")
    return str(path)


def _tokens(path: Path, n: int) -> str:
    g = torch.Generator().manual_seed(1)
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"t{i}",
                                 "input_ids": torch.randint(4, 64, (9,), generator=g).tolist()})
                     + "\n")
    return str(path)


def test_model_folder_collect_attribute(tmp_path):
    """collect/attribute on a save_pretrained folder: tied head restored, seq_len = the
    model's context (24), its own tokenizer; token-id jsonl needs no tokenizer; a text file
    without any tokenizer names what is missing."""
    from dattri_ds.tools import attribute, collect
    from dattri_ds.tools.texts import load_texts
    from dattri_ds.tools.sources import HFModelDir

    folder = _tiny_folder(tmp_path / "gpt2-tiny")
    src = HFModelDir.open(folder)
    model = src.model(src.tag)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert src.seq_len == 24 and load_texts(_texts(tmp_path / "a.jsonl", 3), src.tokenizer,
                                            src.seq_len).seq_len == 24
    data = _texts(tmp_path / "train.jsonl", 6)
    base = ["--model", str(folder), "--projection-dim", "8"]
    assert collect.main([*base, "--data", data, "--out", str(tmp_path / "g")]) == {
        "gpt2-tiny": 6}
    summary = attribute.main(["--model", str(folder), "--store", str(tmp_path / "g"),
                              "--queries", _texts(tmp_path / "q.jsonl", 2, seed=5),
                              "--method", "graddot", "--out", str(tmp_path / "attr")])
    assert summary["train"] == 6 and np.load(tmp_path / "attr/scores.npy").shape == (6, 2)

    bare = _tiny_folder(tmp_path / "bare", tokenizer=False)
    assert collect.main(["--model", str(bare), "--projection-dim", "8", "--data",
                         _tokens(tmp_path / "tok.jsonl", 4), "--out", str(tmp_path / "g2"),
                         "--seq-len", "12"]) == {"bare": 4}
    with pytest.raises(ConfigError, match="holds no tokenizer.*--tokenizer"):
        collect.main(["--model", str(bare), "--data", data, "--out", str(tmp_path / "g3")])
    with pytest.raises(ConfigError, match="not a Hugging Face model folder.*config.json"):
        collect.main(["--model", str(tmp_path / "g"), "--data", data, "--out",
                      str(tmp_path / "g4")])


def test_text_prior_needs_the_training_texts(tmp_path, capsys):
    """Single-checkpoint EK-FAC adds the text prior by default (weight 0.5) when the
    training texts are found (collect's recorded --data); when they are gone the default
    prior is off and the summary says why (the method's own scores, no model_scores.npy),
    an explicit --text-weight is a one-line usage error naming --train-data that writes
    nothing, and --train-data restores it."""
    from dattri_ds.cli.exits import run
    from dattri_ds.tools import attribute, collect, fit

    folder = _tiny_folder(tmp_path / "gpt2-tiny")
    data = _texts(tmp_path / "train.jsonl", 5)
    queries = _texts(tmp_path / "q.jsonl", 2, seed=5)
    collect.main(["--model", str(folder), "--projection-dim", "8", "--data", data, "--out",
                  str(tmp_path / "g")])
    fit.main(["--model", str(folder), "--data", data, "--out", str(tmp_path / "f.pt")])
    base = ["--model", str(folder), "--store", str(tmp_path / "g"), "--queries", queries,
            "--method", "ekfac", "--factors", str(tmp_path / "f.pt")]
    on = attribute.main([*base, "--out", str(tmp_path / "on")])
    assert on["text_weight"] == 0.5 and (tmp_path / "on/model_scores.npy").exists()
    moved = tmp_path / "moved.jsonl"
    Path(data).rename(moved)
    off = attribute.main([*base, "--out", str(tmp_path / "off")])
    assert off["text_weight"] == 0 and off["text_prior"].startswith("off:")
    assert not (tmp_path / "off/model_scores.npy").exists()
    np.testing.assert_allclose(np.load(tmp_path / "off/scores.npy"),
                               np.load(tmp_path / "on/model_scores.npy"), rtol=1e-6)
    capsys.readouterr()
    code = run(attribute.main, [*base, "--text-weight", "0.5", "--out", str(tmp_path / "no")])
    err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert code == 2 and len(err) == 1 and "--train-data" in err[0], err
    assert not (tmp_path / "no/scores.npy").exists()
    again = attribute.main([*base, "--train-data", str(moved), "--out", str(tmp_path / "again")])
    assert again["text_weight"] == 0.5
    np.testing.assert_allclose(np.load(tmp_path / "again/scores.npy"),
                               np.load(tmp_path / "on/scores.npy"), rtol=1e-6)


def _hf_run(tmp_path: Path) -> Path:
    """A run dir: model/config.json, HF tokenizer, checkpoints/step1 as save_pretrained."""
    run = tmp_path / "run"
    _tiny_folder(run / "checkpoints/step1")
    (run / "model").mkdir(parents=True)
    (run / "model/config.json").write_text((run / "checkpoints/step1/config.json").read_text())
    for f in (run / "checkpoints/step1").iterdir():
        if f.name.startswith(("tokenizer", "special")):
            (run / f.name).write_bytes(f.read_bytes())
    (run / "trajectory.json").write_text(json.dumps(
        {"checkpoints": [{"tag": "step1", "step": 1, "lr": 1.0}]}))
    (run / "resolved_dattri_ds_config.json").write_text(json.dumps({"train": {"seq_len": 16}}))
    return run


def _start(cmd: list[str]) -> subprocess.Popen:
    from test_launch import ENV

    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def test_torchrun_and_deepspeed_launch_collect_and_fit(tmp_path):
    """`torchrun ... collect.py --run-dir` and `deepspeed ... fit.py` (which appends
    --local_rank) run on 2 processes and equal the single-process store and factors."""
    require("deepspeed", "deepspeed")
    from dattri_ds.store import GradientStore
    from dattri_ds.tools import collect, fit

    run = _hf_run(tmp_path)
    data = _texts(tmp_path / "train.jsonl", 6)
    common = ["--data", data, "--projection-dim", "8", "--batch-size", "2"]
    model = str(run / "checkpoints/step1")
    launched = [  # both launchers at once: they spend most of their time importing
        _start([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                str(ROOT / "tools/collect.py"), "--run-dir", str(run), *common, "--out",
                str(tmp_path / "g2")]),
        _start([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", "29533",
                str(ROOT / "tools/fit.py"), "--model", model, *common, "--out",
                str(tmp_path / "f2.pt")])]
    collect.main(["--run-dir", str(run), *common, "--out", str(tmp_path / "g1")])
    fit.main(["--model", model, *common, "--out", str(tmp_path / "f1.pt")])
    for proc in launched:
        _wait(proc)
    with GradientStore.open(tmp_path / "g1/step1") as one, \
            GradientStore.open(tmp_path / "g2/step1") as two:
        assert sorted(one.ids) == sorted(two.ids) and len(one.ids) == 6
        a = {i: r for b in one.iter_batches(8) for i, r in zip(b.sample_ids, _rows(b))}
        b = {i: r for bb in two.iter_batches(8) for i, r in zip(bb.sample_ids, _rows(bb))}
        for i in a:
            assert torch.allclose(a[i], b[i], rtol=1e-5, atol=1e-5)
    f1, f2 = (torch.load(tmp_path / f, weights_only=False) for f in ("f1.pt", "f2.pt"))
    _assert_nested_close(f1, f2)


def _rows(batch) -> list[torch.Tensor]:
    return list(torch.cat([lg.data.values for lg in batch.layers.values()], 1))


def _assert_nested_close(x, y, path="factors"):
    if isinstance(x, dict) and any(k.startswith("q") and "l" + k[1:] in x for k in x):
        _assert_eigenbasis_close(x, y, path)
    elif torch.is_tensor(x):
        assert torch.allclose(x.double(), y.double(), rtol=1e-4, atol=1e-6), path
    elif isinstance(x, dict):
        assert set(x) == set(y), path
        for k in x:
            _assert_nested_close(x[k], y[k], f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            _assert_nested_close(a, b, f"{path}[{i}]")
    else:
        assert x == y, path


def _assert_eigenbasis_close(x, y, path):
    """An eigendecomposition ``{"l<s>": values, "q<s>": vectors}``: equal values and equal
    ``Q diag(l) Q^T`` (eigenvectors of a repeated eigenvalue, e.g. the null space of a
    rank-deficient Fisher block, are any basis of their space)."""
    assert set(x) == set(y), path
    for k in x:
        if not (k.startswith("q") and "l" + k[1:] in x):
            _assert_nested_close(x[k], y[k], f"{path}.{k}")
            continue
        lk = "l" + k[1:]
        rx, ry = ((d[k].double() * d[lk].double()) @ d[k].double().T for d in (x, y))
        assert torch.allclose(rx, ry, rtol=1e-4, atol=1e-6 * float(rx.abs().max())), \
            f"{path}.{k}"


def test_attribute_per_token_and_report_colours(tmp_path):
    """attribute --per-token writes [N, Q, T] scores that sum over T to scores.npy, and the
    HTML report colours every query token."""
    from dattri_ds.tools import attribute, collect, report

    folder = _tiny_folder(tmp_path / "gpt2-tiny")
    data = _texts(tmp_path / "train.jsonl", 5)
    collect.main(["--model", str(folder), "--projection-dim", "8", "--data", data, "--out",
                  str(tmp_path / "g")])
    attribute.main(["--model", str(folder), "--store", str(tmp_path / "g"), "--queries",
                    _texts(tmp_path / "q.jsonl", 2, seed=7), "--per-token", "--method",
                    "gradcos", "--out", str(tmp_path / "attr")])
    scores = np.load(tmp_path / "attr/scores.npy")
    per_token = np.load(tmp_path / "attr/per_token.npy")
    assert per_token.shape == (5, 2, 24)
    tokens = json.loads((tmp_path / "attr/query_tokens.json").read_text())
    html_text = (report.main(["--attribution", str(tmp_path / "attr")]).parent
                 / "report.html").read_text()
    assert html_text.count("<span title=") == sum(len(t) for t in tokens)
    assert per_token.any() and np.isfinite(per_token).all() and scores.shape == (5, 2)


# ---- a list of Hugging Face checkpoint folders (--checkpoints DIR [DIR ...]) ----------------

#: step -> learning rate the fixture's trainer_state.json logs (a linear decay).
def _lr(step: int) -> float:
    return 1e-3 * (1 - step / 40)


def _trainer_checkpoints(root: Path) -> Path:
    """``root/checkpoint-<step>`` for steps 20, 5, 10 (created out of step order) as the
    Hugging Face Trainer writes them: distinct weights of one tiny GPT-2, its tokenizer, and
    ``trainer_state.json`` with ``global_step`` and ``log_history`` learning rates every 5
    steps."""
    from transformers import GPT2LMHeadModel

    for i, step in enumerate((20, 5, 10)):
        folder = _tiny_folder(root / f"checkpoint-{step}")
        model = GPT2LMHeadModel.from_pretrained(folder)
        g = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        model.save_pretrained(folder)
        log = [{"step": s, "learning_rate": _lr(s), "loss": 1.0} for s in range(5, step + 1, 5)]
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step,
                                                               "log_history": log}))
    return root


def _library(folders: list[Path], data: str, queries: str):
    """The library call on the same checkpoints (no tool code but tokenization): exact rows
    by ``dattri_ds.collect``, EK-FAC factors by ``fit_factors``, TracIn and the EK-FAC
    trajectory by ``make_attributor(...).trajectory_scores``."""
    from transformers import AutoModelForCausalLM

    import dattri_ds
    from dattri_ds import CaptureConfig, Checkpoint, GradBatch, fit_factors, make_attributor
    from dattri_ds.tools.texts import load_texts
    from dattri_ds.tools.sources import HFTokenizer

    tok = HFTokenizer(folders[0])
    train, query = load_texts(data, tok, 24), load_texts(queries, tok, 24, context=24)
    cks, factors = [], []
    for f in folders:
        model = AutoModelForCausalLM.from_pretrained(str(f), dtype=torch.float32).eval()
        rows = {}
        for name, d in (("train", train), ("query", query)):
            batch = d.batch(torch.arange(len(d)))
            rows[name] = GradBatch.cat(list(dattri_ds.collect(
                model, [batch], CaptureConfig(), user_ids=[[doc.id for doc in d.docs]])))
        factors.append(fit_factors([rows["train"]]))
        step = int(f.name.split("-")[1])
        cks.append(Checkpoint([rows["train"]], rows["query"], _lr(step)))
    tracin = make_attributor("tracin").trajectory_scores(cks)
    ekfac = make_attributor("ekfac-trajectory").trajectory_scores(
        [ck._replace(factors=f) for ck, f in zip(cks, factors)])
    return factors, tracin, ekfac


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def _row_text(tok, path: str, doc_id: str, seq_len: int = 24) -> str:
    """The text a document's row holds: its first seq_len tokens (with BOS/EOS as the
    tools tokenize them), decoded; written independently of the tools' code."""
    doc = next(json.loads(x) for x in Path(path).read_text().splitlines()
               if json.loads(x)["id"] == doc_id)
    ids = tok(doc["text"])["input_ids"]
    ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids + \
        ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    return tok.decode(ids[:seq_len])


def _in_order(scores, ids: list[str]) -> np.ndarray:
    order = [list(scores.train_ids).index(i) for i in ids]
    return scores.values.double().numpy()[order]


def test_checkpoint_folders_equal_the_library_call_and_the_run_folder(tmp_path):
    """``--checkpoints 'DIR/checkpoint-*'`` (a glob, expanded by the tool): steps and
    learning rates read from each trainer_state.json, checkpoints ordered by step (5, 10,
    20, not the glob's text order); fit writes the factors ``fit_factors`` gives on each
    folder, attribute's TracIn (lr-weighted) and EK-FAC trajectory equal the library call
    on the same checkpoints, and a hand-built run folder of the documented layout
    (model/config.json, checkpoints/<tag> links, trajectory.json) gives the same scores.
    ``dattri-ds curate`` reads the list with the same learning rates. Without learning
    rates (no trainer_state.json, --steps given) TracIn refuses to run,
    naming --lrs, while the normalized EK-FAC trajectory needs none. Breaks if a learning
    rate is misread, the checkpoints are misordered, or a folder is skipped."""
    from dattri_ds.cli.exits import run
    from dattri_ds.tools import attribute, collect, fit

    root = _trainer_checkpoints(tmp_path / "out")
    glob_ = str(root / "checkpoint-*")
    tags = ["checkpoint-5", "checkpoint-10", "checkpoint-20"]
    data, queries = _texts(tmp_path / "train.jsonl", 6), _texts(tmp_path / "q.jsonl", 2, seed=5)
    src = ["--checkpoints", glob_]
    assert collect.main([*src, "--data", data, "--projection-dim", str(1 << 22), "--out",
                         str(tmp_path / "g")]) == {t: 6 for t in tags}
    written = fit.main([*src, "--data", data, "--out", str(tmp_path / "factors")])
    assert [p.name for p in written] == [f"{t}.pt" for t in tags]
    factors, tracin, ekfac = _library([root / t for t in tags], data, queries)
    for f, path in zip(factors, written):
        f.save(tmp_path / "lib.pt")
        _assert_nested_close(torch.load(tmp_path / "lib.pt", weights_only=False),
                             torch.load(path, weights_only=False))
    base = ["--store", str(tmp_path / "g"), "--queries", queries]
    got = {}
    for method, want in (("tracin", tracin), ("ekfac-trajectory", ekfac)):
        out = tmp_path / method
        summary = attribute.main([*src, *base, "--method", method, "--factors",
                                  str(tmp_path / "factors"), "--out", str(out)])
        assert summary["checkpoints"] == tags
        got[method] = np.load(out / "scores.npy")
        ids = json.loads((out / "train_ids.json").read_text())
        own = np.load(out / "model_scores.npy") if method != "tracin" else got[method]
        np.testing.assert_allclose(own, _in_order(want, ids), rtol=1e-4,
                                   atol=1e-6 * float(abs(own).max()))
    # the EK-FAC trajectory's default adds the text prior (weight 0.25) to its own scores:
    # the TF-IDF overlap of the texts each row and query holds (tokenized as collect did)
    assert summary["text_weight"] == 0.25 and "TF-IDF" in summary["text_prior"]
    tok = _tokenizer(root / tags[0])
    overlap = tfidf_scores([_row_text(tok, data, i.split("#")[0]) for i in ids],
                           [_row_text(tok, queries, q) for q in ("d0", "d1")])
    np.testing.assert_allclose(np.load(out / "text_overlap.npy"), overlap.numpy(), atol=1e-9)
    want = with_text_prior(torch.from_numpy(own), overlap.float(), 0.25).numpy()
    np.testing.assert_allclose(got["ekfac-trajectory"], want, rtol=1e-5, atol=1e-7)

    run_dir = tmp_path / "run"  # the same checkpoints as a hand-built run folder
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "model").mkdir()
    (run_dir / "model/config.json").write_bytes((root / tags[0] / "config.json").read_bytes())
    for t in tags:
        (run_dir / "checkpoints" / t).symlink_to(root / t)
    for f in (root / tags[0]).iterdir():
        if f.name.startswith(("tokenizer", "special")):
            (run_dir / f.name).write_bytes(f.read_bytes())
    (run_dir / "trajectory.json").write_text(json.dumps({"checkpoints": [
        {"tag": t, "step": int(t.split("-")[1]), "lr": _lr(int(t.split("-")[1]))}
        for t in tags]}))
    (run_dir / "resolved_dattri_ds_config.json").write_text(json.dumps({"train": {"seq_len":
                                                                                  24}}))
    collect.main(["--run-dir", str(run_dir), "--data", data, "--projection-dim", str(1 << 22),
                  "--out", str(tmp_path / "g-run")])
    attribute.main(["--run-dir", str(run_dir), "--store", str(tmp_path / "g-run"), "--queries",
                    queries, "--method", "tracin", "--out", str(tmp_path / "tracin-run")])
    np.testing.assert_allclose(np.load(tmp_path / "tracin-run/scores.npy"), got["tracin"],
                               rtol=1e-5, atol=1e-7 * float(abs(got["tracin"]).max()))

    from dattri_ds.tools import curate  # dattri-ds curate reads the same list
    curate.main([*src, "--store", str(tmp_path / "g"), "--pool", data, "--target", queries,
                 "--method", "trajectory", "--fraction", "0.5", "--out", str(tmp_path / "sel")])
    chosen = json.loads((tmp_path / "sel/config.json").read_text())
    assert chosen["checkpoints"] == tags
    assert chosen["lr_weights"] == {t: _lr(int(t.split("-")[1])) for t in tags}

    for t in tags:  # no trainer_state.json: steps by flag, no learning rate known
        (root / t / "trainer_state.json").unlink()
    src = ["--checkpoints", *(str(root / t) for t in reversed(tags)), "--steps", "20", "10", "5"]
    code = run(attribute.main, [*src, *base, "--method", "tracin", "--out",
                                str(tmp_path / "no-lr")])
    assert code == 2 and not (tmp_path / "no-lr/scores.npy").exists()
    attribute.main([*src, *base, "--factors", str(tmp_path / "factors"), "--out",
                    str(tmp_path / "no-lr-ekfac")])
    np.testing.assert_allclose(np.load(tmp_path / "no-lr-ekfac/scores.npy"),
                               got["ekfac-trajectory"], rtol=1e-6)
    lrs = [str(_lr(s)) for s in (20, 10, 5)]
    attribute.main([*src, "--lrs", *lrs, *base, "--method", "tracin", "--out",
                    str(tmp_path / "lrs")])
    np.testing.assert_allclose(np.load(tmp_path / "lrs/scores.npy"), got["tracin"], rtol=1e-6)


def test_source_errors_name_the_flag_that_fixes_them(tmp_path, capsys):
    """Each wrong source is one ``dattri-ds: error:`` line, exit 2, naming the flag that
    reads it, and writes nothing: a folder of checkpoint folders given to --run-dir or
    --model (-> --checkpoints), a run folder given to --model (-> --run-dir, which then
    reads it), a run folder without resolved_dattri_ds_config.json (-> --seq-len),
    --steps of another length than the folders, a folder without trainer_state.json
    (-> --steps), folders given with --run-dir (-> --checkpoints without it). The two
    folder errors never send the user to the flag that just refused the folder, and the
    flags they name then read the folder."""
    from dattri_ds.cli.exits import run
    from dattri_ds.tools import fit

    root = _trainer_checkpoints(tmp_path / "out")
    data = _texts(tmp_path / "train.jsonl", 3)
    hand = _hf_run(tmp_path)
    (hand / "resolved_dattri_ds_config.json").unlink()
    bare = _tiny_folder(tmp_path / "bare")
    ck5 = str(root / "checkpoint-5")
    cases = [
        (["--run-dir", str(root)], "--checkpoints", "--model"),
        (["--model", str(root)], "--checkpoints", "--run-dir"),
        (["--model", str(hand)], "--run-dir", "--checkpoints"),
        (["--run-dir", str(hand)], "--seq-len", "--model"),
        (["--checkpoints", ck5, str(root / "checkpoint-10"), "--steps", "5"], "--steps", None),
        (["--checkpoints", str(bare)], "--steps", None),
        (["--run-dir", str(hand), "--checkpoints", ck5], "--checkpoints", None),
    ]
    capsys.readouterr()  # the fixtures' progress bars
    for argv, flag, not_fix in cases:
        out = tmp_path / "f"
        code = run(fit.main, [*argv, "--data", data, "--out", str(out)])
        lines = capsys.readouterr().err.splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("dattri-ds: error: "), \
            (argv, lines)
        fix = lines[0].split("Fix:")[-1]
        assert flag in fix, (argv, lines[0])
        assert not_fix is None or not_fix not in fix, (argv, lines[0])
        assert not out.exists(), argv
    # what the errors name works: one model folder under --run-dir, the folders under
    # --checkpoints (steps by flag), a run folder under --run-dir with --seq-len
    for argv in (["--run-dir", str(bare)], ["--checkpoints", str(bare), "--steps", "7"],
                 ["--run-dir", str(hand), "--seq-len", "12"]):
        out = tmp_path / "ok.pt"
        assert run(fit.main, [*argv, "--data", data, "--kfac-only", "--out", str(out),
                              "--force"]) == 0, (argv, capsys.readouterr().err[-2000:])
        assert out.is_file()


def _main_job_model(path: Path) -> Path:
    """The main job's model (configs/model_gpt2_tiny.json, the run's 1024-token vocabulary:
    1.09M parameters), random init, saved with save_pretrained."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = json.loads((ROOT / "configs/model_gpt2_tiny.json").read_text())
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**cfg, vocab_size=1024, bos_token_id=0, eos_token_id=0)
                    ).save_pretrained(path)
    return path


def _token_file(path: Path, n: int, length: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"d{i}", "input_ids": torch.randint(
                0, 1024, (length,), generator=g).tolist()}) + "\n")
    return str(path)


_PEAK = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(r.stderr)
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def _peak(cmd: list[str]) -> tuple[int, int, str]:
    """``(exit code, peak RSS bytes, stderr)`` of ``cmd`` run in its own process."""
    r = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True,
                       cwd=ROOT, timeout=1200)
    code, peak = r.stdout.split()[-2:]
    return int(code), int(peak), r.stderr


def test_per_token_256_tokens_on_the_main_job_model_within_the_planned_memory(tmp_path):
    """``attribute --per-token`` (default method, EK-FAC on whitened rows) of one 256-token
    query on the main job's model streams its 255 token rows in chunks sized to
    --token-memory-gb (default 1 GB): peak RSS stays under 2 GB (measured 1.43 GB at
    0eb5305+: 13 chunks of 21 rows; one chunk of all 255 rows grew past 5 GB before,
    about 22 MB a row), a progress line per 10 s, and a --token-chunk above the budget is
    refused at start in one line naming the flag. Breaks if the token rows are held all
    at once or the plan under-predicts a chunk."""
    model = _main_job_model(tmp_path / "model")
    train = _token_file(tmp_path / "train.jsonl", 32, 256, 0)
    queries = _token_file(tmp_path / "q.jsonl", 1, 256, 1)
    tool = [sys.executable, "-m", "dattri_ds.tools."]
    src = ["--model", str(model)]
    for name, extra in (("fit", ["--out", str(tmp_path / "f.pt")]),
                        ("collect", ["--out", str(tmp_path / "w"), "--factors",
                                     str(tmp_path / "f.pt")])):
        subprocess.run([tool[0], tool[1], tool[2] + name, *src, "--data", train, *extra],
                       check=True, cwd=ROOT, capture_output=True, timeout=600)
    attr = [tool[0], tool[1], tool[2] + "attribute", *src, "--store", str(tmp_path / "w"),
            "--queries", queries, "--factors", str(tmp_path / "f.pt"), "--per-token"]
    code, peak, err = _peak([*attr, "--out", str(tmp_path / "a")])
    assert code == 0, err[-2000:]
    assert peak < 2 * 1024**3, f"peak RSS {peak / 2**30:.2f} GB"
    assert "per-token: 255 token rows of 1 queries in" in err and "[phase] per-token" in err
    assert np.load(tmp_path / "a/per_token.npy").shape == (32, 1, 256)
    r = subprocess.run([*attr, "--token-chunk", "255", "--out", str(tmp_path / "b")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stderr.strip().splitlines() if "error" in ln.lower()]
    assert r.returncode == 2 and len(lines) == 1 and "--token-chunk 255" in lines[0] and \
        "lower --token-chunk to at most" in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "b/per_token.npy").exists()


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupted_collect_commits_its_rows_and_the_rerun_counts_them(tmp_path, sig):
    """Ctrl-C (or SIGTERM) during collect, before the first --flush-every commit: the
    buffered rows are committed, one line "interrupted: N rows committed ..." and exit 130,
    no traceback; the rerun says "N examples already stored" (a first run says "0 already
    stored") and stores only the rest. Breaks if an interrupted collect keeps nothing."""
    import re
    import signal
    import time

    folder = _tiny_folder(tmp_path / "m")
    data = _tokens(tmp_path / "d.jsonl", 30000)  # ~100 s to collect: stopped long before
    cmd = [sys.executable, "-m", "dattri_ds.tools.collect", "--model", str(folder), "--data",
           data, "--out", str(tmp_path / "s"), "--flush-every", "100000", "--batch-size", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # the first progress line: rows are buffered, none committed
        seen.append(line)
        if "[phase] collect" in line:
            break
    time.sleep(0.5)
    proc.send_signal(getattr(signal, sig))
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    err = "".join(seen) + rest
    assert proc.returncode == 130, err[-2000:]
    assert "0 examples already stored" in err and "Traceback" not in err, err[-2000:]
    got = re.findall(r"^interrupted: (\d+) rows committed in .*rerun the same command to "
                     r"resume$", err, re.M)
    assert len(got) == 1 and int(got[0]) > 0, err[-2000:]
    again = subprocess.run([*cmd[:-4], "--max-docs", "1"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and f"{got[0]} examples already stored" in again.stderr, \
        again.stderr[-2000:]


def test_text_prior_on_token_id_rows_that_carry_text_and_minimal_query_files(tmp_path):
    """Token-id training and query rows that also carry ``text`` switch the text prior on
    (the overlap of those texts: equal to the prior computed by hand from them); a query
    file of only {"id", "text"} lines is read (no source/title needed), and token-id
    queries without text turn the default prior off saying that the rows lack 'text'.
    Breaks if token ids alone decide that there are no texts."""
    from dattri_ds.eval import tfidf_scores, with_text_prior
    from dattri_ds.tools import attribute, collect, fit

    folder = _tiny_folder(tmp_path / "m")
    g = torch.Generator().manual_seed(2)

    def rows(path, n, text=True):
        out = []
        with open(path, "w") as fh:
            for i in range(n):
                ids = torch.randint(4, 64, (9,), generator=g).tolist()
                out.append(" ".join(f"w{t}" for t in ids))
                rec = {"id": f"{path.stem}{i}", "input_ids": ids}
                fh.write(json.dumps({**rec, "text": out[-1]} if text else rec) + "\n")
        return str(path), out

    train, train_texts = rows(tmp_path / "t.jsonl", 6)
    queries, query_texts = rows(tmp_path / "q.jsonl", 2)
    collect.main(["--model", str(folder), "--projection-dim", "8", "--data", train, "--out",
                  str(tmp_path / "g")])
    fit.main(["--model", str(folder), "--data", train, "--out", str(tmp_path / "f.pt")])
    base = ["--model", str(folder), "--store", str(tmp_path / "g"), "--method", "ekfac",
            "--factors", str(tmp_path / "f.pt"), "--train-data", train]
    on = attribute.main([*base, "--queries", queries, "--out", str(tmp_path / "on")])
    assert on["text_weight"] == 0.5, on["text_prior"]
    ids = json.loads((tmp_path / "on/train_ids.json").read_text())
    by_id = dict(zip([f"t{i}" for i in range(6)], train_texts))
    overlap = tfidf_scores([by_id[i.split("#")[0]] for i in ids], query_texts)
    want = with_text_prior(torch.from_numpy(np.load(tmp_path / "on/model_scores.npy")),
                           overlap.float(), 0.5)
    np.testing.assert_allclose(np.load(tmp_path / "on/scores.npy"), want.numpy(), rtol=1e-5,
                               atol=1e-6)
    minimal = tmp_path / "mq.jsonl"
    minimal.write_text("".join(json.dumps({"id": f"m{i}", "text": t}) + "\n"
                               for i, t in enumerate(query_texts)))
    text_q = attribute.main([*base, "--queries", str(minimal), "--out", str(tmp_path / "mq")])
    assert text_q["queries"] == 2 and text_q["text_weight"] == 0.5
    bare, _ = rows(tmp_path / "b.jsonl", 2, text=False)
    off = attribute.main([*base, "--queries", bare, "--out", str(tmp_path / "off")])
    assert off["text_weight"] == 0 and "without a 'text' field" in off["text_prior"]


def test_a_model_folder_has_no_invented_learning_rate(tmp_path, monkeypatch):
    """A single model folder records no step or learning rate: its trajectory says None
    (not lr 1.0 at step 0), TracIn (lr-weighted) refuses in one error naming --lrs and
    --weighting, and --weighting uniform scores, loading the model once (the start-up
    check's model is reused: a ZeRO-3 checkpoint is consolidated once); report without
    --train-data finds the texts collect recorded. Breaks if a stand-in lr comes back."""
    from dattri_ds.errors import ConfigError
    from dattri_ds.tools import attribute, collect
    from dattri_ds.tools.sources import HFModelDir

    folder = _tiny_folder(tmp_path / "m")
    assert HFModelDir.open(folder).trajectory() == [{"tag": "m", "step": None, "lr": None}]
    data = _texts(tmp_path / "t.jsonl", 4)
    collect.main(["--model", str(folder), "--projection-dim", "8", "--data", data, "--out",
                  str(tmp_path / "g")])
    base = ["--model", str(folder), "--store", str(tmp_path / "g"), "--queries", data,
            "--method", "tracin"]
    with pytest.raises(ConfigError, match=r"learning rate .* unknown.*--lrs.*--weighting"):
        attribute.main([*base, "--out", str(tmp_path / "a")])
    loads = []
    original = HFModelDir.model
    monkeypatch.setattr(HFModelDir, "model",
                        lambda self, tag, *a: loads.append(tag) or original(self, tag, *a))
    assert attribute.main([*base, "--weighting", "uniform", "--out", str(tmp_path / "b")])[
        "train"] == 4
    assert loads == ["m"]
    from dattri_ds.tools import report  # finds the texts collect recorded (no --train-data)

    md = report.main(["--attribution", str(tmp_path / "b")]).read_text()
    first = json.loads(Path(data).read_text().splitlines()[0])
    assert " ".join(first["text"].split())[:40] in md and "(not in --train-data)" not in md


def test_factors_of_another_width_are_refused_naming_the_file_and_the_fix(tmp_path, capsys):
    r"""Factors fitted on a model of another width: attribute and collect --factors exit 2
    with one line naming the factors file, a differing layer with both shapes and the fit
    command that fixes it (it was a ShapeError naming neither). Breaks if the factors are
    used before their layers are compared with the model's."""
    import re

    from transformers import GPT2Config, GPT2LMHeadModel

    from dattri_ds.cli.exits import run
    from dattri_ds.tools import attribute, collect, fit

    small = _tiny_folder(tmp_path / "small")
    wide = tmp_path / "wide"
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=24, n_embd=48, n_layer=2, n_head=4,
                               bos_token_id=2, eos_token_id=3)).save_pretrained(wide)
    data = _tokens(tmp_path / "t.jsonl", 4)
    fit.main(["--model", str(small), "--data", data, "--out", str(tmp_path / "f.pt")])
    collect.main(["--model", str(wide), "--projection-dim", "8", "--data", data, "--out",
                  str(tmp_path / "g")])
    capsys.readouterr()
    for main, extra in ((attribute.main, ["--store", str(tmp_path / "g"), "--queries", data,
                                          "--method", "ekfac"]),
                        (collect.main, ["--data", data])):
        code = run(main, ["--model", str(wide), *extra, "--factors", str(tmp_path / "f.pt"),
                          "--out", str(tmp_path / "o")])
        err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
        assert code == 2 and len(err) == 1, err
        assert f"--factors {tmp_path / 'f.pt'} were fitted on another model" in err[0]
        assert re.search(r"layer .* is \(\d+, \d+\) there and \(\d+, \d+\) in --model",
                         err[0]), err
        assert "tools/fit.py --model" in err[0]
