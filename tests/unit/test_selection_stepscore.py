"""Step-alignment scores (selection/stepscore.py) against exact references.

score_b = E<G, g_t> / (|g_t| sqrt(E|G|^2)), G = g_b + the step's m - 1 other examples drawn
i.i.d. from the pool (mean p, mean squared norm s): checked against an enumeration of every
draw, and, through the selector, against per-example autograd gradients.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.selection import OnlineSelector, SelectionConfig
from dattri_ds.selection.stepscore import expected_step_cosine
from reference import reference_grads, rel_err, tiny_gpt2

RAW = dict(per_token=False, uniform_mix=0.0, refresh_every=100, smooth_neighbors=None,
           content_weight=0.0)


def _ids(n, seed, t=10):
    return torch.randint(0, 97, (n, t), generator=torch.Generator().manual_seed(seed))


def _batch(ids):
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("others", [0, 1, 2, 3])
def test_expected_step_cosine_is_the_ratio_of_exact_expectations(others):
    """Enumerate every draw of the other examples from a 3-vector pool (uniform, with
    replacement): E<G, t> / (|t| sqrt(E|G|^2)) equals the closed form."""
    g = torch.Generator().manual_seed(0)
    pool, cand, t = (torch.randn(3, 5, generator=g, dtype=torch.float64),
                     torch.randn(4, 5, generator=g, dtype=torch.float64),
                     torch.randn(5, generator=g, dtype=torch.float64))
    draws = list(itertools.product(range(3), repeat=others))
    want = []
    for c in cand:
        sums = [c + sum((pool[i] for i in d), torch.zeros(5, dtype=torch.float64))
                for d in draws]
        dot = torch.stack([s @ t for s in sums]).mean()
        norm2 = torch.stack([s @ s for s in sums]).mean()
        want.append(dot / (t.norm() * norm2.sqrt()))
    p = pool.mean(0)
    got = expected_step_cosine(cand @ t, cand @ p, (cand * cand).sum(1), tt=float(t @ t),
                               tp=float(p @ t), pp=float(p @ p),
                               mean_sq=float((pool * pool).sum(1).mean()), others=others)
    assert rel_err(got, torch.stack(want)) <= 1e-12


def test_expected_step_cosine_with_no_other_example_is_the_cosine():
    """m = 1: the score is cos(g_b, g_t), whatever the pool."""
    g = torch.Generator().manual_seed(1)
    cand, t, p = torch.randn(6, 4, generator=g), torch.randn(4, generator=g), torch.randn(4)
    got = expected_step_cosine(cand @ t, cand @ p, (cand * cand).sum(1), tt=float(t @ t),
                               tp=float(p @ t), pp=float(p @ p), mean_sq=3.0, others=0)
    want = torch.nn.functional.cosine_similarity(cand, t[None], dim=1)
    assert rel_err(got, want) <= 1e-6


def test_step_scores_equal_reference():
    """Through the selector: after the pool sample fills (4 rows of the first candidate
    batch), scores use g_t = mean target gradient, p = mean of those 4 rows, s = the mean
    squared norm of the scored candidates, m = step_examples (per-example autograd)."""
    model = tiny_gpt2(seed=1)
    tgt, first, later = _ids(5, 1), _ids(6, 2), _ids(5, 3)
    cfg = SelectionConfig(**RAW, score="step", contrast_rows=4)
    sel = OnlineSelector.for_target_data(model, cfg, _batch(tgt), step_examples=6)
    s1 = sel.select(_batch(first), 2, 0).scores
    s2 = sel.score(_batch(later), 1)[1]
    flat = lambda ids: torch.cat(list(reference_grads(model, ids).values()), 1).double()
    t, p = flat(tgt).mean(0), flat(first[:4]).mean(0)
    for cand, got in ((first, s1), (later, s2)):
        rc = flat(cand)
        sq = (rc * rc).sum(1)
        want = expected_step_cosine(rc @ t, rc @ p, sq, tt=float(t @ t), tp=float(p @ t),
                                    pp=float(p @ p), mean_sq=float(sq.mean()), others=5)
        assert rel_err(got, want) <= 1e-5
        cos = torch.nn.functional.cosine_similarity(rc, t[None], dim=1)
        assert rel_err(got, cos) > 0.01  # not the plain cosine
    sel.close()


def test_step_examples_default_to_the_micro_batch():
    """Without step_examples, m is the k of the select() call (times data-parallel ranks):
    with k = 1 the score is the plain cosine (no other example)."""
    model = tiny_gpt2(seed=3)
    tgt, cand = _ids(4, 1), _ids(5, 2)
    sel = OnlineSelector.for_target_data(model, SelectionConfig(**RAW, score="step",
                                                                contrast_rows=3), _batch(tgt))
    got = sel.select(_batch(cand), 1, 0).scores
    rc = torch.cat(list(reference_grads(model, cand).values()), 1)
    t = torch.cat(list(reference_grads(model, tgt).values()), 1).mean(0)
    assert rel_err(got, torch.nn.functional.cosine_similarity(rc, t[None], dim=1)) <= 1e-5
    sel.close()


def test_step_score_bad_combinations_fail_at_start():
    """score='step' measures the plain step: precondition with it is refused."""
    with pytest.raises(ConfigError, match="score='step'.*precondition"):
        SelectionConfig(score="step", precondition="adam")
    with pytest.raises(ConfigError, match="selection.score"):
        SelectionConfig.from_dict({"score": "cosine"})
