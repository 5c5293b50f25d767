"""Spill: a one-shot capture stream read once and replayed from disk.

Invariants: every pass yields the same batches as the stream (bit-identical tensors, same
sample ids, same order); the stream is consumed exactly once; EK-FAC fitted and scored
through a Spill of a capture generator equals fitting and scoring a list of the same
batches (one capture instead of two); a pass started before the first finished, a pass
after close(), and a non-GradBatch item raise errors that say what to do; close() removes
the folder. With a Kronecker projector (LoGra) a Spill keeps only each layer's projected
sides: fewer bytes, and the same factors, rows and scores as the exact capture (float
rounding), on disk or in memory.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import Checkpoint, GradientCapture, ProjectionConfig, Spill
from dattri_ds.errors import DattriDSError
from dattri_ds.methods import EKFAC, fit_factors
from dattri_ds.methods.recipe import Recipe
from dattri_ds.capture.spill import _nbytes
from reference import rel_err, tiny_gpt2

VOCAB = 31


def _stream(model, ids, reads):
    with GradientCapture(model, probe_only=True) as cap:
        for i in range(ids.shape[0]):
            reads.append(i)
            x = ids[i:i + 1]
            yield cap.probe(lambda x=x: model(input_ids=x, labels=x).loss)


@pytest.fixture(scope="module")
def setup():
    model = tiny_gpt2(seed=0, n_layer=1, n_embd=8, vocab=VOCAB, n_positions=16)
    gen = torch.Generator().manual_seed(3)
    return model, torch.randint(1, VOCAB, (6, 7), generator=gen), \
        torch.randint(1, VOCAB, (2, 7), generator=gen)


def _same(a, b):
    assert a.sample_ids == b.sample_ids
    assert a.layers.keys() == b.layers.keys()
    for name, lg in a.layers.items():
        fa, fb = lg.data, b.layers[name].data
        for field in ("a", "g", "values"):
            if hasattr(fa, field):
                assert torch.equal(getattr(fa, field), getattr(fb, field)), (name, field)


@pytest.mark.parametrize("in_memory", [0, 2, 6])
def test_passes_replay_the_stream_exactly_once(setup, tmp_path, in_memory):
    """All on disk, the first two batches in memory and the rest on disk, all in memory."""
    model, ids, _ = setup
    reads = []
    direct = list(_stream(model, ids, []))
    budget = sum(_nbytes(b) for b in direct[:in_memory])
    with Spill(_stream(model, ids, reads), dir=str(tmp_path), memory_bytes=budget) as s:
        first, second, third = list(s), list(s), list(s)
        (folder,) = tmp_path.iterdir()
        assert len(list(folder.iterdir())) == ids.shape[0] - in_memory  # a file per batch
    assert reads == list(range(ids.shape[0]))  # the model ran once per example
    for passes in (first, second, third):
        assert len(passes) == len(direct)
        for a, b in zip(passes, direct):
            _same(a, b)
    assert list(tmp_path.iterdir()) == []  # the with block removed the folder


def test_ekfac_through_a_spill_equals_a_list(setup, tmp_path):
    model, ids, qids = setup
    query = next(iter(Spill(_stream(model, qids, []), dir=str(tmp_path))))
    reads = []
    with Spill(_stream(model, ids, reads), dir=str(tmp_path), memory_bytes=0) as train:
        factors = fit_factors(train)  # reads the stream once (writing), then the files
        spilled = EKFAC(factors=factors).scores(train, query).values
    listed = list(_stream(model, ids, []))
    want = EKFAC(factors=fit_factors(listed)).scores(listed, query).values
    assert len(reads) == ids.shape[0]
    assert spilled.shape == (ids.shape[0], 1)
    assert rel_err(spilled, want) <= 1e-6


def test_misuse_raises(setup, tmp_path):
    model, ids, _ = setup
    s = Spill(_stream(model, ids, []), dir=str(tmp_path))
    first = iter(s)
    next(first)
    with pytest.raises(DattriDSError, match="before the first one finished"):
        next(iter(s))
    s.close()
    with pytest.raises(DattriDSError, match="closed"):
        iter(s)
    with pytest.raises(DattriDSError, match="memory_bytes=-1 must be >= 0"):
        Spill([], dir=str(tmp_path), memory_bytes=-1)
    bad = Spill([torch.zeros(2)], dir=str(tmp_path))
    with pytest.raises(DattriDSError, match="not a GradBatch"):
        list(bad)
    bad.close()
    assert list(tmp_path.iterdir()) == []


def _logra(recipe, train, query):
    """LoGra EK-FAC through ``Recipe`` as benchmarks/lds.py runs it: (factors, rows, scores)."""
    factors = recipe.fit(train)
    rows = recipe.rows(train, factors)
    return factors, rows, recipe.score([Checkpoint(rows, query, 1.0, factors)]).values


def _same_sums(got, want):
    assert got.layers.keys() == want.layers.keys()
    for name, lf in want.layers.items():
        assert got.layers[name].space == lf.space
        for key, t in lf.sums.items():
            assert rel_err(got.layers[name].sums[key], t) <= 1e-5, (name, key)


@pytest.mark.parametrize("memory_bytes", [0, 1 << 30])
def test_logra_sides_give_the_exact_captures_factors_and_scores(setup, tmp_path, memory_bytes):
    model, ids, qids = setup
    recipe = Recipe(method="ekfac", projection=ProjectionConfig(kind="kronecker", dim=16),
                    logra=True)
    p = recipe.projector
    query = list(_stream(model, qids, []))[0]
    with Spill(_stream(model, ids, []), dir=str(tmp_path)) as train:
        want_f, want_rows, want = _logra(recipe, train, query)
        exact_bytes = sum(_nbytes(b) for b in train)
    reads = []
    with Spill(_stream(model, ids, reads), dir=str(tmp_path), memory_bytes=memory_bytes,
               projector=p) as train:
        got_f, got_rows, got = _logra(recipe, train, query)
        kept = list(train)
    assert len(reads) == ids.shape[0]
    sided = {n for n, lg in kept[0].layers.items() if lg.space == p.space}
    assert sided and sided < kept[0].layers.keys()  # embeddings and norms stay exact
    assert sum(_nbytes(b) for b in kept) < exact_bytes / 2
    _same_sums(got_f, want_f)
    for a, b in zip(got_rows, want_rows, strict=True):
        for name, lg in b.layers.items():
            assert a.layers[name].space == lg.space
            assert rel_err(a.layers[name].data.values, lg.data.values) <= 1e-5, name
    assert rel_err(got, want) <= 1e-5
    # a one-shot stream spilled by fit_factors itself keeps the sides and fits the same
    _same_sums(fit_factors(_stream(model, ids, []), projector=p), want_f)
    assert list(tmp_path.iterdir()) == []


def test_logra_sides_refuse_other_projections_and_exact_factors(setup, tmp_path):
    from dattri_ds.ops.projection import Projector

    model, ids, _ = setup
    sparse = Projector(ProjectionConfig(kind="sparse", dim=16))
    with Spill(_stream(model, ids, []), dir=str(tmp_path), projector=sparse) as bad:
        with pytest.raises(DattriDSError, match="kind='kronecker'"):
            list(bad)
    kron = Projector(ProjectionConfig(kind="kronecker", dim=16))
    with Spill(_stream(model, ids, []), dir=str(tmp_path), projector=kron) as train:
        with pytest.raises(DattriDSError, match="factors act on None"):
            fit_factors(train)  # exact factors cannot be fitted from projected sides
    assert list(tmp_path.iterdir()) == []
