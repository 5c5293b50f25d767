"""The text-overlap baseline (sparse TF-IDF) and the text prior added to attribution scores."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dattri_ds.errors import ConfigError
from dattri_ds.eval import char_ngrams, tfidf_scores, with_text_prior


def _dense_tfidf(train, queries, ngrams=(3, 4, 5)):
    """The textbook form: an [N, V] TF-IDF matrix, L2-normalized rows, cosine by matmul."""
    counts = [char_ngrams(t, ngrams) for t in train]
    df = Counter()
    for c in counts:
        df.update(c.keys())
    vocab = {g: j for j, g in enumerate(sorted(df))}
    idf = torch.tensor([math.log((1 + len(train)) / (1 + df[g])) + 1 for g in vocab],
                       dtype=torch.float64)

    def matrix(cs):
        m = torch.zeros(len(cs), len(vocab), dtype=torch.float64)
        for r, c in enumerate(cs):
            for g, v in c.items():
                if g in vocab:
                    m[r, vocab[g]] = v
        m = m * idf
        return m / m.norm(dim=1, keepdim=True).clamp_min(1e-300)

    return matrix(counts) @ matrix([char_ngrams(q, ngrams) for q in queries]).T


TRAIN = ["To be, or not to be, that is the question", "def f(x):\n    return x + 1",
         "It is a truth universally acknowledged", "In the beginning God created",
         "to be or not", "", "zzz"]
QUERIES = ["Whether 'tis nobler in the mind to suffer", "def g(y): return y * 2", "qqqq"]


def test_sparse_tfidf_equals_the_dense_matrix_form():
    got = tfidf_scores(TRAIN, QUERIES)
    want = _dense_tfidf(TRAIN, QUERIES)
    assert got.shape == (len(TRAIN), len(QUERIES)) and got.dtype == torch.float64
    assert torch.allclose(got, want, atol=1e-12)
    assert got[5].abs().sum() == 0 and got[:, 2].abs().sum() == 0  # nothing in common: 0
    assert got[0, 0] > got[1, 0] and got[1, 1] > got[0, 1]


def test_text_prior_ranks_as_the_z_sum_and_keeps_the_scores_units():
    gen = torch.Generator().manual_seed(0)
    s, o = torch.randn(50, 3, generator=gen) * 7 + 2, torch.rand(50, 3, generator=gen)
    z = lambda x: (x - x.mean(0)) / x.std(0)  # noqa: E731
    for w in (0.25, 0.5, 2.0):
        got = with_text_prior(s, o, w)
        ref = z(s) + w * z(o)
        assert torch.equal(got.argsort(0), ref.argsort(0))
        assert torch.allclose(z(got), z(ref), atol=1e-5)
        # the method's own mean and scale stay: the prior adds w * std(s) * z(overlap)
        assert torch.allclose(got.mean(0), s.mean(0), atol=1e-4)
    assert torch.equal(with_text_prior(s, o, 0.0), s)
    flat = torch.ones(50, 3)
    assert torch.equal(with_text_prior(s, flat, 0.5), s)  # a constant overlap adds nothing


@pytest.mark.parametrize("weight", [-0.1, float("nan"), float("inf")])
def test_text_prior_refuses_bad_weights_and_shapes(weight):
    s = torch.randn(4, 2)
    with pytest.raises(ConfigError, match="text weight"):
        with_text_prior(s, s, weight)
    with pytest.raises(ConfigError, match=r"\[N, Q\]"):
        with_text_prior(s, torch.randn(4, 3), 0.5)


def test_each_method_has_its_measured_text_weight():
    """attribute's default weights: the curvature methods' leave-one-regime-out choices
    (docs/attribution_fidelity.md), 0 for every method not measured with the prior."""
    from dattri_ds.methods import registered_attributors
    from dattri_ds.methods.recipe import Recipe

    measured = {"ekfac-trajectory": 0.25, "ekfac": 0.5, "kfac-trajectory": 0.5, "kfac": 0.5}
    for m, cls in registered_attributors().items():
        assert Recipe(method=m).text_weight == cls.text_weight == measured.get(m, 0.0)
    assert Recipe(method="tracin").text_weight == 0.0
