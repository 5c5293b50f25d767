"""Attribution methods: one scoring loop, method-specific query preconditioning.

Invariants: graddot/gradcos equal dot products/cosines of one-example-per-backward reference
gradients (factorized and projected); TracIn equals the lr-weighted sum of per-checkpoint
reference dot products; streaming the train set one example at a time equals one shot;
K-FAC/EK-FAC scores times a huge damping approach graddot; the registry resolves names and
mismatched inputs raise errors naming the layer or checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import GradientCapture
from dattri_ds.errors import ConfigError, DattriDSError, ShapeError
from dattri_ds.methods import (
    EKFAC, KFAC, Attributor, Checkpoint, GradCos, GradDot, TracIn, fit_factors, get_attributor,
    make_attributor, registered_attributors,
)
from dattri_ds.ops import ProjectionConfig, Projector, kron_dims, project_batch
from dattri_ds.ops.kronecker import KFACConfig
from dattri_ds.methods.base import METHODS
from reference import reference_grads, rel_err, tiny_gpt2

TOL = 1e-5
VOCAB = 31


def _model(seed=0):
    return tiny_gpt2(seed=seed, n_layer=1, n_embd=8, vocab=VOCAB, n_positions=16)


def _capture(model, ids):
    with GradientCapture(model, probe_only=True) as cap:
        batch = cap.probe(lambda: model(input_ids=ids, labels=ids).loss)
    ref = reference_grads(model, ids)
    return batch, torch.cat([ref[n] for n in batch.layers], 1)


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(1)
    model = _model()
    train_ids = torch.randint(1, VOCAB, (5, 6), generator=gen)
    query_ids = torch.randint(1, VOCAB, (3, 6), generator=gen)
    train, rt = _capture(model, train_ids)
    query, rq = _capture(model, query_ids)
    return model, train, rt, query, rq, train_ids, query_ids


def _singles(batch):
    return [batch.index([i]) for i in range(batch.batch_size)]


def test_graddot_and_gradcos_equal_reference(data):
    """graddot = G_train G_query^T; gradcos divides by whole-model norms (both sides)."""
    _, train, rt, query, rq, *_ = data
    ids, s = GradDot().scores([train], query)
    assert ids == train.sample_ids and s.shape == (5, 3)
    assert rel_err(s, rt @ rq.T) <= TOL
    want = (rt @ rq.T) / rt.norm(dim=1)[:, None] / rq.norm(dim=1)[None]
    assert rel_err(GradCos().scores([train], query).values, want) <= TOL


def test_projected_store_rows_score_like_projected_reference(data):
    """Dense Kronecker-projected rows (what a store holds) give projected reference dots."""
    _, train, rt, query, rq, *_ = data
    proj = Projector(ProjectionConfig(kind="kronecker", dim=16, seed=2))
    blocks_t, blocks_q, start = [], [], 0
    for name, lg in train.layers.items():
        o, i = lg.shape
        d = o * i
        if d <= 16:
            k = torch.eye(d)
        else:
            ko, ki = kron_dims(16, o, i)
            k = (torch.kron(proj.side(name, "out", ko, o, torch.device("cpu")),
                            proj.side(name, "in", ki, i, torch.device("cpu")))
                 if lg.is_factorized else proj.dense_matrix(name, d, 16))
        blocks_t.append(rt[:, start:start + d] @ k.T)
        blocks_q.append(rq[:, start:start + d] @ k.T)
        start += d
    pt, pq = torch.cat(blocks_t, 1), torch.cat(blocks_q, 1)
    s = GradDot().scores([project_batch(train, proj)], project_batch(query, proj)).values
    assert rel_err(s, pt @ pq.T) <= TOL


@pytest.mark.parametrize("method", ["graddot", "gradcos", "kfac", "ekfac"])
def test_streaming_size_one_equals_one_shot(data, method):
    """Scoring train batches of one example each == scoring the whole batch at once."""
    _, train, _, query, *_ = data
    kwargs = {}
    if method in ("kfac", "ekfac"):
        kwargs["factors"] = fit_factors([train])
    m = make_attributor(method, **kwargs)
    one = m.scores([train], query)
    streamed = m.scores(iter(_singles(train)), query)
    assert streamed.train_ids == one.train_ids
    assert rel_err(streamed.values, one.values) <= 1e-5  # float32 rounding (KFACConfig.dtype)


def test_curvature_with_huge_damping_approaches_graddot(data):
    """(H + lambda)^-p -> I / lambda^p as lambda -> inf, so lambda^p * kfac/ekfac scores ->
    graddot scores (p = KFACConfig.power)."""
    _, train, rt, query, rq, *_ = data
    lam = 1e9
    f = fit_factors([train], config=KFACConfig(damping=lam, damping_mode="absolute"))
    dot = rt @ rq.T
    for cls in (KFAC, EKFAC):
        scores = cls(factors=f).scores([train], query).values * lam ** f.config.power
        assert rel_err(scores, dot) <= 1e-4
    small = fit_factors(lambda: [train], config=KFACConfig(damping=1e-3))
    s = EKFAC(factors=small).scores([train], query).values
    assert rel_err(s, dot) > 1e-2  # the curvature really changes the scores


def test_tracin_equals_lr_weighted_reference_dots(data):
    """TracIn = sum_c lr_c <g_n^(c), g_q^(c)> over three weight snapshots."""
    _, _, _, _, _, train_ids, query_ids = data
    lrs = [0.1, 0.05, 0.01]
    cks, want = [], 0
    for c, lr in enumerate(lrs):
        model = _model()
        with torch.no_grad():
            gen = torch.Generator().manual_seed(10 + c)
            for p in model.parameters():
                p.add_(0.05 * c * torch.randn(p.shape, generator=gen))
        train, rt = _capture(model, train_ids)
        query, rq = _capture(model, query_ids)
        cks.append(Checkpoint(_singles(train), query, lr))
        want = want + lr * (rt @ rq.T)
    got = TracIn().trajectory_scores(cks)
    assert got.train_ids == tuple(b.sample_ids[0] for b in cks[0].train)
    assert rel_err(got.values, want) <= TOL
    assert rel_err(TracIn(inner="graddot").scores(cks[0].train, cks[0].query).values,
                   GradDot().scores(cks[0].train, cks[0].query).values) == 0
    with pytest.raises(ShapeError, match="Checkpoint 1"):
        TracIn().trajectory_scores([cks[0], cks[1]._replace(train=cks[1].train[::-1])])
    with pytest.raises(ConfigError, match="at least one"):
        TracIn().trajectory_scores([])


def test_registry_and_subclassing(data):
    """Names resolve to classes; a subclass with name= registers; unknown names list methods."""
    _, train, rt, query, rq, *_ = data
    assert {"graddot", "gradcos", "tracin", "kfac", "ekfac"} <= set(registered_attributors())
    assert get_attributor("ekfac") is EKFAC

    class Doubled(Attributor, name="test_doubled"):
        def precondition(self, query):
            return query

        def query_scale(self, query, layers):
            return torch.full((query.batch_size,), 2.0)

    try:
        assert rel_err(make_attributor("test_doubled").scores([train], query).values,
                       2 * rt @ rq.T) <= TOL
    finally:  # a toy method must not outlive its test (tools list the registry)
        METHODS.unregister("test_doubled")
    with pytest.raises(ConfigError, match="graddot"):
        get_attributor("nope")


def test_bad_inputs_are_named(data):
    """Missing layers name the layer; EK-FAC without its correction pass refuses."""
    _, train, _, query, *_ = data
    name = "transformer.h.0.mlp.c_fc"
    part = train.index([0, 1])
    part = type(part)(0, part.sample_ids, {n: lg for n, lg in part.layers.items() if n != name})
    with pytest.raises(ShapeError, match=name):
        GradDot().scores([part], query)
    with pytest.raises(ShapeError, match=name):
        GradDot(layers=[name]).scores([train], part)
    f = fit_factors([part], ekfac=False)
    with pytest.raises(DattriDSError, match="update_correction"):
        EKFAC(factors=f)
    with pytest.raises(ShapeError, match=f"{name}.*no curvature factors"):
        KFAC(factors=f).scores([train], query)


@pytest.mark.parametrize("kind", ["dense", "kronecker"])
def test_projector_projects_the_exactly_preconditioned_query(data, kind):
    """EKFAC(projector=P) on P-projected train rows == <P g_n, P (F + lambda)^-1 g_q>.

    The factors are exact; only the preconditioned query is projected (with the explicit
    matrix of the store's projection here). Breaks if the query is projected before the
    preconditioning or with another matrix than the training rows.
    """
    _, train, rt, query, rq, *_ = data
    proj = Projector(ProjectionConfig(kind=kind, dim=16, seed=3))
    f = fit_factors([train])
    hq = f.precondition(query, "ekfac")
    want = 0
    for name, lg in train.layers.items():
        o, i = lg.shape
        if o * i <= 16:
            k = torch.eye(o * i)
        elif kind == "kronecker" and lg.is_factorized:
            ko, ki = kron_dims(16, o, i)
            k = torch.kron(proj.side(name, "out", ko, o, torch.device("cpu")),
                           proj.side(name, "in", ki, i, torch.device("cpu")))
        else:
            k = proj.dense_matrix(name, o * i, 16)
        want = want + (_ref_rows(train, rt, name) @ k.T) @ (hq.layers[name].data.values @ k.T).T
    got = EKFAC(factors=f, projector=proj).scores([project_batch(train, proj)], query).values
    assert rel_err(got, want) <= TOL


def _ref_rows(batch, rows, name):
    start = 0
    for n, lg in batch.layers.items():
        d = lg.shape[0] * lg.shape[1]
        if n == name:
            return rows[:, start:start + d]
        start += d
    raise KeyError(name)


def test_dense_route_materializes_the_query_once(data, monkeypatch):
    """With the dense route forced, the unchanged query is materialized once, not per batch.

    Counts ``LayerKind.materialize`` calls on query-sized factors while five one-example
    train batches are scored; the scores stay equal to the reference dot products.
    """
    from dattri_ds.layers.base import registered_kinds
    from dattri_ds.ops.cost import CostModel

    _, train, rt, query, rq, *_ = data
    calls = []
    for inst in registered_kinds().values():
        orig = inst.materialize

        def counted(f, shape, _orig=orig):
            calls.append(f.g.shape[0])
            return _orig(f, shape)
        monkeypatch.setattr(inst, "materialize", counted)
    cost = CostModel(force={"cross_gram": "dense", "cross_dense": "dense"})
    s = GradDot(cost=cost).scores(_singles(train), query).values
    assert rel_err(s, rt @ rq.T) <= TOL
    factorized = sum(lg.is_factorized for lg in query.layers.values())
    assert calls.count(query.batch_size) == factorized  # once per layer, not 5 times


def test_one_shot_iterator_fits_in_one_pass_equal_to_two(data, tmp_path):
    """fit_factors(generator) reads the data once (spilling it for the EK-FAC pass) and
    gives the factors of two passes over a list; the spill folder is removed."""
    _, train, _, query, *_ = data
    reads = []

    def gen():
        for b in _singles(train):
            reads.append(b.sample_ids[0])
            yield b
    one = fit_factors(gen(), spill_dir=str(tmp_path))
    two = fit_factors(_singles(train))
    assert len(reads) == train.batch_size  # one pass
    assert list(tmp_path.iterdir()) == []
    for name, lf in two.layers.items():
        for k, t in lf.sums.items():
            assert rel_err(one.layers[name].sums[k], t) <= 1e-6, (name, k)
    assert rel_err(EKFAC(factors=one).scores([train], query).values,
                   EKFAC(factors=two).scores([train], query).values) <= 1e-6


def test_whitened_rows_give_the_curvature_scores(data):
    """<r_n, r_q> with r = (F + lambda)^-1/2 g (eigenbasis) == <g_n, (F + lambda)^-1 g_q>,
    and projected whitened rows equal the explicit projection of the whitened rows."""
    _, train, _, query, *_ = data
    f = fit_factors([train])
    for cls in (KFAC, EKFAC):
        exact = cls(factors=f).scores([train], query).values
        w = cls(factors=f, whitened=True)
        assert rel_err(w.scores([w.train_rows(train)], query).values, exact) <= 1e-5
    proj = Projector(ProjectionConfig(kind="sparse", dim=16, seed=1))
    w = EKFAC(factors=f, whitened=True, projector=proj)
    rt, rq = f.whiten(train), f.whiten(query)
    want = 0
    for name, lg in rt.layers.items():
        d = lg.data.values.shape[1]
        p = torch.eye(d) if d <= 16 else proj.dense_matrix(name, d, 16)
        want = want + (lg.data.values @ p.T) @ (rq.layers[name].data.values @ p.T).T
    assert rel_err(w.scores([w.train_rows(train)], query).values, want) <= 1e-5
