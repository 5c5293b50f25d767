"""The command-line error path (dattri_ds/cli/exits.py) and the tools' refusal of stand-in defaults.

Invariants: a usage or config error exits 2 and a runtime error exits 1, each with exactly
one line ``dattri-ds: error: <message>`` and no traceback; ``--debug`` (or
``DATTRI_DS_DEBUG=1``) shows the traceback instead. A run directory without its resolved
config or trajectory is an error naming the file and the flag, never a default.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from dattri_ds.cli.exits import run
from dattri_ds.errors import CaptureError, ConfigError

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("dattri-ds: error: ")]


def _run(main, argv: list[str], env: dict | None = None) -> tuple[int, str]:
    err = io.StringIO()
    old = dict(os.environ)
    os.environ.pop("DATTRI_DS_DEBUG", None)
    os.environ.update(env or {})
    try:
        with redirect_stderr(err):
            code = run(main, argv)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return code, err.getvalue()


def test_exit_codes_and_one_line_messages():
    """ConfigError -> 2, other errors -> 1 (unexpected types named, with the --debug hint);
    multi-line messages are folded into one line; --debug re-raises with the traceback."""
    def config(argv):
        raise ConfigError("dattri_ds.train.steps = 0 is not allowed:\nexpected >= 1")

    def capture(argv):
        raise CaptureError("Layer 'fc' produced no activation")

    def bug(argv):
        raise KeyError("x")

    def ok(argv):
        assert argv == ["--a"], argv  # --debug is removed before main sees argv

    code, err = _run(config, [])
    assert code == 2 and _errors(err) == [
        "dattri-ds: error: dattri_ds.train.steps = 0 is not allowed: expected >= 1"]
    code, err = _run(capture, [])
    assert code == 1 and _errors(err) == ["dattri-ds: error: Layer 'fc' produced no activation"]
    code, err = _run(bug, [])
    assert code == 1 and len(_errors(err)) == 1 and "KeyError" in err and "--debug" in err
    assert "Traceback" not in err
    with pytest.raises(KeyError):
        _run(bug, ["--debug"])
    with pytest.raises(ConfigError):
        _run(config, [], env={"DATTRI_DS_DEBUG": "1"})
    assert _run(ok, ["--a", "--debug"]) == (0, "")


def test_dattri_ds_command_usage_errors():
    """``dattri-ds <unknown>`` and a tool's argparse error exit 2 with one line."""
    from dattri_ds.tools.cli import main

    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["bogus"]) == 2
    assert len(_errors(err.getvalue())) == 1 and "bogus" in err.getvalue()
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["report", "--no-such-flag"]) == 2
    assert len(_errors(err.getvalue())) == 1 and "--attribution" in err.getvalue()


def test_select_is_named_curate():
    """Offline selection has one name, ``dattri-ds curate``: ``dattri-ds select`` (its old
    name, in older READMEs) is one usage line naming it, exit 2, and runs nothing."""
    from dattri_ds.tools.cli import COMMANDS, main

    assert "curate" in COMMANDS and "select" not in COMMANDS
    for argv in (["select"], ["select", "--store", "s", "--out", "o"], ["select", "--help"]):
        err = io.StringIO()
        with redirect_stderr(err):
            assert main(argv) == 2
        assert _errors(err.getvalue()) == [
            "dattri-ds: error: 'dattri-ds select' is now 'dattri-ds curate' (same flags; see "
            "dattri-ds curate --help)"], err.getvalue()


def test_scripts_print_one_line_and_exit_2(tmp_path):
    """``python launch/train.py`` with a bad flag and ``python tools/collect.py`` on a folder
    that is not a run: exit 2, one error line naming the flag/key or the folder, no
    traceback; with --debug the traceback is shown."""
    cmd = [sys.executable, str(ROOT / "launch/train.py"), "--deepspeed_config",
           str(ROOT / "configs/zero2_cpu.json"), "--steps", "2.5", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = _errors(p.stderr)
    assert len(lines) == 1 and "--steps" in lines[0] and "dattri_ds.train.steps" in lines[0]
    assert "Traceback" not in p.stderr
    p = subprocess.run(cmd + ["--debug"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0 and "Traceback" in p.stderr and "UsageError" in p.stderr
    cmd = [sys.executable, str(ROOT / "tools/collect.py"), "--run", str(tmp_path / "nope"),
           "--data", str(ROOT / "data/tiny/train.jsonl"), "--out", str(tmp_path / "s")]
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    lines = _errors(p.stderr)
    assert p.returncode == 2 and len(lines) == 1 and "nope" in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_run_without_config_or_trajectory_is_an_error_naming_file_and_flag(tmp_path):
    """No stand-ins: a run folder without resolved_dattri_ds_config.json has no seq_len
    (was 128), without trajectory.json no learning rates (was lr = 1 for every
    checkpoint); both are errors naming the file and --run."""
    from dattri_ds.tools.sources import Run

    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    (tmp_path / "tokenizer.model").write_bytes(b"x")
    (tmp_path / "checkpoints/step2").mkdir(parents=True)
    r = Run.open(tmp_path)
    with pytest.raises(ConfigError, match=r"resolved_dattri_ds_config\.json is missing.*--run"):
        r.seq_len
    with pytest.raises(ConfigError, match=r"trajectory\.json is missing.*--run"):
        r.trajectory()
    (tmp_path / "resolved_dattri_ds_config.json").write_text(json.dumps({"train": {}}))
    with pytest.raises(ConfigError, match=r"train\.seq_len = None"):
        r.seq_len
    (tmp_path / "resolved_dattri_ds_config.json").write_text('{"train": {"seq_len": 16},}')
    with pytest.raises(ConfigError, match=r"resolved_dattri_ds_config\.json:1:\d+: invalid JSON"):
        r.seq_len
    (tmp_path / "resolved_dattri_ds_config.json").write_text('{"train": {"seq_len": 16}}')
    assert r.seq_len == 16
    (tmp_path / "trajectory.json").write_text(json.dumps({"checkpoints": [{"tag": "step2"}]}))
    with pytest.raises(ConfigError, match=r"trajectory\.json: 'checkpoints' must be"):
        r.trajectory()
    want = [{"tag": "step2", "step": 2, "lr": 0.01}]
    (tmp_path / "trajectory.json").write_text(json.dumps({"checkpoints": want}))
    assert r.trajectory() == want
