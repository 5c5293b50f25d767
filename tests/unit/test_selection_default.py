"""The selection score is an explicit setting: ``content`` by default, ``alignment`` asked for.

Invariants: ``SelectionConfig.score`` defaults to ``"content"`` and is never switched
silently: a setting only the gradient score reads (``GRADIENT_SETTINGS``, a target store
among them), given with the content score, is a one-line ConfigError naming the flag given
and ``--selection-score alignment``; with ``score="alignment"`` each is accepted. The score
is what the resolved config, the selector summary and the step-plan line show; the defaults
raise no warning and no error. Breaks if the default goes back to the probe, or a
gradient-only knob given without the gradient score runs silently (ignored, or switching
the run to an 8x-cost step).
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
from dattri_ds.errors import ConfigError
from dattri_ds.selection import OnlineSelector, SelectionConfig
from dattri_ds.selection.config import GRADIENT_SETTINGS
from reference import tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]

#: One non-default value of every gradient-only setting, and the flag its error names.
GRADIENT_VALUES = {
    "target_store": ("grads", "--selection-target-store grads"),
    "shortlist": (1.5, "--selection-shortlist 1.5"),
    "content_weight": (0.0, "--selection-content-weight 0.0"),
    "smooth_neighbors": (None, "--selection-smooth-neighbors null"),
    "smooth_memory": (64, "--selection-smooth-memory 64"),
    "top_blocks": (1, "--selection-top-blocks 1"),
    "include": (("lm_head",), "--selection-include lm_head"),
    "projection": (ProjectionConfig(dim=8), "--selection-projection-dim 8"),
    "per_token": (False, "--selection-per-token false"),
    "normalize": (False, "--selection-normalize false"),
    "refresh_every": (5, "--selection-refresh-every 5"),
    "target_batch_size": (4, "--selection-target-batch-size 4"),
    "reuse_forward": ("off", "--selection-reuse-forward off")}
NEEDS = {"target_store": {"projection": ProjectionConfig(dim=8)}}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n, 10), generator=torch.Generator().manual_seed(seed))


def test_default_is_content():
    """No score given: content, no warning, whatever the target."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SelectionConfig().score == "content"
        assert SelectionConfig(enabled=True, target_data="t.jsonl").score == "content"
        assert SelectionConfig(uniform_mix=0.25, candidate_multiple=4).score == "content"
    assert SelectionConfig.from_dict({"target_data": "t.jsonl"}).score == "content"


def test_gradient_settings_with_content_name_the_flag_and_the_fix():
    """Every gradient-only setting, given alone with the content score, is one ConfigError
    line naming its flag and ``--selection-score alignment``; with the alignment score the
    same setting is accepted and kept."""
    names = {f.name for f in dataclasses.fields(SelectionConfig)}
    assert set(GRADIENT_SETTINGS) <= names and set(GRADIENT_VALUES) == set(GRADIENT_SETTINGS)
    for key, (value, flag) in GRADIENT_VALUES.items():
        with pytest.raises(ConfigError) as got:
            SelectionConfig(**{**NEEDS.get(key, {}), key: value})
        msg = str(got.value)
        assert msg.startswith(flag) and "--selection-score alignment" in msg, (key, msg)
        assert "\n" not in msg and "selection." not in msg, msg  # one line, flags not keys
        cfg = SelectionConfig(score="alignment", **{**NEEDS.get(key, {}), key: value})
        assert getattr(cfg, key) == value and key in cfg.gradient_settings(), key


def test_explicit_score_is_kept_by_replace():
    """``dataclasses.replace`` keeps the score given; a gradient setting added to a content
    config is refused, not a switch of score."""
    cfg = SelectionConfig(target_data="t.jsonl")
    with pytest.raises(ConfigError, match="--selection-top-blocks 1"):
        dataclasses.replace(cfg, top_blocks=1)
    grad = dataclasses.replace(cfg, score="alignment", top_blocks=1)
    assert grad.score == "alignment" and dataclasses.replace(grad, top_blocks=None).score \
        == "alignment"


def test_default_selector_runs_no_probe_and_reports_its_score(caplog):
    """The default selector on target documents: content score, no probe pass, the summary
    and the plan line name the score; the same with score='alignment' probes and says so.
    The gradient settings' defaults (16 neighbours of smoothing) warn nothing."""
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
    assert calls == [] and sel.rankers == [] and sel.plan.ratio() == 1.0
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
    construction, naming --selection-score alignment as the fix."""
    from dattri_ds.selection.scorer import score_for

    with pytest.raises(ConfigError, match="set --selection-score alignment"):
        score_for(SelectionConfig(), documents=None)


def test_resolved_config_and_flags_record_the_score(tmp_path):
    """Through launch's flags: ``--online-selection --target-data`` -> content,
    ``--selection-score alignment`` -> alignment (with gradient flags too), and the resolved
    JSON records it; a gradient flag without the score is refused naming that flag."""
    from dattri_ds.launch.args import load_run_config, parse_args
    from dattri_ds.launch.config import dump_json

    cfg = json.loads((ROOT / "configs/zero0_cpu.json").read_text())
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    base = ["--deepspeed_config", str(path), "--online-selection", "--target-data", "t.jsonl"]
    want = {(): "content", ("--selection-score", "alignment"): "alignment",
            ("--selection-score", "alignment", "--selection-shortlist", "1.5"): "alignment",
            ("--selection-score", "alignment", "--refresh-every", "5"): "alignment"}
    for extra, score in want.items():
        _, run = load_run_config(path, parse_args([*base, *extra]).overrides)
        assert run.selection.score == score, extra
        dump_json(tmp_path / "resolved.json", run)
        resolved = json.loads((tmp_path / "resolved.json").read_text())
        assert resolved["selection"]["score"] == score, extra
    for extra in (("--selection-top-blocks", "1"), ("--selection-shortlist", "1.5")):
        with pytest.raises(ConfigError, match=f"{extra[0]} {extra[1]} .*--selection-score "
                                              f"alignment"):
            load_run_config(path, parse_args([*base, *extra]).overrides)
