"""dattri_ds.collect, GradBatch.cat and Attributor.scores over several query batches.

Invariants: collect yields, per batch and in order, the per-example gradients of the
reference (one backward per example) without touching parameter grads; GradBatch.cat of
batches with different T equals each part (zero tokens add nothing); scoring a list of
query batches equals scoring their concatenation.
"""

from __future__ import annotations

import pytest
import torch

import dattri_ds
from dattri_ds import CaptureConfig, GradBatch, ProjectionConfig, make_attributor, materialize
from dattri_ds.errors import ShapeError
from reference import reference_grads, rel_err, tiny_gpt2


def _batches():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(1, 97, (3, 7), generator=g)
    b = torch.randint(1, 97, (2, 11), generator=g)
    return [{"input_ids": a, "labels": a}, {"input_ids": b, "labels": b}]


def test_collect_and_cat_match_reference():
    """Rows of cat(collect(...)) equal per-example references; .grad stays None."""
    model = tiny_gpt2()
    batches = _batches()
    got = list(dattri_ds.collect(model, batches, user_ids=[["a", "b", "c"], ["d", "e"]]))
    assert [g.batch_size for g in got] == [3, 2]
    assert all(p.grad is None for p in model.parameters())
    joined = GradBatch.cat(got)
    assert [s.split("#")[0] for s in joined.sample_ids] == list("abcde")
    assert joined.token_counts.tolist() == [6, 6, 6, 10, 10]
    refs = [reference_grads(model, b["input_ids"]) for b in batches]
    for name, lg in joined.layers.items():
        ref = torch.cat([r[name] for r in refs])
        assert rel_err(materialize(lg), ref) <= 1e-5, name


def test_scores_accept_query_batches_and_cat_checks_layers():
    """scores(train, [q1, q2]) == scores(train, cat([q1, q2])); mixed forms are refused."""
    model = tiny_gpt2()
    cfg = CaptureConfig(projection=ProjectionConfig(dim=8))
    train = list(dattri_ds.collect(model, _batches(), cfg))
    queries = list(dattri_ds.collect(model, _batches()[::-1], cfg))
    att = make_attributor("graddot")
    listed = att.scores(train, queries)
    joined = att.scores(train, GradBatch.cat(queries))
    assert listed.values.shape == (5, 5)
    assert torch.allclose(listed.values, joined.values)
    exact = next(iter(dattri_ds.collect(model, _batches()[:1])))
    with pytest.raises(ShapeError, match="differs between the batches"):
        GradBatch.cat([train[0], exact])
