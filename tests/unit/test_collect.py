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


@pytest.mark.parametrize("kind", ["sparse", "auto", "kronecker"])
def test_whitened_store_equals_in_memory_projection(tmp_path, kind):
    """collect(..., whiten="ekfac", factors=f) written to a store and read back equals the
    in-memory rows ``EKFAC(whitened=True, projector=P).train_rows(exact)`` (<= 1e-5), the
    store records the whitening, and scoring the stored rows with the whitened attributor
    gives the in-memory scores. Breaks if collect skips the whitening, projects before
    whitening, or the store drops the whitened tag."""
    from dattri_ds import Projector, fit_factors
    from dattri_ds.methods import EKFAC
    from dattri_ds.store import GradientStore, GradientStoreWriter, StoreConfig, StoreSpec

    model = tiny_gpt2()
    exact = list(dattri_ds.collect(model, _batches()))
    factors = fit_factors(exact, ekfac=True)
    proj = ProjectionConfig(kind=kind, dim=16)
    cfg = CaptureConfig(projection=proj, whiten="ekfac")
    rows = list(dattri_ds.collect(model, _batches(), cfg, factors=factors))
    spec = StoreSpec.from_batch(rows[0], projection=proj, fingerprint="m", capture=cfg)
    assert spec.whitened == "ekfac"
    with GradientStoreWriter(StoreConfig(path=str(tmp_path)), spec) as w:
        for b in rows:
            w.append(b)
    att = EKFAC(factors=factors, whitened=True, projector=Projector(proj))
    want = GradBatch.cat([att.train_rows(b) for b in exact])
    with GradientStore.open(tmp_path) as store:
        assert store.spec.whitened == "ekfac"
        stored = store.to_gradbatch(slice(None))
        for name, lg in want.layers.items():
            assert stored.layers[name].projection == lg.projection
            assert rel_err(stored.layers[name].data.values, lg.data.values) <= 1e-5, name
        query = exact[1]
        got = att.scores([stored], query).values
        ref = att.scores([want], query).values
        assert rel_err(got, ref) <= 1e-5


def test_whiten_needs_factors_and_projection():
    """whiten without factors (or factors without whiten) and whiten without a projection
    are configuration errors naming the fix, in GradientCapture as in collect."""
    from dattri_ds import GradientCapture
    from dattri_ds.errors import ConfigError

    model = tiny_gpt2()
    with pytest.raises(ConfigError, match="factors"):
        next(dattri_ds.collect(model, _batches(), CaptureConfig(
            projection=ProjectionConfig(kind="sparse", dim=8), whiten="ekfac")))
    with pytest.raises(ConfigError, match="projection"):
        CaptureConfig(whiten="kfac")
    with pytest.raises(ConfigError, match="factors missing"):
        GradientCapture(model, CaptureConfig(projection=ProjectionConfig(dim=8), whiten="kfac"))
    with pytest.raises(ConfigError, match="factors given"):
        next(dattri_ds.collect(model, _batches(), CaptureConfig(), factors=object()))
