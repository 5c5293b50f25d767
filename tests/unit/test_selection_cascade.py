"""The cascade (selection/cascade.py, ``selection.shortlist``): content prior first, probe second.

Invariants: the shortlist is the top ``ceil(shortlist * n)`` candidates by content prior
(``n = k - round(uniform_mix * k)``; ties to the lower index); the cascade's choice equals
the full selector's choice run on the shortlisted candidates alone (same rank stages, same
policy, the same stream counts); only the shortlist is probed, and its scores equal the
per-example autograd cosine; the uniform share comes from all candidates; the step-cost
model predicts every mode; settings the cascade cannot serve fail at start.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.selection import OnlineSelector, SelectionConfig
from dattri_ds.selection.cascade import (
    Cascade, needed, shortlist_size,
)
from dattri_ds.selection.policy import top_k
from dattri_ds.selection.smoothing import CandidateText
from dattri_ds.selection.stepcost import StepCost
from reference import reference_grads, rel_err, tiny_gpt2

T = 8


def _batch(ids: torch.Tensor) -> dict:
    return {"input_ids": ids, "labels": ids}


def _docs(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n, T), generator=torch.Generator().manual_seed(seed))


class _FixedPrior:
    """A content prior with hand-made scores (counts ignored)."""

    def __init__(self, values):
        self.values = torch.tensor(values, dtype=torch.float32)

    def scores_of_counts(self, counts):
        return self.values.clone()


def test_shortlist_on_hand_made_content():
    """S = min(C, ceil(multiple * n)); the top S by content, ties to the lower index; the
    shortlist's text carries its content scores and counts."""
    assert needed(8, 32, 0.5) == 4 and needed(8, 32, 0.0) == 8 and needed(8, 5, 0.5) == 3
    assert shortlist_size(1.5, 8, 32, 0.5) == 6
    assert shortlist_size(1.0, 8, 32, 0.5) == 4
    assert shortlist_size(1.25, 8, 32, 0.5) == 5  # ceil(5.0) stays 5
    assert shortlist_size(3.0, 8, 10, 0.0) == 10  # capped at C
    content = torch.tensor([0.1, 0.9, 0.5, 0.9, -1.0, 0.5])
    assert top_k(content, 3).tolist() == [1, 2, 3]  # 0.9, 0.9, then the first 0.5
    ids = torch.arange(6 * T).view(6, T) % 97
    text = CandidateText(ids)
    cascade = Cascade(1.5, 0.5, _FixedPrior(content.tolist()))
    pos, sub = cascade(text, 4)  # n = 2, S = 3
    assert pos.tolist() == [1, 2, 3]
    assert torch.equal(sub.content, content[pos])
    assert torch.equal(sub.ids, ids[pos]) and torch.equal(sub.counts, text.counts[pos])
    pos, _ = cascade(text, 2)  # n = 1, S = 2
    assert pos.tolist() == [1, 3]
    assert cascade.summary()["probed"] == 5 and cascade.summary()["candidates"] == 12


def _selector(model, tgt, **over):
    cfg = SelectionConfig(enabled=True, score="alignment", per_token=False, refresh_every=100,
                          **over)
    return OnlineSelector.for_target_data(model, cfg, _batch(tgt))


@pytest.mark.parametrize("mix", [0.0, 0.5, 0.25])
def test_cascade_choice_equals_full_selector_on_the_shortlist(mix):
    """Over three steps: the cascade's policy picks equal the full selector's choice on the
    shortlisted candidates alone (its content stream fed the other candidates too, as the
    cascade's prior saw all); the uniform share is drawn from the rest of all candidates."""
    model, tgt = tiny_gpt2(seed=0), _docs(6, 7)
    tgt[:, :4] = tgt[0, :4]  # the target shares a phrase that some candidates hold
    k, c = 4, 12
    cas = _selector(model, tgt, shortlist=1.5, uniform_mix=mix, smooth_neighbors=3)
    ref = _selector(model, tgt, uniform_mix=0.0, smooth_neighbors=3)
    n = needed(k, c, mix)
    prior = ref.rankers[-1].prior  # the ContentRanking stage's prior
    for step in range(3):
        ids = _docs(c, 100 + step)
        ids[::3, :4] = tgt[0, :4]
        sel = cas.select(_batch(ids), k, step)
        short = sel.probed
        assert short.numel() == math.ceil(1.5 * n)
        rest = torch.ones(c, dtype=torch.bool)
        rest[short] = False
        prior.scores_of_counts(CandidateText(ids[rest]).counts)  # the stream saw them too
        want = ref.select(_batch(ids[short]), n, step)
        picked = short[want.indices]
        assert set(picked.tolist()) <= set(sel.indices.tolist())
        assert sel.indices.numel() == k
        assert torch.allclose(sel.scores, want.scores, atol=1e-6)
        others = [i for i in sel.indices.tolist() if i not in picked.tolist()]
        assert len(others) == k - n
        assert all(math.isnan(float(sel.chosen_scores[sel.indices.tolist().index(i)]))
                   for i in others if i not in short.tolist())
    cas.close()
    ref.close()


def test_shortlisted_scores_equal_autograd_cosine():
    """Only the shortlist is probed; its scores are the per-example autograd cosine with the
    mean target gradient (<= 1e-5 fp32); the shortlist is the top content-prior candidates."""
    from dattri_ds.selection.content import ContentPrior

    model, tgt = tiny_gpt2(seed=0), _docs(6, 7)
    ids = _docs(16, 40)
    ids[:5, :5] = tgt[:5, :5]
    sel_ = _selector(model, tgt, shortlist=2.0, uniform_mix=0.5, smooth_neighbors=None,
                     content_weight=0.0)
    calls = []
    raw = sel_.probe.probe
    sel_.probe.probe = lambda fwd, **kw: calls.append(1) or raw(fwd, **kw)
    sel = sel_.select(_batch(ids), 4, 0)
    sel_.close()
    short = sel.probed
    assert short.numel() == 4  # ceil(2.0 * 2)
    content = ContentPrior({"input_ids": tgt}).scores(ids, torch.ones_like(ids))
    assert short.tolist() == top_k(content, 4).tolist()
    rc = reference_grads(model, ids[short])
    rt = reference_grads(model, tgt)
    flat = torch.cat([rc[n] for n in rc], 1)
    want = sum(rc[n] @ rt[n].mean(0) for n in rc) / flat.norm(dim=1)
    assert rel_err(sel.scores, want) <= 1e-5
    assert len(calls) == 2  # the target refresh and one probe of the shortlist


def test_step_cost_modes_and_plan_line(caplog):
    """Every mode's predicted ratio on hand-picked sizes (k=8, C=32, s=1, cosine, S=6): full
    probe (32*4 + 24)/24, cascade (6*4 + 24)/24 = 2; the most a 1.5x cascade probes is 3;
    the selector's plan probes S and names each mode."""
    plan = StepCost(candidates=32, trained=8, share=1.0, normalize=True, target_examples=0,
                    refresh_every=10, probed=6)
    assert plan.per_probed() == 4.0
    modes = plan.modes()
    assert modes == {"uniform": 1.0, "content": 1.0, "cascade S=6": pytest.approx(2.0),
                     "full probe": pytest.approx(152 / 24)}
    assert plan.ratio() == pytest.approx(2.0)
    assert plan.shortlist_within(1.5) == 3 and plan.shortlist_within(1.0) == 0
    assert plan.shortlist_within(100.0) == 32
    model, tgt = tiny_gpt2(seed=0), _docs(6, 7)
    sel = _selector(model, tgt, shortlist=1.5, candidate_multiple=4.0)
    with caplog.at_level(logging.INFO, logger="dattri_ds.selection.online"):
        sel.select(_batch(_docs(16, 3)), 4, 0, train_loss=True)
    sel.close()
    assert sel.plan.probed == 3 and sel.scorer.reuse is False
    line = " ".join(r.getMessage() for r in caplog.records)
    assert "cascade S=3" in line and "full probe" in line and "uniform 1.00x" in line


def test_cascade_log_and_summary(tmp_path):
    """The log names the probed positions and leaves the unprobed chosen scores empty; the
    summary reports the share of candidates probed."""
    from dattri_ds.selection import read_selection_log

    model, tgt = tiny_gpt2(seed=0), _docs(6, 7)
    cfg = SelectionConfig(enabled=True, score="alignment", shortlist=1.0, uniform_mix=0.5)
    sel = OnlineSelector.for_target_data(model, cfg, _batch(tgt),
                                         log_path=tmp_path / "selection.jsonl")
    got = sel.select(_batch(_docs(8, 5)), 4, 0)
    summary = sel.summary()
    sel.close()
    rec = read_selection_log(tmp_path / "selection.jsonl")[0]
    assert rec["probed"] == got.probed.tolist() and len(rec["candidate_scores"]) == 2
    assert sum(s is None for s in rec["chosen_scores"]) >= 1
    assert summary["cascade"]["probed_share"] == pytest.approx(2 / 8)


def test_bad_cascade_settings_fail_at_start():
    """Each refused setting names the value and the fix."""
    a = {"score": "alignment"}
    with pytest.raises(ConfigError, match=r"shortlist=0.5 .*shortlist >= 1"):
        SelectionConfig(shortlist=0.5, **a)
    with pytest.raises(ConfigError, match="--selection-shortlist 1.5 .*--selection-score "
                                          "alignment"):
        SelectionConfig(shortlist=1.5, score="content")
    with pytest.raises(ConfigError, match="target_store"):
        SelectionConfig(shortlist=1.5, target_store="x", projection={"dim": 8}, **a)
    with pytest.raises(ConfigError, match="reuse_forward"):
        SelectionConfig(shortlist=1.5, reuse_forward="on", **a)
    with pytest.raises(ConfigError, match="uniform_mix=1"):
        SelectionConfig(shortlist=1.5, uniform_mix=1.0, **a)
    with pytest.raises(ConfigError):
        SelectionConfig(shortlist=0, **a)
    assert SelectionConfig.from_dict({"shortlist": 1.5, **a}).shortlist == 1.5
