"""tools/gpu_check.sh --dry-run: the GPU script's steps on CPU at tiny sizes, as CI runs it.

Invariants: every step of the dry run passes (the GPU tests are collected; the skip guard
reports CUDA tests that skip as a failure; the throughput ladder, the launch step variants
including the bare DeepSpeed loop, and the planner calibration run) and the script prints one
Markdown table with a row per launch variant and per ladder measurement, the planner beside
each. Breaks if a step of the GPU script rots where no GPU runs it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from _deps import require

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_gpu_check_dry_run(tmp_path):
    require("deepspeed", "deepspeed")
    env = {**os.environ, "OUT": str(tmp_path / "gc"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    table = (tmp_path / "gc/table.md").read_text().splitlines()
    assert table[1].startswith("| check | measured | planner |")
    assert sum(line.startswith("|") for line in table) == len(table) - 1  # one table
    for v in ("plain", "capture", "content", "alignment", "bare"):
        row = next(line for line in table if line.startswith(f"| launch {v} |"))
        assert "s/step" in row and "MFU" in row, row
    assert any(line.startswith("| collect tiny") for line in table)
    assert not any("FAILED" in line for line in table)
