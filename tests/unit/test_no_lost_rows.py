"""No row is lost by a normal call, and a run's summary says where and why it stopped.

Invariants: a ``GradientCapture`` whose ``StoreCallback`` is ``detach()``-ed (not closed)
has committed every captured row, and the store reads cleanly; a process that exits with a
writer still holding buffered rows commits them at exit (and warns, naming the store and
the count); a run that fails records the step it reached and its cause, and collect on a
run that diverged before its first checkpoint says so; known-good inputs (one path where a
list is expected, any integer seed) are accepted, each decided once in the schema.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _doors import ENV, classify, in_process
from reference import tiny_gpt2

from dattri_ds import CaptureConfig, GradientCapture, ProjectionConfig
from dattri_ds.store import GradientStore, StoreCallback, StoreConfig

HERE = Path(__file__).resolve().parent


def _capture_two_batches(path: Path):
    model = tiny_gpt2()
    proj = ProjectionConfig(dim=8)
    store = StoreCallback(StoreConfig(path=str(path)), projection=proj, fingerprint="m")
    cap = GradientCapture(model, CaptureConfig(projection=proj), callbacks=[store])
    cap.attach()
    for seed in (0, 1):
        ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids).loss.backward()
    return cap, store


def test_detach_commits_the_pending_rows(tmp_path):
    """detach() without close() (flush_every 512, only 4 rows) leaves all 4 rows committed:
    a reader in the same process sees them; attach() then keeps writing to the same store."""
    cap, store = _capture_two_batches(tmp_path / "s")
    cap.detach()
    assert store.writer.pending_rows == 0
    with GradientStore.open(tmp_path / "s") as s:
        assert len(s.ids) == 4
    cap.close()
    with GradientStore.open(tmp_path / "s") as s:
        assert len(s.ids) == 4


_EXIT_SCRIPT = """
import sys
sys.path[:0] = [{here!r}, {tests!r}]
from test_no_lost_rows import _capture_two_batches
cap, store = _capture_two_batches(__import__("pathlib").Path(sys.argv[1]))
assert store.writer.pending_rows == 4
sys.exit(0)  # neither detach() nor close(): the rows are only buffered
"""


def test_interpreter_exit_commits_pending_rows_and_warns(tmp_path):
    """A process that exits with 4 buffered rows (never detached or closed) commits them at
    exit, warning with the store path and the count; the store then reads all 4 cleanly."""
    path = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT.format(here=str(HERE), tests=str(HERE.parent)), str(path)],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert str(path) in proc.stderr and "4 buffered rows" in proc.stderr, proc.stderr[-2000:]
    with GradientStore.open(path) as s:
        assert len(s.ids) == 4


def _runlog(tmp_path, steps=6, limit=2):
    from dattri_ds.launch.config import TrainConfig
    from dattri_ds.launch.runlog import RunLog

    return RunLog(TrainConfig(steps=steps, max_nonfinite_steps=limit), tmp_path, 0)


def test_failed_summary_records_step_reached_and_cause(tmp_path):
    """A run of 6 steps whose steps 3 and 4 are NaN (limit 2) records steps 4, cause
    'diverged' at step 3 (not the 6 requested); a finished run records all its steps."""
    from dattri_ds.launch.runlog import NonFiniteTrainingError

    log = _runlog(tmp_path)
    for step, loss in enumerate([1.0, 0.9, float("nan")]):
        log.end_step(step, loss, 0.1, 2, lambda *a: None)
    with pytest.raises(NonFiniteTrainingError):
        log.end_step(3, float("nan"), 0.1, 2, lambda *a: None)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (s["status"], s["steps"], s["steps_requested"], s["cause"],
            s["diverged_at_step"]) == ("failed", 4, 6, "diverged", 3)
    ok = _runlog(tmp_path / "ok", steps=2)
    (tmp_path / "ok").mkdir()
    for step in range(2):
        ok.end_step(step, 1.0, 0.1, 2, lambda *a: None)
    assert ok.summary()["steps"] == 2 and ok.summary()["cause"] is None


def test_device_losses_are_read_once_when_needed_and_still_stop_a_divergence(tmp_path):
    """Losses handed over as tensors (launch's loop: no host sync per step) are recorded
    only at a step that logs (every 4 here), then all of them, in order; a divergence
    (steps 2 and 3 NaN, limit 2) stops the run at the step that reads them (4), named from
    its first step (2), and no checkpoint of that step is written."""
    import torch

    from dattri_ds.launch.config import TrainConfig
    from dattri_ds.launch.runlog import NonFiniteTrainingError, RunLog

    saved = []
    log = RunLog(TrainConfig(steps=8, log_every=4, max_nonfinite_steps=2, save_every=0),
                 tmp_path, 0)
    for step, x in enumerate([1.0, 0.5, 0.25]):
        log.end_step(step, torch.tensor(x, dtype=torch.float64), 0.1, 2, saved.append)
    assert log.record.lrs == [] and log.record.seen == 0
    log.end_step(3, torch.tensor(0.125), 0.1, 2, saved.append)
    assert [e["loss"] for e in log.record.lrs] == [1.0, 0.5, 0.25, 0.125]
    assert log.record.seen == 8 and log.record.loss == 0.125
    bad = RunLog(TrainConfig(steps=8, log_every=4, max_nonfinite_steps=2, save_every=4),
                 tmp_path, 0)
    for step, x in enumerate([1.0, float("nan"), float("nan")]):
        bad.end_step(step, torch.tensor(x), 0.1, 2, lambda *a: saved.append(a))
    with pytest.raises(NonFiniteTrainingError, match=r"\(2\.\.3\)"):
        bad.end_step(3, torch.tensor(1.0), 0.1, 2, lambda *a: saved.append(a))
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (s["steps"], s["diverged_at_step"], s["nonfinite_steps"]) == (4, 2, 2)
    assert saved == []


def test_collect_on_a_diverged_run_names_the_divergence(tmp_path):
    """collect on a run that diverged before its first checkpoint says the run diverged at
    step N (from summary.json), not that trajectory.json is missing."""
    from dattri_ds.tools import collect

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    tiny_gpt2().config.save_pretrained(run / "model")
    (run / "tokenizer.model").write_bytes(b"")
    (run / "resolved_dattri_ds_config.json").write_text(json.dumps({"train": {"seq_len": 16}}))
    (run / "summary.json").write_text(json.dumps({
        "status": "failed", "cause": "diverged", "diverged_at_step": 3, "steps": 4,
        "error": "2 consecutive optimizer steps (3..4) had a non-finite loss"}))
    code, err = in_process(collect.main, ["--run", str(run), "--out", str(tmp_path / "g")])
    assert classify(code, err, "diverged at step 3") == "clear", err


def test_known_good_inputs_are_accepted(tmp_path):
    """"train_data": "file.jsonl" is a list of one; "seed": -1 (any integer) is accepted; the
    capture patterns take one string too."""
    from dattri_ds.launch.config import RunConfig

    cfg = RunConfig.from_dict({"train": {"train_data": "data/tiny/train.jsonl", "seed": -1},
                               "capture": {"include": "*mlp*"}})
    assert cfg.train.train_data == ("data/tiny/train.jsonl",)
    assert cfg.train.seed == -1 and cfg.capture.include == ("*mlp*",)
    assert RunConfig.from_dict({"train": {"seed": 2 ** 40}}).train.seed == 2 ** 40


def test_a_run_that_raises_records_the_step_reached_and_the_cause(tmp_path):
    """launch's main hands any error of the loop to record_failure: after 2 of 6 steps a
    full disk leaves summary.json with status failed, steps 2, cause write_failed and the
    error's text (a diverged run keeps its own summary)."""
    import errno

    from dattri_ds.launch.runlog import record_failure

    log = _runlog(tmp_path)
    for step in range(2):
        log.end_step(step, 1.0, 0.1, 2, lambda *a: None)
    record_failure(OSError(errno.ENOSPC, "No space left on device"))
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (s["status"], s["steps"], s["steps_requested"], s["cause"]) == \
        ("failed", 2, 6, "write_failed")
    assert "No space left" in s["error"] and s["error_type"] == "OSError"


def test_a_stop_during_a_commit_waits_for_the_commit():
    """Ctrl-C (SIGINT) arriving while collect commits its buffered rows is delivered after
    the commit (``KeyboardInterrupt`` then), never inside it: a commit takes the buffer
    before writing it, so a stop in between would lose those rows."""
    import os
    import signal

    from dattri_ds.tools.collect import _signals_deferred

    steps = []
    with pytest.raises(KeyboardInterrupt):
        with _signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            steps.append("committed")
    assert steps == ["committed"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
