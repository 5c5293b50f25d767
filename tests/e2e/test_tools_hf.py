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
    from dattri_ds.tools.common import load_texts
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
        collect.main(["--model", str(tmp_path), "--data", data, "--out", str(tmp_path / "g4")])


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
