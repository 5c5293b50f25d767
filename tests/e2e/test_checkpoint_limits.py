"""Checkpoints are all or nothing: a save that fails under a real file-size limit is one line,
is listed nowhere, and ``--resume latest`` then ends bit-identical to an uninterrupted run.

Each backend (``--backend torch``, DeepSpeed ZeRO-3 in one process, Megatron-core TP=1)
trains a tiny GPT-2 with online selection: 4 steps in one go (the reference); 2 steps (a
complete ``step2``); then ``--resume latest`` to step 4 in a subprocess whose files may not
exceed 100 kB (``RLIMIT_FSIZE`` in a ``preexec_fn``, SIGXFSZ ignored so ``write`` returns
EFBIG): the weights or optimizer state of ``step4`` do not fit. Invariants:

* the failed run exits 1 with one ``dattri-ds: error:`` line naming a file of the step4
  folder, the cause in the system's words ("File too large") and the fix (``--resume
  latest``), nothing from torch's ``inline_container.cc`` and no traceback;
* ``step4`` is listed nowhere: ``summary.json`` (``status: failed``), ``trajectory.json`` and
  ``checkpoints/latest`` name ``step2`` only, and no ``step4`` or ``*.tmp`` folder is left;
* ``--resume latest`` without the limit continues from ``step2`` and ends with the final
  weights (bitwise), the per-step losses and the selection log of the uninterrupted run.

Breaks if a half-written checkpoint is listed (a resume would load it), if the temporary
folder survives, or if the error is torch's raw text.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _deps import require
import torch

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "PYTHONDONTWRITEBYTECODE": "1"}  # Python installs a cut .pyc under a file-size limit
ENV.pop("DATTRI_DS_DEBUG", None)
pytestmark = pytest.mark.slow
LIMIT = 100_000  # bytes: every file of step4 but its weights / optimizer state fits
#: backend -> (its DeepSpeed JSON, extra flags)
BACKENDS = {"torch": ("zero0_cpu", ()), "deepspeed": ("zero3_cpu", ()),
            "megatron": ("zero1_cpu", ("--tensor-model-parallel-size", "1"))}


def _files(tmp: Path, name: str) -> list[str]:
    cfg = json.loads((ROOT / f"configs/{name}.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    cfg["optimizer"]["params"]["lr"] = 0.01
    cfg["scheduler"]["params"].update(warmup_num_steps=2, total_num_steps=8)
    (tmp / "ds.json").write_text(json.dumps(cfg))
    (tmp / "model.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64,
         "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.0,
         "tie_word_embeddings": False}))
    return ["--deepspeed_config", str(tmp / "ds.json"), "--model-config", str(tmp / "model.json")]


def _cmd(backend: str, files: list[str], out: Path, steps: int, *extra: str) -> list[str]:
    return [PY, str(ROOT / "launch/train.py"), "--backend", backend, *BACKENDS[backend][1],
            *files, "--out", str(out), "--steps", str(steps), "--save-every", "2",
            "--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "48",
            "--seq-len", "32", "--vocab-size", "512", "--log-every", "1", "--online-selection",
            "--target-data", str(ROOT / "data/tiny/target.jsonl"), "--target-max-docs", "8",
            *extra]


def _fsize_limit() -> None:  # in the child: write() past the limit returns EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
                          **kw)


def _ok(cmd: list[str]) -> None:
    proc = _run(cmd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _weights(backend: str, out: Path) -> dict[str, torch.Tensor]:
    if backend == "megatron":
        from dattri_ds.integrations.megatron_checkpoint import read_consolidated
        return read_consolidated(out / "checkpoints" / "step4")
    from dattri_ds.integrations.checkpoints import load_state_dict
    return load_state_dict(out / "checkpoints" / "step4")


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_failed_save_is_never_listed_and_resume_latest_is_bit_identical(tmp_path, backend):
    """The invariants of the module docstring, for one backend."""
    require("deepspeed", "deepspeed")  # the JSON's lr schedule is DeepSpeed's class
    if backend == "megatron":
        require("megatron.core", "megatron")
    files = _files(tmp_path, BACKENDS[backend][0])
    full, part = tmp_path / "full", tmp_path / "part"
    _ok(_cmd(backend, files, full, 4))
    _ok(_cmd(backend, files, part, 2))
    failed = _run(_cmd(backend, files, part, 4, "--resume", "latest"), preexec_fn=_fsize_limit)
    errors = [ln for ln in failed.stderr.splitlines() if ln.startswith("dattri-ds: error: ")]
    assert failed.returncode == 1 and len(errors) == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr and "inline_container" not in failed.stderr
    line = errors[0]
    assert str(part / "checkpoints" / "step4.tmp") + "/" in line, line
    assert "File too large" in line and "--resume latest" in line and "['step2']" in line, line

    summary = json.loads((part / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["cause"] == "write_failed"
    assert summary["checkpoints"] == ["step2"], summary
    trajectory = json.loads((part / "trajectory.json").read_text())
    assert [c["tag"] for c in trajectory["checkpoints"]] == ["step2"]
    assert (part / "checkpoints" / "latest").read_text() == "step2"
    assert sorted(p.name for p in (part / "checkpoints").iterdir() if p.is_dir()) == ["step2"]

    _ok(_cmd(backend, files, part, 4, "--resume", "latest"))
    a, b = (json.loads((d / "trajectory.json").read_text()) for d in (full, part))
    assert [r["loss"] for r in a["lrs"]] == [r["loss"] for r in b["lrs"]]
    assert a["checkpoints"] == b["checkpoints"]
    assert (part / "checkpoints" / "latest").read_text() == "step4"
    wa, wb = _weights(backend, full), _weights(backend, part)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (full / "selection.jsonl").read_text() == (part / "selection.jsonl").read_text()
