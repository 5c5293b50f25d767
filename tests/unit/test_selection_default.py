"""The default selection score: the content prior for document targets, the gradient otherwise.

Invariants: ``SelectionConfig.score`` left unset resolves, when the config is built, to
``"content"`` (target documents) or to ``"alignment"`` (a gradient store, or any setting only
the gradient path reads, ``PROBE_SETTINGS``, or a policy that reads the scores' scale); an
explicit score is kept; the resolved name is what the resolved config, the flags, the
selector summary and the step-plan line show; the defaults raise no warning and no error.
Breaks if the default goes back to the probe, or a probe-only knob set without ``score``
silently runs the content score (which ignores it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

from dattri_ds import ProjectionConfig
from dattri_ds.selection import OnlineSelector, SelectionConfig
from dattri_ds.selection.config import PROBE_SETTINGS
from reference import tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]

#: One non-default value of every probe-only setting (each alone resolves to alignment).
PROBE_VALUES = {
    "target_store": "grads", "shortlist": 1.5, "precondition": "adam", "contrast": 0.5,
    "content_weight": 0.0, "smooth_neighbors": None, "smooth_memory": 64, "top_blocks": 1,
    "include": ("lm_head",), "projection": ProjectionConfig(dim=8), "probe_autocast": "bfloat16",
    "per_token": False, "normalize": False, "refresh_every": 5, "target_batch_size": 4,
    "reuse_forward": "off", "validation_fraction": 0.2, "controller": True}
NEEDS = {"target_store": {"projection": ProjectionConfig(dim=8)},
         "controller": {"validation_fraction": 0.2}}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n, 10), generator=torch.Generator().manual_seed(seed))


def test_default_is_content_for_documents():
    """Unset score with target documents (or no target named yet): content, no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SelectionConfig().score == "content"
        assert SelectionConfig(enabled=True, target_data="t.jsonl").score == "content"
        for policy in ("topk", "fraction", "soft"):  # ranking policies keep it
            assert SelectionConfig(policy=policy).score == "content"
    assert SelectionConfig.from_dict({"target_data": "t.jsonl"}).score == "content"


def test_probe_settings_name_fields_and_each_implies_alignment():
    """Every PROBE_SETTINGS name is a field; each one set alone (with what it needs) resolves
    the score to alignment, and ``probe_settings`` names it."""
    names = {f.name for f in dataclasses.fields(SelectionConfig)}
    assert set(PROBE_SETTINGS) <= names and set(PROBE_VALUES) == set(PROBE_SETTINGS)
    for key, value in PROBE_VALUES.items():
        cfg = SelectionConfig(**{**NEEDS.get(key, {}), key: value})
        assert cfg.score == "alignment", key
        assert key in cfg.probe_settings(), key
    for policy in ("threshold", "greats"):  # they read the scores' own scale
        cfg = SelectionConfig(policy=policy)
        assert cfg.score == "alignment" and cfg.probe_settings() == ["policy"]


def test_store_target_resolves_to_alignment():
    """A gradient store has no text: its default is the gradient score."""
    cfg = SelectionConfig(target_store="grads", projection=ProjectionConfig(dim=8))
    assert cfg.score == "alignment"


def test_explicit_score_is_kept_and_replace_keeps_the_resolved_one():
    """An explicit score wins over the rule; ``dataclasses.replace`` keeps a resolved score,
    and ``score=None`` resolves it again."""
    assert SelectionConfig(score="alignment").score == "alignment"
    assert SelectionConfig(score="step").score == "step"
    assert SelectionConfig(score="content", refresh_every=5).score == "content"
    cfg = SelectionConfig(target_data="t.jsonl")
    assert dataclasses.replace(cfg, top_blocks=1).score == "content"
    assert dataclasses.replace(cfg, top_blocks=1, score=None).score == "alignment"


def test_default_selector_runs_no_probe_and_reports_its_score(caplog):
    """The default selector on target documents: content score, no probe pass, the summary
    and the plan line name the score; the same with score='alignment' probes and says so.
    The default smoothing (16 neighbours) does not apply to content and warns nothing."""
    model = tiny_gpt2(seed=2)
    docs = {"input_ids": _ids(4, 1), "labels": _ids(4, 1)}
    batch = {"input_ids": _ids(8, 2), "labels": _ids(8, 2)}
    caplog.set_level(logging.INFO, logger="dattri_ds.selection.online")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sel = OnlineSelector.for_target_data(model, SelectionConfig(enabled=True), docs)
        calls = []
        raw = sel.probe.probe
        sel.probe.probe = lambda *a, **kw: calls.append(1) or raw(*a, **kw)
        sel.select(batch, k=4, step=0)
    assert calls == [] and sel._rankers == [] and sel.plan.ratio() == 1.0
    assert sel.summary()["score"] == "content" and sel.summary()["target_refreshes"] == 0
    sel.close()
    assert "score 'content' (the target's n-grams, no probe)" in caplog.text
    assert "forward reuse off (no probe forward to reuse)" in caplog.text
    caplog.clear()
    grad = OnlineSelector.for_target_data(model, SelectionConfig(enabled=True,
                                                                 score="alignment"), docs)
    grad.select(batch, k=4, step=0)
    assert grad.summary()["score"] == "alignment" and grad.summary()["target_refreshes"] == 1
    assert grad.plan.ratio() > 1.5
    grad.close()
    assert "score 'alignment' (" in caplog.text and "layers" in caplog.text


def test_content_without_documents_names_the_fix():
    """The default content score on a gradient-only target (no documents) fails at
    construction, naming score='alignment' as the fix."""
    from dattri_ds.errors import ConfigError
    from dattri_ds.selection.scorer import score_for

    with pytest.raises(ConfigError, match="set selection.score='alignment'"):
        score_for(SelectionConfig(), documents=None)


def test_resolved_config_and_flags_record_the_score(tmp_path):
    """The launch config resolves the score from the JSON block and the flags:
    ``--online-selection --target-data`` -> content, ``--selection-score alignment`` ->
    alignment, a probe-only flag alone -> alignment; the resolved JSON records the name."""
    from dattri_ds.launch.args import parse_args
    from dattri_ds.launch.config import dump_json, load_run_config

    cfg = json.loads((ROOT / "configs/zero0_cpu.json").read_text())
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    base = ["--deepspeed_config", str(path), "--online-selection", "--target-data", "t.jsonl"]
    want = {(): "content", ("--selection-score", "alignment"): "alignment",
            ("--selection-shortlist", "1.5"): "alignment",
            ("--selection-precondition", "adam"): "alignment",
            ("--selection-contrast", "0.5"): "alignment",
            ("--selection-score", "content", "--refresh-every", "5"): "content"}
    for extra, score in want.items():
        _, run = load_run_config(path, parse_args([*base, *extra]).overrides)
        assert run.selection.score == score, extra
        dump_json(tmp_path / "resolved.json", run)
        resolved = json.loads((tmp_path / "resolved.json").read_text())
        assert resolved["selection"]["score"] == score, extra
