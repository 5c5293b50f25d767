"""Fuzz every door through which the system reads a file: each damaged input is one clear line.

Doors (what a user hands the system, and the code path that reads it):

* ``collect-data``: ``dattri-ds collect --model DIR --data FILE`` (text or token-id jsonl), run
  in-process through the CLI's error path;
* ``queries``: ``load_texts`` as ``attribute --queries`` calls it (context-checked);
* ``target-data``: launch/train.py's target documents (``selection.target_data``);
* ``report-*``: ``dattri-ds report --attribution DIR`` with one damaged file in DIR (summary,
  scores, train data) or a missing/empty folder;
* ``factors``: ``KFACFactors.load`` (``attribute --factors``);
* ``hf-model``: ``dattri-ds collect --model DIR`` with a damaged Hugging Face folder;
* ``model-path``: launch's ``train.model_path``, checked at start (``check_inputs``);
* ``run-config`` / ``model-config``: launch's DeepSpeed JSON and a ``configs/model_*.json``;
* ``plan-model``: ``dattri-ds plan --model FILE``;
* ``tokenizer``: a run's SentencePiece ``tokenizer.model``;
* ``run-*``: ``dattri-ds collect --run DIR`` with the run folder, its ``trajectory.json``,
  ``resolved_dattri_ds_config.json`` or ``tokenizer.model`` damaged;
* ``resume`` / ``init-checkpoint``: launch's ``--resume latest`` and ``--init-from RUN
  --init-checkpoint latest`` with a file of the checkpoint cut or damaged (DeepSpeed's
  ``mp_rank_*`` model states and ``*_optim_states.pt``, ``training_state.pt``, the loop's
  state, the weights);
* ``deepspeed-keys``: launch's DeepSpeed JSON with one key DeepSpeed asserts on (batch
  keys, ZeRO keys, fp16/bf16, gradient clipping, optimizer and scheduler params);
* ``train-data``: launch's ``--train-data`` (checked at start, then prepared into the run);
* ``data-path-idx`` / ``-bin`` / ``-manifest``: launch's ``--data-path PREFIX`` with one
  file of the prepared corpus damaged (an ``.idx`` without its ``.bin`` included);
* ``collect-run-checkpoint`` / ``curate-adam``: ``dattri-ds collect --run RUN`` and
  ``dattri-ds curate --run RUN --method adam-cosine`` on a real DeepSpeed ZeRO-2 run whose
  ``mp_rank_00_model_states.pt`` or optimizer state is cut, emptied or garbage;
* ``hf-tokenizer``: ``dattri-ds collect --model DIR`` with the folder's tokenizer damaged
  (``tokenizer.json`` cut, ``tokenizer_config.json`` not JSON, a vocabulary file missing, a
  SentencePiece ``tokenizer.model`` missing, cut between two pieces or garbage).

Cases: garbage bytes, a truncated file, latin-1 bytes, a UTF-8 BOM (accepted: the run goes on),
CSV, an empty file, a directory, a symlink loop, a dangling symlink, a line over the line cap,
token ids out of range / negative, an unknown ``model_type``, a missing file or folder; a
``model.safetensors`` cut after its header, with its header broken or its offsets wrong; a
checkpoint file cut, emptied or garbage; a DeepSpeed key DeepSpeed asserts on; a SentencePiece
model cut between two pieces (which sentencepiece loads as a smaller vocabulary); query rows
with an empty text or without an id.

Invariant: with the debug switch off, every case exits 2 (or 1) with exactly one
``dattri-ds: error:`` line that names the file, and the line holds no exception class name
from outside dattri_ds (``JSONDecodeError``, ``UnicodeDecodeError``, ...); nothing has been
written to the command's ``--out`` by then. BOM cases exit 0.

``python tests/unit/test_file_door_fuzz.py`` prints the count: cases, clear, raw, unclear
(one line, but the file is not named), silent (exit 0 on a broken input).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _deps import require  # noqa: E402

require("transformers", "hf")
require("tokenizers", "hf")

import dattri_ds.errors as dd_errors  # noqa: E402
from dattri_ds.cli.exits import DEBUG_ENV, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "data/tiny/train.jsonl")
MARK = b"w9"            # a word of the tiny tokenizer's vocabulary, inside a JSON string
LATIN1 = b"caf\xe9"     # latin-1 bytes where UTF-8 is expected
BOM = b"\xef\xbb\xbf"
LINE_CAP = 1 << 16      # DATTRI_DS_MAX_LINE_BYTES under this test (the default is much larger)
VOCAB = 64
OURS = {n for n in dir(dd_errors) if n.endswith("Error")}
FOREIGN = re.compile(r"\b([A-Z][A-Za-z]*Error)\b")


# ---- fixtures built in code --------------------------------------------------------------
def _doc(i: int, text: bytes = b"w4 w5 w6") -> bytes:
    return (b'{"id": "d%d", "source": "s", "title": "", "text": "' % i + text + b'"}\n')


DOCS = _doc(0) + _doc(1, b"w7 w8 " + MARK) + _doc(2)
TOKENS = (b'{"id": "t0", "input_ids": [4, 5, 6, 7]}\n'
          b'{"id": "t1-' + MARK + b'", "input_ids": [8, 9, 10]}\n')


def hf_folder(path: Path) -> Path:
    """A tiny GPT-2 (vocab 64, context 24) and a word-level tokenizer, saved_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=24, n_embd=16, n_layer=1,
                               n_head=2, bos_token_id=2, eos_token_id=3)).save_pretrained(path)
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="w0", bos_token="w2",
                            eos_token="w3").save_pretrained(path)
    return path


def spm_tokenizer(cache: Path):
    from dattri_ds.data import train_tokenizer
    texts = [f"w{i} w{i + 1} w{i + 2} caf\u00e9" for i in range(60)]
    return train_tokenizer(texts, vocab_size=40, cache_dir=cache)


def fake_run(run: Path, model: Path, tokenizer: Path) -> Path:
    """A launch/train.py output folder laid out by hand: model config, SentencePiece
    tokenizer, resolved config, trajectory and one save_pretrained checkpoint."""
    (run / "model").mkdir(parents=True)
    shutil.copy(model / "config.json", run / "model/config.json")
    shutil.copy(tokenizer, run / "tokenizer.model")
    (run / "resolved_dattri_ds_config.json").write_text(json.dumps(
        {"train": {"seq_len": 16, "model_config": "w9"}}))
    (run / "trajectory.json").write_text(json.dumps(
        {"run_id": "run:w9", "checkpoints": [{"tag": "step1", "step": 1, "lr": 0.1}]}))
    shutil.copytree(model, run / "checkpoints/step1",
                    ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    return run


def deepspeed_run(root: Path) -> tuple[Path, Path]:
    """launch/train.py (ZeRO-2, AdamW) for 2 steps with a checkpoint at step 2, then
    tools/collect.py of 8 documents, each in a subprocess (no process group here)."""
    from _doors import subprocess_cli

    ds = json.loads((ROOT / "configs/zero2_cpu.json").read_text())
    ds.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    root.mkdir()
    (root / "ds.json").write_text(json.dumps(ds))
    (root / "model.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1,
                                                 "n_head": 2, "n_embd": 16,
                                                 "n_positions": 32}))
    run, store = root / "run", root / "store"
    for argv in (["launch/train.py", "--deepspeed_config", str(root / "ds.json"),
                  "--model-config", str(root / "model.json"), "--out", str(run), "--steps", "2",
                  "--save-every", "2", "--train-data", TRAIN, "--max-docs", "16", "--seq-len",
                  "16", "--vocab-size", "128"],
                 ["tools/collect.py", "--run", str(run), "--data", TRAIN, "--max-docs", "8",
                  "--out", str(store), "--projection-dim", "8"]):
        code, err = subprocess_cli(argv, timeout=600)
        assert code == 0, err[-3000:]
    return run, store


def factors_bytes() -> bytes:
    from dattri_ds import KFACConfig, KFACFactors

    buf = Path(tempfile.mkdtemp()) / "f.pt"
    KFACFactors(KFACConfig()).save(buf)
    return buf.read_bytes()


def attribution_folder(att: Path) -> Path:
    """What tools/attribute.py writes, for 3 training documents and 1 query."""
    att.mkdir(parents=True, exist_ok=True)
    ids = ["d0#a", "d1#b", "d2#c"]
    (att / "summary.json").write_text(json.dumps(
        {"method": "grad-dot", "train": 3, "queries": 1, "checkpoints": ["m"], "note": "w9"}))
    (att / "queries.json").write_text(json.dumps([{"id": "q0", "source": "s", "text": "w4"}]))
    (att / "train_ids.json").write_text(json.dumps(ids))
    (att / "topk.json").write_text(json.dumps([{
        "proponents": [{"id": ids[0], "score": 1.0}], "opponents": [{"id": ids[2],
                                                                      "score": -1.0}]}]))
    np.save(att / "scores.npy", np.array([[1.0], [0.0], [-1.0]], dtype=np.float32))
    (att / "train.jsonl").write_bytes(DOCS)
    return att


# ---- cases: how one file is damaged ---------------------------------------------------------
def _symlink_loop(p: Path) -> None:
    other = p.with_name(p.name + ".loop")
    p.symlink_to(other)
    other.symlink_to(p)


def _huge_line(valid: bytes) -> bytes:
    return _doc(0, b"w4 " * (LINE_CAP // 3 + 10)) if valid is DOCS else (
        b'{"id": "t0", "input_ids": [' + b"4, " * (LINE_CAP // 3 + 10) + b"4]}\n")


CASES = {
    "garbage": lambda p, v: p.write_bytes(b"\x00\x9c\xfe\x80" + bytes(range(256)) * 4),
    "truncated": lambda p, v: p.write_bytes(v[:len(v) // 2 + 3]),
    "latin1": lambda p, v: p.write_bytes(v.replace(MARK, LATIN1) if MARK in v else
                                         v.replace(b"{", b'{"note": "' + LATIN1 + b'", ', 1)),
    "bom": lambda p, v: p.write_bytes(BOM + v),
    "csv": lambda p, v: p.write_bytes(b"id,source,title,text\nd0,s,,w4 w5\nd1,s,,w6 w7\n"),
    "empty": lambda p, v: p.write_bytes(b""),
    "directory": lambda p, v: p.mkdir(),
    "symlink-loop": lambda p, v: _symlink_loop(p),
    "dangling-symlink": lambda p, v: p.symlink_to(p.with_name("nowhere")),
    "missing": lambda p, v: None,
    "huge-line": lambda p, v: p.write_bytes(_huge_line(v)),
    "token-out-of-range": lambda p, v: p.write_bytes(b'{"input_ids": [4, 5, 999999]}\n'),
    "token-negative": lambda p, v: p.write_bytes(b'{"input_ids": [4, -1, 5]}\n'),
    "pickled-object": lambda p, v: p.write_bytes(_pickled(p)),
    "unknown-model-type": lambda p, v: p.write_bytes(v.replace(b'"gpt2"', b'"no-such-arch"')),
    "no-weights": lambda p, v: None,
}
TEXT = ["garbage", "truncated", "latin1", "bom", "csv", "empty", "directory", "symlink-loop",
        "dangling-symlink", "missing"]
FILE = ["garbage", "truncated", "empty", "directory", "symlink-loop", "dangling-symlink",
        "missing"]


def _pickled(p: Path) -> bytes:
    buf = io.BytesIO()
    if p.suffix == ".npy":
        np.save(buf, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    else:
        torch.save({"format": "x", "obj": Counter("ab")}, buf)
    return buf.getvalue()


# ---- doors: where the damaged file goes and what reads it ------------------------------------
class Env:
    """Shared, built once: the tiny HF folder, a SentencePiece tokenizer, factor bytes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = hf_folder(root / "hf")
        self.tok = spm_tokenizer(root / "spm")
        self.factors = factors_bytes()
        self.run = fake_run(root / "run", self.model, self.tok.path)
        self.n = 0
        self._ds: tuple[Path, Path] | None = None

    @property
    def ds_run(self) -> tuple[Path, Path]:
        """(run, store): a real 2-step DeepSpeed ZeRO-2 AdamW run of a tiny GPT-2 with its
        checkpoint ``step2``, and a store collected from it (built once, on first use)."""
        if self._ds is None:
            self._ds = deepspeed_run(self.root / "ds")
        return self._ds

    def fresh(self) -> Path:
        self.n += 1
        d = self.root / f"case{self.n}"
        d.mkdir()
        return d


def door_collect_data(env: Env, case: str, tmp: Path):
    from dattri_ds.tools import collect
    valid = TOKENS if case.startswith("token") else DOCS
    path = tmp / "data.jsonl"
    CASES[case](path, valid)
    return path, lambda: collect.main(["--model", str(env.model), "--data", str(path),
                                       "--out", str(tmp / "out"), "--projection-dim", "8",
                                       "--batch-size", "4"])


def door_collect_tokens(env: Env, case: str, tmp: Path):
    from dattri_ds.tools import collect
    path = tmp / "tokens.jsonl"
    CASES[case](path, TOKENS)
    return path, lambda: collect.main(["--model", str(env.model), "--data", str(path),
                                       "--out", str(tmp / "out"), "--projection-dim", "8",
                                       "--batch-size", "4"])


def door_queries(env: Env, case: str, tmp: Path):
    from dattri_ds.tools.texts import load_texts
    from dattri_ds.tools.sources import HFModelDir
    path = tmp / "queries.jsonl"
    CASES[case](path, TOKENS if case.startswith("token") else DOCS)
    src = HFModelDir.open(env.model)
    return path, lambda: load_texts(str(path), src.tokenizer, src.context, None,
                                    context=src.context, truncate=False, queries=True,
                                    vocab_size=src.vocab_size)


#: Query rows attribute once refused and then scored with exit 0 (a row without text or id).
QUERY_ROWS = {
    "query-empty-text": b'{"id": "q0", "text": "w4 w5"}\n{"id": "q1", "text": ""}\n',
    "query-blank-text": b'{"id": "q0", "text": " \\t "}\n',
    "query-no-id": b'{"id": "q0", "text": "w4 w5"}\n{"text": "w6 w7"}\n',
    "query-null-id": b'{"id": null, "text": "w4 w5"}\n',
    "token-query-no-id": b'{"id": "t0", "input_ids": [4, 5]}\n{"input_ids": [6, 7]}\n',
}
for _name, _rows in QUERY_ROWS.items():
    CASES[_name] = lambda p, v, rows=_rows: p.write_bytes(rows)


def door_target_data(env: Env, case: str, tmp: Path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from launch.evaluate import tokenized_texts
    path = tmp / "target.jsonl"
    CASES[case](path, DOCS)
    return path, lambda: tokenized_texts(str(path), env.tok, 16)


def _report(env: Env, case: str, tmp: Path, name: str, valid: bytes | None):
    from dattri_ds.tools import report
    att = attribution_folder(tmp / "attr")
    path = att / name
    if valid is None:
        valid = path.read_bytes()
    path.unlink()
    CASES[case](path, valid)
    return path, lambda: report.main(["--attribution", str(att), "--train-data",
                                      str(att / "train.jsonl")])


def door_report_summary(env, case, tmp):
    return _report(env, case, tmp, "summary.json", None)


def door_report_scores(env, case, tmp):
    return _report(env, case, tmp, "scores.npy", None)


def door_report_train_data(env, case, tmp):
    return _report(env, case, tmp, "train.jsonl", DOCS)


def door_report_folder(env: Env, case: str, tmp: Path):
    from dattri_ds.tools import report
    att = tmp / "attr"
    if case == "empty":
        att.mkdir()
    else:
        CASES[case](att, b"")
    return att, lambda: report.main(["--attribution", str(att)])


def door_factors(env: Env, case: str, tmp: Path):
    from dattri_ds import KFACFactors
    path = tmp / "factors.pt"
    CASES[case](path, env.factors)
    return path, lambda: KFACFactors.load(path)


def door_hf_model(env: Env, case: str, tmp: Path):
    """Cases on the folder itself (missing, empty, ...) or on its config.json."""
    from dattri_ds.tools import collect
    folder = tmp / "model"
    data = tmp / "data.jsonl"
    data.write_bytes(DOCS)
    if case in ("missing", "dangling-symlink", "symlink-loop", "empty-folder", "not-a-folder"):
        path = folder
        if case == "empty-folder":
            folder.mkdir()
        elif case == "not-a-folder":
            folder.write_bytes(b"not a folder")
        else:
            CASES[case](folder, b"")
    else:
        shutil.copytree(env.model, folder)
        path = folder / "config.json"
        if case == "no-weights":
            (folder / "model.safetensors").unlink()
            path = folder
        elif case == "garbage-weights":
            path = folder / "model.safetensors"
            path.write_bytes(b"\xff" * 64)
        elif case == "garbage-tokenizer":
            path = folder / "tokenizer.json"
            path.write_bytes(b"\x00\x9c garbage {")
        elif case in WEIGHT_DAMAGE:
            path = folder / "model.safetensors"
            path.write_bytes(WEIGHT_DAMAGE[case](path.read_bytes()))
        else:
            valid = path.read_bytes()
            path.unlink()
            CASES[case](path, valid)
    return path, lambda: collect.main(["--model", str(folder), "--data", str(data), "--out",
                                       str(tmp / "out"), "--projection-dim", "8"])


def _cut_data(raw: bytes) -> bytes:
    """A safetensors file whose header is intact and whose tensor data is cut in half."""
    n = int.from_bytes(raw[:8], "little")
    return raw[:8 + n + (len(raw) - 8 - n) // 2]


#: Damage to a ``model.safetensors``: data cut (header intact), the header's JSON broken,
#: a tensor's dtype changed so that its offsets no longer hold it.
WEIGHT_DAMAGE = {
    "cut-weights": _cut_data,
    "damaged-header": lambda raw: raw[:8] + b"x" + raw[9:],
    "wrong-offsets": lambda raw: raw.replace(b'"F32"', b'"F16"', 1),
}
CASES["empty-folder"] = CASES["not-a-folder"] = lambda p, v: None
CASES["garbage-weights"] = CASES["garbage-tokenizer"] = lambda p, v: None
for _name in WEIGHT_DAMAGE:
    CASES[_name] = lambda p, v: None


def door_model_path(env: Env, case: str, tmp: Path):
    """launch's ``train.model_path``, checked at start (``check_inputs``, before a tokenizer
    is trained into --out)."""
    from dattri_ds.launch.checks import check_inputs
    from dattri_ds.launch.config import RunConfig

    path, call = door_hf_model(env, case, tmp)
    folder = path if path.name == "model" else path.parent
    return path, lambda: check_inputs(RunConfig.from_dict({"train": {
        "model_path": str(folder)}}))


# ---- checkpoints under --resume and --init-checkpoint, and the DeepSpeed JSON's keys ---------
#: A checkpoint as DeepSpeed (ZeRO-1/2/3) and --backend torch name their files.
CHECKPOINT_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                    "training_state.pt")
#: case -> (file of the checkpoint, how it is damaged).
CHECKPOINT_DAMAGE = {
    "cut-model-states": ("mp_rank_00_model_states.pt", lambda raw: raw[:len(raw) // 2]),
    "cut-optimizer-states": ("zero_pp_rank_0_mp_rank_00_optim_states.pt",
                             lambda raw: raw[:len(raw) - 30]),
    "empty-optimizer-states": ("zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda raw: b""),
    "garbage-model-states": ("mp_rank_00_model_states.pt", lambda raw: b"\x00\x9c" * 64),
    "cut-training-state": ("training_state.pt", lambda raw: raw[:len(raw) // 3]),
    "cut-loop-state": ("loop_state.rank00000.pt", lambda raw: raw[:len(raw) // 2]),
}
for _name in CHECKPOINT_DAMAGE:
    CASES[_name] = lambda p, v: None


def _damaged_checkpoint(run: Path, case: str) -> Path:
    """``run/checkpoints/step1`` with the files of ``CHECKPOINT_FILES`` and the loop's
    state, listed in ``run/trajectory.json``; the file of ``case`` damaged (returned)."""
    from dattri_ds.launch.resume import LoopState
    from dattri_ds.launch.runlog import RunRecord

    folder = run / "checkpoints" / "step1"
    folder.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_FILES:
        torch.save({"module": {"w": torch.zeros(64)}, "step": 1}, folder / name)
    LoopState(step=1, record=RunRecord(), rng={}, layout={"dp": 1, "tp": 1}).save(folder, 0)
    (run / "trajectory.json").write_text(json.dumps(
        {"checkpoints": [{"tag": "step1", "step": 1, "lr": 0.1}], "lrs": []}))
    name, damage = CHECKPOINT_DAMAGE[case]
    path = folder / name
    path.write_bytes(damage(path.read_bytes()))
    return path


def door_resume(env: Env, case: str, tmp: Path):
    """launch's ``--resume latest`` (``check_resume``, before any process group)."""
    from dattri_ds.launch.config import RunConfig
    from dattri_ds.launch.resume import check_resume

    out = tmp / "run"
    path = _damaged_checkpoint(out, case)
    cfg = RunConfig.from_dict({"train": {"resume": "latest"}})
    return path, lambda: check_resume(cfg, out, {})


def door_init_checkpoint(env: Env, case: str, tmp: Path):
    """launch's ``--init-from RUN --init-checkpoint latest`` (``check_inputs``)."""
    from dattri_ds.launch.checks import check_inputs
    from dattri_ds.launch.config import RunConfig

    run = tmp / "run"
    shutil.copytree(env.run, run)
    if case in WEIGHT_DAMAGE:
        path = run / "checkpoints" / "step1" / "model.safetensors"
        path.write_bytes(WEIGHT_DAMAGE[case](path.read_bytes()))
    else:
        path = _damaged_checkpoint(run, case)
    cfg = RunConfig.from_dict({"train": {"init_from": str(run), "init_checkpoint": "latest"}})
    return path, lambda: check_inputs(cfg)


#: What DeepSpeed asserts (or refuses later) on the keys of the JSON this project passes
#: on, one case each: case -> (keys replaced in configs/zero3_cpu.json, None removes one).
DS_KEY_CASES = {
    "batch-mismatch": {"train_batch_size": 64},
    "batch-derived-zero": {"train_batch_size": 2, "gradient_accumulation_steps": None},
    "batch-none": {"train_micro_batch_size_per_gpu": None},
    "micro-zero": {"train_micro_batch_size_per_gpu": 0},
    "micro-string": {"train_micro_batch_size_per_gpu": "4"},
    "accumulation-negative": {"gradient_accumulation_steps": -2},
    "zero-stage-7": {"zero_optimization": {"stage": 7}},
    "zero-unknown-key": {"zero_optimization": {"stage": 3, "stage3_bogus": 1}},
    "zero-offload-ratio-stage1": {"zero_optimization": {
        "stage": 1, "offload_param": {"device": "cpu", "ratio": 0.5}}},
    "fp16-and-bf16": {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
    "fp16-loss-scale": {"fp16": {"enabled": True, "loss_scale": -1}},
    "bf16-enabled-string": {"bf16": {"enabled": "maybe"}},
    "fp16-master-stage0": {"zero_optimization": {"stage": 0},
                           "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
    "clipping-string": {"gradient_clipping": "a"},
    "clipping-negative": {"gradient_clipping": -1.0},
    "optimizer-max-grad-norm": {"optimizer": {"type": "AdamW", "params": {
        "lr": 1e-3, "max_grad_norm": 1.0}}},
    "optimizer-unknown-param": {"optimizer": {"type": "AdamW", "params": {
        "lr": 1e-3, "betas2": 0.9}}},
    "optimizer-unknown-type": {"optimizer": {"type": "NoSuchOpt", "params": {"lr": 1e-3}}},
    "optimizer-untested-zero": {"optimizer": {"type": "SGD", "params": {"lr": 1e-3}}},
    "scheduler-unknown-type": {"scheduler": {"type": "Nope", "params": {}}},
    "scheduler-unknown-param": {"scheduler": {"type": "WarmupLR", "params": {"bogus": 1}}},
    "scheduler-zero-warmup": {"scheduler": {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": 0, "total_num_steps": 10}}},
}
for _name in DS_KEY_CASES:
    CASES[_name] = lambda p, v: None


def door_deepspeed_keys(env: Env, case: str, tmp: Path):
    """launch's DeepSpeed JSON (``load_run_config``: ``check_deepspeed_json``), one key that
    DeepSpeed would assert on."""
    from dattri_ds.launch.args import load_run_config
    ds = json.loads((Path(__file__).resolve().parents[2] / "configs/zero3_cpu.json").read_text())
    for key, value in DS_KEY_CASES[case].items():
        if value is None:
            ds.pop(key, None)
        else:
            ds[key] = value
    path = tmp / "ds.json"
    path.write_text(json.dumps(ds))
    return path, lambda: load_run_config(path, {})


def _run_door(env: Env, case: str, tmp: Path, name: str | None):
    """``dattri-ds collect --run DIR`` with the run folder itself or one of its files damaged."""
    from dattri_ds.tools import collect
    run = tmp / "run"
    data = tmp / "data.jsonl"
    data.write_bytes(DOCS)
    if name is None:
        path = run
        if case == "empty-folder":
            run.mkdir()
        elif case == "not-a-folder":
            run.write_bytes(b"not a folder")
        else:
            CASES[case](run, b"")
    else:
        shutil.copytree(env.run, run)
        path = run / name
        valid = path.read_bytes()
        path.unlink()
        CASES[case](path, valid)
    return path, lambda: collect.main(["--run", str(run), "--data", str(data), "--out",
                                       str(tmp / "out"), "--projection-dim", "8"])


def door_run_folder(env, case, tmp):
    return _run_door(env, case, tmp, None)


def door_run_trajectory(env, case, tmp):
    return _run_door(env, case, tmp, "trajectory.json")


def door_run_resolved(env, case, tmp):
    return _run_door(env, case, tmp, "resolved_dattri_ds_config.json")


def door_run_tokenizer(env, case, tmp):
    return _run_door(env, case, tmp, "tokenizer.model")


def door_tokenizer(env: Env, case: str, tmp: Path):
    """A run's SentencePiece ``tokenizer.model`` (``Run.tokenizer``)."""
    from dattri_ds.data import Tokenizer
    path = tmp / "tokenizer.model"
    CASES[case](path, env.tok.path.read_bytes())
    return path, lambda: Tokenizer.load(path)


def door_train_data(env: Env, case: str, tmp: Path):
    """launch's ``--train-data`` (``check_inputs`` at start, then ``training_data`` prepares
    it into the run's ``data/``)."""
    from dattri_ds.launch.checks import check_inputs
    from dattri_ds.launch.config import RunConfig
    from dattri_ds.launch.data import training_data

    path = tmp / "train.jsonl"
    CASES[case](path, DOCS)
    cfg = RunConfig.from_dict({"train": {"train_data": [str(path)], "seq_len": 16,
                                         "tokenizer": str(env.tok.path)}})
    return path, lambda: (check_inputs(cfg), training_data(cfg, tmp / "run", 0))


def _data_path(env: Env, case: str, tmp: Path, suffix: str):
    """launch's ``--data-path PREFIX`` (``check_inputs``) with ``PREFIX<suffix>`` damaged."""
    from dattri_ds.data.prepare import PrepareConfig, prepare
    from dattri_ds.launch.checks import check_inputs
    from dattri_ds.launch.config import RunConfig

    (tmp / "docs.jsonl").write_bytes(DOCS)
    prefix = tmp / "corpus"
    prepare(PrepareConfig(input=(str(tmp / "docs.jsonl"),), output_prefix=str(prefix),
                          tokenizer=str(env.tok.path), workers=1))
    path = Path(f"{prefix}{suffix}")
    valid = path.read_bytes()
    path.unlink()
    CASES[case](path, valid)
    cfg = RunConfig.from_dict({"train": {"data_path": [str(prefix)]}})
    return path, lambda: check_inputs(cfg)


def door_data_path_idx(env, case, tmp):
    return _data_path(env, case, tmp, ".idx")


def door_data_path_bin(env, case, tmp):
    return _data_path(env, case, tmp, ".bin")


def door_data_path_manifest(env, case, tmp):
    return _data_path(env, case, tmp, ".manifest.json")


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while raw[i] & 0x80:
        value |= (raw[i] & 0x7F) << shift
        i, shift = i + 1, shift + 7
    return value | raw[i] << shift, i + 1


def _cut_at_piece(raw: bytes) -> bytes:
    """A SentencePiece model (every top-level record length-delimited) cut after half its
    pieces (field 1): a valid protobuf message, which sentencepiece loads as a smaller
    vocabulary."""
    i, ends = 0, []
    while i < len(raw):
        key, i = _varint(raw, i)
        n, i = _varint(raw, i)
        i += n
        if key >> 3 == 1:
            ends.append(i)
    return raw[:ends[len(ends) // 2]]


CASES["cut-at-piece"] = lambda p, v: p.write_bytes(_cut_at_piece(v))


# ---- the offline tools on a real DeepSpeed run: collect --run, curate --method adam-cosine ---
#: Damage to the DeepSpeed files of the run's ``step2`` (CHECKPOINT_DAMAGE's cases).
DS_DAMAGE = ["cut-model-states", "cut-optimizer-states", "empty-optimizer-states",
             "garbage-model-states"]


def _ds_damaged(env: Env, case: str, tmp: Path) -> tuple[Path, Path, Path]:
    """(run copy, store, damaged file): the DeepSpeed run with one file of step2 damaged."""
    run, store = env.ds_run
    shutil.copytree(run, tmp / "run")
    name, damage = CHECKPOINT_DAMAGE[case]
    path = tmp / "run/checkpoints/step2" / name
    path.write_bytes(damage(path.read_bytes()))
    return tmp / "run", store, path


def door_collect_run_checkpoint(env: Env, case: str, tmp: Path):
    """``dattri-ds collect --run RUN`` (DeepSpeed's zero_to_fp32 reads the checkpoint)."""
    from dattri_ds.tools import collect
    run, _, path = _ds_damaged(env, case, tmp)
    return path, lambda: collect.main(["--run", str(run), "--data", TRAIN, "--max-docs", "4",
                                       "--out", str(tmp / "out"), "--projection-dim", "8"])


def door_curate_adam(env: Env, case: str, tmp: Path):
    """``dattri-ds curate --method adam-cosine`` (the model and the Adam moments of step2)."""
    from dattri_ds.tools import curate
    run, store, path = _ds_damaged(env, case, tmp)
    return path, lambda: curate.main(["--run", str(run), "--store", str(store), "--target",
                                      str(ROOT / "data/tiny/target.jsonl"), "--method",
                                      "adam-cosine", "--examples", "2", "--out",
                                      str(tmp / "out")])


# ---- Hugging Face tokenizer folders under collect --model ----------------------------------
def _slow_folder(folder: Path, cls: str, spm: bytes | None) -> None:
    """The model folder's tokenizer replaced by a slow-format one of class ``cls`` (no
    tokenizer.json): GPT-2's vocab.json (merges.txt left out), or Llama's tokenizer.model."""
    for f in folder.glob("tokenizer*"):
        f.unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls}))
    if cls == "GPT2Tokenizer":
        (folder / "vocab.json").write_text(json.dumps({f"w{i}": i for i in range(VOCAB)}))
    elif spm is not None:
        (folder / "tokenizer.model").write_bytes(spm)


#: case -> (the damaged file, relative to the model folder; how the folder is damaged).
TOKENIZER_DAMAGE = {
    "cut-tokenizer-json": ("tokenizer.json", lambda f, spm: (f / "tokenizer.json").write_bytes(
        (f / "tokenizer.json").read_bytes()[:200])),
    "tokenizer-config-not-json": ("tokenizer_config.json", lambda f, spm: (
        f / "tokenizer_config.json").write_text("tokenizer_class = GPT2Tokenizer\n")),
    "missing-merges": (".", lambda f, spm: _slow_folder(f, "GPT2Tokenizer", None)),
    "missing-spm-model": (".", lambda f, spm: _slow_folder(f, "LlamaTokenizer", None)),
    "cut-spm-model": ("tokenizer.model", lambda f, spm: _slow_folder(
        f, "LlamaTokenizer", _cut_at_piece(spm))),
    "garbage-spm-model": ("tokenizer.model", lambda f, spm: _slow_folder(
        f, "LlamaTokenizer", b"\x00\x9c garbage" * 10)),
}
for _name in TOKENIZER_DAMAGE:
    CASES[_name] = lambda p, v: None


def door_hf_tokenizer(env: Env, case: str, tmp: Path):
    """``dattri-ds collect --model DIR`` with the folder's tokenizer damaged."""
    from dattri_ds.tools import collect
    folder = tmp / "model"
    shutil.copytree(env.model, folder)
    name, damage = TOKENIZER_DAMAGE[case]
    damage(folder, env.tok.path.read_bytes())
    data = tmp / "data.jsonl"
    data.write_bytes(DOCS)
    return (folder / name).resolve(), lambda: collect.main([
        "--model", str(folder), "--data", str(data), "--out", str(tmp / "out"),
        "--projection-dim", "8"])


RUN_CONFIG = (b'{"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, '
              b'"dattri_ds": {"train": {"model_config": "configs/' + MARK + b'.json"}}}\n')
MODEL_CONFIG = (b'{"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, '
                b'"attn_implementation": "eager", "dattri_note_' + MARK + b'": null}\n')


def door_run_config(env: Env, case: str, tmp: Path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from launch.args import load_run_config
    path = tmp / "ds.json"
    CASES[case](path, RUN_CONFIG)
    return path, lambda: load_run_config(path, {})


def door_model_config(env: Env, case: str, tmp: Path):
    from dattri_ds.models.causal_lm import load_model_config
    path = tmp / "model_gpt2.json"
    CASES[case](path, MODEL_CONFIG.replace(b', "dattri_note_' + MARK + b'": null', b""
                                           ) if case != "latin1" else MODEL_CONFIG)
    return path, lambda: load_model_config(path)


def door_plan_model(env: Env, case: str, tmp: Path):
    """``dattri-ds plan --model FILE`` (our JSON model config or a Hugging Face config.json)."""
    from dattri_ds.tools import plan
    path = tmp / "model.json"
    CASES[case](path, MODEL_CONFIG)
    return path, lambda: plan.main(["--model", str(path), "--vocab-size", "64"])


MODEL_CASES = ["missing", "dangling-symlink", "symlink-loop", "empty-folder", "not-a-folder",
               "garbage", "truncated", "latin1", "bom", "empty", "directory",
               "unknown-model-type", "no-weights", "garbage-weights", *WEIGHT_DAMAGE]
DOOR_HF_CASES = MODEL_CASES + ["garbage-tokenizer"]
DOORS = {
    "collect-data": (door_collect_data, TEXT + ["huge-line"]),
    "collect-tokens": (door_collect_tokens, ["garbage", "truncated", "latin1", "bom", "csv",
                                             "huge-line", "token-out-of-range",
                                             "token-negative"]),
    "queries": (door_queries, TEXT + ["huge-line", "token-out-of-range", "token-negative",
                                      *QUERY_ROWS]),
    "target-data": (door_target_data, TEXT + ["huge-line"]),
    "report-summary": (door_report_summary, TEXT),
    "report-scores": (door_report_scores, FILE + ["pickled-object"]),
    "report-train-data": (door_report_train_data, TEXT + ["huge-line"]),
    "report-folder": (door_report_folder, ["missing", "empty", "dangling-symlink",
                                           "symlink-loop"]),
    "factors": (door_factors, FILE + ["pickled-object"]),
    "hf-model": (door_hf_model, DOOR_HF_CASES),
    "model-path": (door_model_path, MODEL_CASES),
    "tokenizer": (door_tokenizer, FILE),
    "run-folder": (door_run_folder, ["missing", "dangling-symlink", "symlink-loop",
                                     "empty-folder", "not-a-folder"]),
    "run-trajectory": (door_run_trajectory, TEXT),
    "run-resolved-config": (door_run_resolved, TEXT),
    "run-tokenizer": (door_run_tokenizer, FILE + ["cut-at-piece"]),
    "run-config": (door_run_config, TEXT),
    "model-config": (door_model_config, TEXT + ["unknown-model-type"]),
    "plan-model": (door_plan_model, TEXT),
    "resume": (door_resume, list(CHECKPOINT_DAMAGE)),
    "init-checkpoint": (door_init_checkpoint, [c for c in CHECKPOINT_DAMAGE
                                               if c != "cut-loop-state"] + list(WEIGHT_DAMAGE)),
    "deepspeed-keys": (door_deepspeed_keys, list(DS_KEY_CASES)),
    "train-data": (door_train_data, TEXT + ["huge-line"]),
    "data-path-idx": (door_data_path_idx, FILE),
    # any bytes of the right length are tokens: a .bin is checked by its size only
    "data-path-bin": (door_data_path_bin, [c for c in FILE if c != "garbage"]),
    # without a manifest a prefix is a Megatron-LM one: "missing" is another door's case
    "data-path-manifest": (door_data_path_manifest, [c for c in TEXT if c != "missing"]),
    "collect-run-checkpoint": (door_collect_run_checkpoint, DS_DAMAGE),
    "curate-adam": (door_curate_adam, DS_DAMAGE),
    "hf-tokenizer": (door_hf_tokenizer, list(TOKENIZER_DAMAGE)),
}
PAIRS = [(d, c) for d, (_, cases) in DOORS.items() for c in cases]
#: A UTF-8 BOM is stripped: the input is valid (not in a Hugging Face config.json, which
#: transformers itself reads: there it is a clear error).
ACCEPTED = {"bom"}
HF_DOORS = ("hf-model", "model-path")


def accepted(door: str, case: str) -> bool:
    return case in ACCEPTED and door not in HF_DOORS


def classify(rc: int, err: str, path: Path) -> tuple[str, str]:
    """(outcome, the error text): clear / raw / unclear / silent (or ok for an accepted input).

    clear: exit 1 or 2, one ``dattri-ds: error:`` line naming the file, no foreign class name.
    """
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if rc == 0:
        return "silent", ""
    text = "\n".join(lines)
    foreign = [n for n in FOREIGN.findall(text) if n not in OURS]
    if len(lines) != 1 or not lines[0].startswith("dattri-ds: error: ") or foreign:
        return "raw", text[-400:]
    if str(path) not in lines[0]:
        return "unclear", lines[0]
    return "clear", lines[0]


@contextlib.contextmanager
def _environment():
    old = {k: os.environ.get(k) for k in (DEBUG_ENV, "DATTRI_DS_MAX_LINE_BYTES")}
    os.environ.pop(DEBUG_ENV, None)
    os.environ["DATTRI_DS_MAX_LINE_BYTES"] = str(LINE_CAP)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_case(env: Env, door: str, case: str) -> tuple[str, str, Path]:
    """Build the damaged input, run the door through the CLI's error path (debug off); a
    clear line after which the command's ``--out`` (``tmp/out``) holds a file is
    ``wrote``."""
    tmp = env.fresh()
    path, call = DOORS[door][0](env, case, tmp)
    err = io.StringIO()
    with _environment(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        import logging
        logging.disable(logging.CRITICAL)
        try:
            rc = run(lambda argv: call(), [])
        finally:
            logging.disable(logging.NOTSET)
    outcome, text = classify(rc, err.getvalue(), path)
    written = sorted(str(f.relative_to(tmp)) for f in (tmp / "out").rglob("*") if f.is_file())
    if outcome == "clear" and written:  # a refusal comes before anything is written
        outcome, text = "wrote", f"{text} (but wrote {written[:3]})"
    return outcome, text, path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return Env(tmp_path_factory.mktemp("doors"))


@pytest.mark.parametrize("door,case", PAIRS, ids=[f"{d}:{c}" for d, c in PAIRS])
def test_damaged_file_is_one_clear_line(env, door, case):
    """A damaged input file ends in exit 1/2 and one line naming the file, no foreign error
    type (a UTF-8 BOM is accepted: the door reads the file as if it had none)."""
    outcome, text, path = run_case(env, door, case)
    if accepted(door, case):
        assert outcome == "silent", (door, case, text)
    else:
        assert outcome == "clear", (door, case, outcome, text)


def measure() -> Counter:
    """Every door x case; prints the outcome of each and the totals."""
    with tempfile.TemporaryDirectory() as d:
        env = Env(Path(d))
        counts: Counter = Counter()
        for door, case in PAIRS:
            try:
                outcome, text, _ = run_case(env, door, case)
            except BaseException as e:  # noqa: BLE001 - a door that escapes the CLI path
                outcome, text = "raw", f"escaped: {type(e).__name__}: {e}"
            if accepted(door, case):
                outcome = "accepted" if outcome == "silent" else f"refused-valid({outcome})"
            counts[outcome] += 1
            print(f"{door:18s} {case:20s} {outcome:8s} {text[:150]}")
    return counts


if __name__ == "__main__":
    c = measure()
    n = sum(v for k, v in c.items() if k != "accepted" and not k.startswith("refused"))
    print(f"{n} cases, {c['clear']} clear, {c['raw']} raw, {c['unclear']} unclear, "
          f"{c['silent']} silent; BOM: {c['accepted']} accepted, "
          f"{sum(v for k, v in c.items() if k.startswith('refused'))} refused")
