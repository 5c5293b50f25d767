"""A checkpoint save that fails on one rank of two ends the run on both, with one same line.

2 forked gloo ranks run ``launch/train.py`` (through the command line's error path) for 2
steps with a checkpoint at step 2; one rank's files may not exceed 100 kB (a real
``RLIMIT_FSIZE`` set in that rank alone, SIGXFSZ ignored so ``write`` returns EFBIG), as when
one node's disk fills up:

* DeepSpeed ZeRO-1, data parallel 2: rank 1's optimizer partition
  (``zero_pp_rank_1_mp_rank_00_optim_states.pt``) does not fit, inside DeepSpeed's
  ``save_checkpoint``, before the barrier that closes it;
* Megatron TP=2: rank 0's consolidated weights (``megatron_consolidated.pt``) do not fit,
  before the point where the TP ranks meet again.

Invariants: both ranks exit 1 (no rank waits for the launcher to kill it: the workers are
given 300 s) with the same one ``dattri-ds: error:`` line (so the launch prints it once:
cli/noise.py; two different lines would both be printed), naming the failing rank's file in ``step2.tmp``, the cause ("File too large") and the fix
(``--resume latest``); ``step2`` is listed nowhere (``summary.json`` says ``write_failed``,
no ``latest``) and no ``step2`` or ``*.tmp`` folder is left. Breaks if a rank learns of the
failure only from the launcher (a barrier left waiting), or if the ranks report different
things.
"""

from __future__ import annotations

import io
import json
import resource
import signal
import sys
import warnings
from contextlib import redirect_stderr
from pathlib import Path

import pytest
from _deps import require

from _dist import run, tiny_run_files

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 100_000  # bytes: the failing rank's small files fit, its large one does not
PREFIX = "dattri-ds: error: "
#: backend -> (ZeRO stage of its JSON, extra flags, the rank whose save fails, its file)
CASES = {
    "deepspeed": (1, (), 1, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    "megatron": (1, ("--tensor-model-parallel-size", "2"), 0, "megatron_consolidated.pt"),
}


def _train(rank, world, argv, limited):
    """launch/train.py through the CLI's error path; rank ``limited`` under the file-size
    limit. Returns (exit code, the error lines)."""
    from dattri_ds.cli.exits import run as cli
    from dattri_ds.launch.train import main

    if rank == limited:
        sys.dont_write_bytecode = True  # no cut .pyc under the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
    err = io.StringIO()
    with redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli(main, argv)
    return code, [ln for ln in err.getvalue().splitlines() if ln.startswith(PREFIX)]


@pytest.mark.parametrize("backend", list(CASES))
def test_failed_save_on_one_rank_ends_every_rank_with_one_line(tmp_path, backend):
    require("deepspeed", "deepspeed")  # the JSON's lr schedule is DeepSpeed's class
    if backend == "megatron":
        require("megatron.core", "megatron")
    stage, extra, limited, name = CASES[backend]
    out = tmp_path / "run"
    argv = ["--backend", backend, *extra, *tiny_run_files(
        tmp_path, stage, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
        train_batch_size=None), "--out", str(out), "--steps", "2", "--save-every", "2",
        "--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "32",
        "--seq-len", "32", "--vocab-size", "512", "--log-every", "1"]
    results = run(_train, 2, timeout=300, argv=argv, limited=limited)
    codes, lines = [c for c, _ in results], [ln for _, lns in results for ln in lns]
    assert codes == [1, 1], results
    assert len(lines) == 1, lines  # ranks failing alike print their line once (cli/noise.py)
    line = lines[0]
    assert str(out / "checkpoints" / "step2.tmp" / name) in line, line
    assert "File too large" in line and "--resume latest" in line, line
    assert "complete checkpoints are none" in line, line

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["cause"] == "write_failed", summary
    assert summary["checkpoints"] == []
    ckpt = out / "checkpoints"
    assert not (ckpt / "latest").exists()
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith("step2")] if \
        ckpt.exists() else True
