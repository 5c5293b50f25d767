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


def test_headline_snippet_runs():
    """The headline block ("What you can do with it") runs on a tiny GPT-2: grad-dot scores
    [N, Q], EK-FAC influence through a Spill equals EK-FAC over a list of the batches, and
    the hooks' GradBatch holds the micro-batch."""
    require("transformers", "hf")
    import torch
    from reference import rel_err, tiny_gpt2

    from dattri_ds import CaptureConfig, collect, fit_factors, make_attributor

    model = tiny_gpt2(seed=0, n_layer=1, n_embd=8, vocab=31, n_positions=16)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 31, (6, 8), generator=gen)
    batches = lambda rows: [{"input_ids": rows[i:i + 2], "labels": rows[i:i + 2]}  # noqa: E731
                            for i in range(0, rows.shape[0], 2)]
    ns = {"model": model, "train_batches": batches(ids[:4]), "query_batches": batches(ids[4:]),
          "x": ids[:2], "y": ids[:2], "m": torch.ones_like(ids[:2])}
    exec(compile(_block("## What you can do with it"), "README", "exec"), ns)
    assert ns["scores"].shape == (4, 2)
    listed = list(collect(model, batches(ids[:4]), CaptureConfig()))
    want = make_attributor("ekfac", factors=fit_factors(listed)).scores(listed, ns["query"])
    assert rel_err(ns["influence"], want.values) <= 1e-6
    assert ns["grads"].batch_size == 2


def _doc_blocks(path: str, heading: str) -> list[str]:
    text = (README.parent / path).read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_trainer_selection_snippets_run(tmp_path, monkeypatch):
    """docs/integrations.md "Online selection under Trainer" (the README points there): the
    example trains 2 steps choosing 2 of every 4 candidates (4 chosen in all), and the
    piece-by-piece selector (probe, ValidationTarget, OnlineSelector) chooses what
    ``OnlineSelector.for_target_data`` chooses on the same candidates."""
    require("transformers", "hf")
    import torch

    monkeypatch.chdir(tmp_path)
    example, pieces = _doc_blocks("docs/integrations.md", "## Online selection under Trainer")
    out, ns = io.StringIO(), {"__name__": "readme"}
    with contextlib.redirect_stdout(out):
        exec(compile(example, "integrations.md", "exec"), ns)
    assert out.getvalue().strip().splitlines()[-1] == "4"
    exec(compile(pieces, "integrations.md", "exec"), ns)
    from dattri_ds.selection import OnlineSelector

    model, config, target = ns["model"], ns["config"], ns["target"]
    whole = OnlineSelector.for_target_data(model, config, {"input_ids": target,
                                                           "labels": target})
    cands = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": cands, "labels": cands}
    a, b = (s.select(batch, 2, 0) for s in (ns["selector"], whole))
    assert a.indices.numel() == 2 and a.indices.tolist() == b.indices.tolist()
