"""The staged selection step: a new scoring rule is one class, stages carry their properties.

Invariants: a ``Score`` registered in this file (one class, plus its name in a config's
``score`` Literal) runs through ``OnlineSelector`` unchanged and chooses what a hand
computation on per-example autograd gradients chooses; the rank stages compose in order;
``build_target`` keeps the target's documents and gradient apart; each arm is a list of
stage objects folding a ``StepState``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.ops import cross_gram, sq_norms
from dattri_ds.selection import OnlineSelector, SelectionConfig
from dattri_ds.selection.content import ContentRanking, with_content
from dattri_ds.selection.rank import CandidateText, rankers
from dattri_ds.selection.scorer import SCORES, Score
from dattri_ds.selection.smoothing import NeighborSmoother, ngram_features
from dattri_ds.selection.target import ValidationTarget, build_target
from reference import reference_grads, rel_err, tiny_gpt2


class NegSqDistance(Score, name="neg_sq_distance"):
    """Toy rule: ``-|g_b - g_t|^2 = -(|g_b|^2 - 2 <g_b, g_t> + |g_t|^2)`` (ghost products)."""

    def __call__(self, grads, rows, *, text):
        names = list(rows.layers)
        u = cross_gram(grads, rows, layers=names, cost=self.cost)[:, 0]
        tt = cross_gram(rows, rows, layers=names, cost=self.cost)[0, 0]
        return -(sq_norms(grads, names, self.cost) - 2 * u + tt)


@dataclass(frozen=True, kw_only=True)
class ToyConfig(SelectionConfig):
    """The one other edit a new rule needs: its name in ``score``'s Literal."""

    score: Literal["alignment", "neg_sq_distance"] = "neg_sq_distance"


PLAIN = dict(per_token=False, uniform_mix=0.0, smooth_neighbors=None, content_weight=0.0)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n, 10), generator=torch.Generator().manual_seed(seed))


def test_toy_score_runs_through_the_selector():
    """The registered toy rule's scores equal -|g_b - mean g_target|^2 from per-example
    autograd (<= 1e-5) and the choice is their top-k."""
    model = tiny_gpt2(seed=3)
    tgt, cand = _ids(5, 1), _ids(6, 2)
    sel = OnlineSelector.for_target_data(model, ToyConfig(**PLAIN),
                                         {"input_ids": tgt, "labels": tgt})
    assert isinstance(sel.rule, NegSqDistance)
    out = sel.select({"input_ids": cand, "labels": cand}, k=3, step=0)
    sel.close()
    rc, rt = reference_grads(model, cand), reference_grads(model, tgt)
    flat_c = torch.cat([rc[n] for n in rc], 1).double()
    flat_t = torch.cat([rt[n].mean(0) for n in rc]).double()
    want = -((flat_c - flat_t) ** 2).sum(1)
    assert rel_err(out.scores.double(), want) <= 1e-5
    assert out.indices.tolist() == sorted(torch.topk(want, 3).indices.tolist())
    assert all(p.grad is None for p in model.parameters())


def test_a_new_rule_is_one_class_and_one_literal_value():
    """The registry lists the toy rules; the shipped config refuses their names (its Literal
    does not hold them); an unknown rule's lookup names the registered ones."""
    assert {"alignment", "content", "neg_sq_distance"} <= set(SCORES.names())
    with pytest.raises(ConfigError, match="selection.score"):
        SelectionConfig(score="neg_sq_distance")
    with pytest.raises(ConfigError, match="registered: .*alignment"):
        SCORES.lookup("nope")


def test_rank_stages_compose_in_order():
    """``rankers`` = [smoothing, content]; running them equals content on smoothed scores."""
    cfg = SelectionConfig(score="alignment", smooth_neighbors=2, content_weight=1.5)
    docs = {"input_ids": _ids(4, 5)}
    stages = rankers(cfg, 1.5, docs)
    assert [type(s) for s in stages] == [NeighborSmoother, ContentRanking]
    cand = _ids(6, 6)
    scores = torch.linspace(-1, 1, 6)
    got = scores
    text = CandidateText(cand)
    for stage in stages:
        got = stage(got, text)
    ones = torch.ones_like(cand)
    smoothed = NeighborSmoother(2, 1024).smooth_features(ngram_features(cand, ones), scores)
    want = with_content(smoothed, ContentRanking(docs, 1.5).prior.scores(cand, ones), 1.5)
    assert torch.allclose(got, want)
    assert rankers(SelectionConfig(score="alignment", smooth_neighbors=None), 0.0, None) == []


def test_build_target_keeps_documents_and_gradient_apart():
    """The documents are the target's model inputs and the gradient a ValidationTarget on
    them; a store target has a gradient and no documents."""
    model = tiny_gpt2(seed=1)
    cfg = SelectionConfig(score="alignment")
    probe = OnlineSelector.probe_capture(model, cfg)
    docs = {"input_ids": _ids(6, 7), "labels": _ids(6, 7)}
    t = build_target(cfg, model, docs, probe=probe)
    probe.detach()
    assert isinstance(t.gradient, ValidationTarget) and t.documents is docs
    assert torch.equal(t.gradient.data["input_ids"], docs["input_ids"])


def test_each_arm_is_a_list_of_stages():
    """gradient: [Shortlist (with shortlist), Probe, Rank, Choose, Log]; content:
    [TextScore, Rank, Choose, Log]; uniform: [Uniform, Log]. The step state is folded
    through them: the selector keeps nothing about a step between calls."""
    from dataclasses import fields

    from dattri_ds.selection.stages import (
        Choose, Log, Probe, Rank, Shortlist, StepState, TextScore, Uniform,
    )

    model = tiny_gpt2(seed=2)
    docs = {"input_ids": _ids(4, 8), "labels": _ids(4, 8)}
    want = {(("score", "alignment"),): [Probe, Rank, Choose, Log],
            (("score", "alignment"), ("shortlist", 1.5)): [Shortlist, Probe, Rank, Choose, Log],
            (): [TextScore, Rank, Choose, Log], (("random", True),): [Uniform, Log]}
    for kw, stages in want.items():
        sel = OnlineSelector.for_target_data(model, SelectionConfig(**dict(kw)), docs)
        assert [type(s) for s in sel.stages] == stages, kw
        before = dict(vars(sel))
        sel.select({"input_ids": _ids(8, 9), "labels": _ids(8, 9)}, 3, 0)
        assert set(vars(sel)) == set(before), kw  # no attribute added by a step
        sel.close()
    assert len(fields(StepState)) <= 15


def test_content_score_runs_no_probe():
    """score='content': the choice is the top-k of the content prior alone, no probe or
    target pass runs, no gradient is touched, the plan predicts a plain step (1x), and the
    chosen ids are the content ids the probe would have given."""
    from dattri_ds.selection.content import ContentPrior

    model = tiny_gpt2(seed=2)
    tgt, cand = _ids(4, 8), _ids(8, 9)
    cand[:3, :6] = tgt[:3, :6]  # three candidates share text with the target
    docs = {"input_ids": tgt, "labels": tgt}
    sel = OnlineSelector.for_target_data(model, SelectionConfig(score="content",
                                                                uniform_mix=0.0), docs)
    calls = []
    raw = sel.probe.probe
    sel.probe.probe = lambda *a, **kw: calls.append(1) or raw(*a, **kw)
    batch = {"input_ids": cand, "labels": cand}
    out = sel.select(batch, k=3, step=0)
    want = ContentPrior(docs).scores(cand)
    assert torch.allclose(out.scores, want)
    assert out.indices.tolist() == sorted(torch.topk(want, 3).indices.tolist())
    assert calls == [] and sel.rows.refreshes == 0 and sel.plan.ratio() == 1.0
    assert all(p.grad is None for p in model.parameters())
    sel.close()
    probed = OnlineSelector.for_target_data(
        model, SelectionConfig(score="alignment", content_weight=0.0), docs)
    grads, _ = probed.score(batch, 0)
    probed.close()
    assert out.chosen_ids == tuple(grads.sample_ids[i] for i in out.indices.tolist())


def test_content_score_refuses_what_needs_a_gradient():
    """score='content' with settings that need a gradient (a store, the probed layers) or
    with a content weight: one-line errors at start naming the flag and
    --selection-score alignment."""
    from dattri_ds import ProjectionConfig

    for kw, flag in (({"top_blocks": 2}, "--selection-top-blocks 2"),
                     ({"content_weight": 2.0}, "--selection-content-weight 2.0"),
                     ({"target_store": "grads", "projection": ProjectionConfig(dim=8)},
                      "--selection-target-store grads")):
        with pytest.raises(ConfigError, match=f"{flag} .*--selection-score alignment"):
            SelectionConfig(score="content", **kw)
