"""README snippets run as written.

Invariant: the code block of each integration section of README.md executes (in a fresh
folder) and prints what its comments say.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from _deps import require

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(heading: str) -> str:
    text = README.read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_hf_trainer_snippet_runs(tmp_path, monkeypatch):
    """The Hugging Face Trainer / collect snippet stores 16 rows and scores [16, 6]."""
    require("transformers", "hf")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_block("## Hugging Face Trainer, TRL and the collect API"), "README", "exec"),
             {"__name__": "readme"})
    assert "torch.Size([16, 6])" in out.getvalue()
