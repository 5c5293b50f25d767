"""Selector state round-trips: every stateful component's ``state_dict`` restores it exactly.

Invariant: ``B.load_state_dict(torch.load(save(A.state_dict()), weights_only=True))`` makes
a freshly built component ``B`` behave like ``A`` from then on, bit for bit: the smoothing
memory, the content prior's stream counts, a target's cached rows and refresh clock, and a
whole ``OnlineSelector`` of each arm (choices, scores, statistics, log). Breaks when a component
leaves part of its state out, or writes something ``weights_only`` cannot read.
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from dattri_ds.layers import get_kind
from dattri_ds import ConfigError
from dattri_ds.gradient import Dense, GradBatch, LayerGrad, ShardInfo
from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget
from dattri_ds.selection.content import ContentPrior
from dattri_ds.selection.smoothing import CandidateText, NeighborSmoother
from dattri_ds.selection.state import (
    config_difference, grad_batch_from_state, grad_batch_state, log_lines_before,
)
from reference import tiny_gpt2


def _saved(state):
    """``state`` through torch.save / torch.load(weights_only=True), as a checkpoint does."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _ids(seed: int, n: int = 6, t: int = 10) -> torch.Tensor:
    return torch.randint(0, 97, (n, t), generator=torch.Generator().manual_seed(seed))


def _same(a: GradBatch, b: GradBatch) -> bool:
    return a.layers.keys() == b.layers.keys() and all(
        torch.equal(a.layers[n].data.values, b.layers[n].data.values) for n in a.layers)


def test_smoother_memory_round_trips():
    """A smoother restored from another's state smooths the next batch exactly like it; a
    memory wider than the smoother keeps is refused, naming the setting."""
    a, b = NeighborSmoother(3, 8), NeighborSmoother(3, 8)
    for s in (1, 2):
        a(torch.randn(6, generator=torch.Generator().manual_seed(s)), CandidateText(_ids(s)))
    b.load_state_dict(_saved(a.state_dict()))
    scores, text = torch.randn(6), CandidateText(_ids(3))
    assert torch.equal(a(scores, text), b(scores, text))
    with pytest.raises(ConfigError, match="smooth_memory"):
        NeighborSmoother(3, 4).load_state_dict(_saved(a.state_dict()))


def test_content_prior_stream_round_trips():
    """Restored stream counts give the next batch the same content scores; a prior built on
    other target documents refuses the state."""
    docs = {"input_ids": _ids(10)}
    a, b = ContentPrior(docs), ContentPrior(docs)
    a.scores(_ids(1))
    a.scores(_ids(2))
    b.load_state_dict(_saved(a.state_dict()))
    assert torch.equal(a.scores(_ids(3)), b.scores(_ids(3)))
    with pytest.raises(ConfigError, match="target documents differ"):
        ContentPrior({"input_ids": _ids(11)}).load_state_dict(_saved(a.state_dict()))


def test_grad_batch_state_keeps_shard_and_projection():
    """A cached target row keeps name, kind, shape, projection tag, shard and its values."""
    shard = ShardInfo(0, 1, 2, (8, 3), offset=4)
    gb = GradBatch(step=-1, sample_ids=("target",), layers={
        "a": LayerGrad("a", get_kind("linear"), Dense(torch.randn(1, 12)), (4, 3), shard=shard),
        "b": LayerGrad("b", get_kind("linear"), Dense(torch.randn(1, 5)), (4, 3),
                       space="kron:5:0")})
    back = grad_batch_from_state(_saved(grad_batch_state(gb)))
    assert _same(gb, back) and back.sample_ids == gb.sample_ids
    assert back.layers["a"].shard == shard and back.layers["b"].projection == "kron:5:0"
    assert back.layers["a"].kind is gb.layers["a"].kind
    assert grad_batch_from_state(None) is None


def _target(model, probe, refresh_every=3):
    tgt = _ids(7, n=5)
    return ValidationTarget(probe, lambda b: model(**b).loss, {"input_ids": tgt, "labels": tgt},
                            batch_size=2, refresh_every=refresh_every)


@torch.no_grad()
def _perturb(model):
    for p in model.parameters():
        p.add_(0.01 * torch.randn_like(p))


def test_target_cached_rows_and_clock_round_trip():
    """Restored into a provider on a model that has moved since the last refresh, the target
    returns the saved rows until its clock says refresh (not rows of the moved model)."""
    cfg = SelectionConfig(enabled=True, score="alignment")
    model = tiny_gpt2(seed=1)
    a = _target(model, OnlineSelector.probe_capture(model, cfg))
    first = a.get(1)
    state = _saved(a.state_dict())
    _perturb(model)
    b = _target(model, OnlineSelector.probe_capture(model, cfg))
    b.load_state_dict(state)
    assert _same(b.get(3), first) and b.refreshes == 1
    assert not _same(b.get(4), first) and b.refreshes == 2 and _same(a.get(4), b.get(4))


def _selector(model, log=None, **kw):
    grad = {"score": "alignment", "refresh_every": 2, "smooth_memory": 10}
    cfg = SelectionConfig(**{"enabled": True, **({} if kw.get("score") == "content" else grad),
                             **kw})
    tgt = _ids(20, n=8)
    return OnlineSelector.for_target_data(model, cfg, {"input_ids": tgt, "labels": tgt},
                                          log_path=log)


@pytest.mark.parametrize("kw", [{}, {"score": "content"}, {"shortlist": 1.0},
                                {"random": True}])
def test_selector_state_dict_round_trips(tmp_path, kw):
    """A selector built afresh and loaded with another's state (after 3 steps) chooses the
    same examples with the same scores for 3 more steps, ends with the same statistics and
    continues its log, which then equals the uninterrupted selector's."""
    model = tiny_gpt2(seed=3)
    a = _selector(model, tmp_path / "a.jsonl", **kw)
    batches = [{"input_ids": _ids(30 + s, n=6), "labels": _ids(30 + s, n=6)} for s in range(6)]
    for s in range(3):
        a.select(batches[s], 2, s)
    state = _saved(a.state_dict())
    lines = log_lines_before(tmp_path / "a.jsonl", 3)
    b = _selector(model, tmp_path / "b.jsonl", **kw)
    b.load_state_dict(state, lines)
    for s in range(3, 6):
        sa, sb = a.select(batches[s], 2, s), b.select(batches[s], 2, s)
        assert sa.chosen_ids == sb.chosen_ids and torch.equal(sa.scores, sb.scores)
    assert a.summary() == b.summary()
    a.close()
    b.close()
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_selector_state_refuses_other_stages():
    """A state written by a selector with other rank stages is refused, not half-loaded."""
    model = tiny_gpt2(seed=3)
    state = _selector(model).state_dict()
    with pytest.raises(ConfigError, match="rank stage"):
        _selector(model, smooth_neighbors=None).load_state_dict(state)


def test_log_lines_before_and_config_difference(tmp_path):
    """The kept log is the records before the resumed step (a torn last line dropped); the
    config comparison names the first differing key, nested keys dotted."""
    log = tmp_path / "selection.jsonl"
    recs = [json.dumps({"step": s, "chosen": [str(s)]}) + "\n" for s in (0, 0, 1, 2)]
    log.write_text("".join(recs) + '{"step": 3, "cho')
    assert log_lines_before(log, 2) == recs[:3]
    assert log_lines_before(tmp_path / "missing.jsonl", 2) == []
    assert config_difference({"a": 1, "p": {"dim": 8}}, {"a": 1, "p": {"dim": 8}}) is None
    assert config_difference({"a": 1, "p": {"dim": 8}}, {"a": 1, "p": {"dim": 16}}) == \
        ("selection.p.dim", 8, 16)
    assert config_difference({"a": 1}, {"a": 1, "b": 2}) == ("selection.b", "<unset>", 2)
