"""Shared helpers of the door fuzz tests: run a command line through the CLI error path and
classify what a user would see.

A case is *clear* when the command exits non-zero with exactly one ``dattri-ds: error:``
line that names the needle (the file, key or flag at fault), no traceback and no raw
exception class from outside dattri_ds (``\\b[A-Z][A-Za-z]*Error:``); *raw* when it fails
any other way; *silent* when it exits 0 (accepted).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections import Counter
from contextlib import redirect_stderr
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAW = re.compile(r"\b[A-Z][A-Za-z]*(?:Error|Exception):")
PREFIX = "dattri-ds: error: "
#: The environment of a subprocess case: offline, CPU, the debug switch off.
ENV = {**{k: v for k, v in os.environ.items() if k != "DATTRI_DS_DEBUG"},
       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
       "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(ROOT),
       "PYTHONDONTWRITEBYTECODE": "1"}  # under a file-size limit Python installs a cut .pyc


def classify(code: int, stderr: str, needle: str) -> str:
    """``clear``, ``raw`` or ``silent`` (see the module docstring)."""
    if code == 0:
        return "silent"
    lines = [ln for ln in stderr.splitlines() if ln.startswith(PREFIX)]
    if (len(lines) != 1 or "Traceback" in stderr or RAW.search(lines[0])
            or "(unexpected;" in lines[0] or needle not in lines[0]):
        return "raw"
    return "clear"


def in_process(main, argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of ``main(argv)`` through ``dattri_ds.cli.exits.run``, debug off."""
    from dattri_ds.cli.exits import run

    os.environ.pop("DATTRI_DS_DEBUG", None)
    err = io.StringIO()
    with redirect_stderr(err):
        code = run(main, argv)
    return code, err.getvalue()


def subprocess_cli(argv: list[str], *, timeout: float = 300, preexec_fn=None,
                   cwd: Path = ROOT) -> tuple[int, str]:
    """(exit code, stderr) of ``python <argv>`` in a fresh interpreter, debug off."""
    proc = subprocess.run([sys.executable, *argv], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=preexec_fn)
    return proc.returncode, proc.stderr


def tally(results: list[tuple[str, str, str]]) -> str:
    """``N cases, N clear, N raw, N silent`` of ``(case, verdict, stderr)`` results."""
    c = Counter(v for _, v, _ in results)
    return (f"{len(results)} cases, {c['clear']} clear, {c['raw']} raw, "
            f"{c['silent']} silent")


def failures(results: list[tuple[str, str, str]]) -> list[str]:
    return [f"{name}: {verdict}: {err.strip()[-400:]!r}" for name, verdict, err in results
            if verdict != "clear"]
