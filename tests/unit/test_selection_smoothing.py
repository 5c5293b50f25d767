"""Neighbour smoothing of selection scores (selection/smoothing.py) on hand-made texts.

Invariants: features see only valid tokens and are unit norm; a smoothed score is the mean
raw score of the k texts nearest in content (itself included), over this batch and the
memory of earlier candidates (FIFO); the selector's policy ranks the smoothed scores.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.selection import OnlineSelector, SelectionConfig
from dattri_ds.selection.smoothing import NeighborSmoother, ngram_features
from reference import tiny_gpt2


def _smooth(smoother, ids, valid, scores):
    """``smoother`` on the candidates' token ids (their unit-norm hashed n-gram features)."""
    return smoother.smooth_features(ngram_features(ids, valid), scores)


def _rows(*token_lists, t=8):
    ids = torch.zeros(len(token_lists), t, dtype=torch.long)
    mask = torch.zeros(len(token_lists), t, dtype=torch.long)
    for i, toks in enumerate(token_lists):
        ids[i, :len(toks)] = torch.tensor(toks)
        mask[i, :len(toks)] = 1
    return ids, mask


def test_features_are_unit_norm_and_ignore_padding():
    """Padding after the valid tokens (any id) changes nothing; the norm is 1."""
    ids, mask = _rows([5, 6, 7], [5, 6, 7])
    ids[1, 3:] = 42  # padding with another id
    f = ngram_features(ids, mask)
    assert torch.allclose(f.norm(dim=1), torch.ones(2))
    assert torch.equal(f[0], f[1])
    other = ngram_features(*_rows([7, 6, 5]))  # same unigrams, other bigrams
    assert float(f[0] @ other[0]) < 0.99


def test_smoothed_score_is_the_mean_of_the_nearest_texts():
    """Two kinds of text (tokens 1-4 vs 50-53): with k=3 every score becomes the mean of
    its own kind's three members."""
    ids, mask = _rows([1, 2, 3, 4], [2, 3, 4, 1], [3, 4, 1, 2],
                      [50, 51, 52, 53], [51, 52, 53, 50], [52, 53, 50, 51])
    raw = torch.tensor([0.9, 0.0, 0.3, 0.6, 0.6, 0.0])
    got = _smooth(NeighborSmoother(k=3, memory=16), ids, mask, raw)
    assert torch.allclose(got, torch.tensor([0.4, 0.4, 0.4, 0.4, 0.4, 0.4]))
    assert torch.equal(_smooth(NeighborSmoother(k=1, memory=16), ids, mask, raw), raw)


def test_memory_holds_earlier_candidates_first_in_first_out():
    """A later batch's text is smoothed with the earlier batch's scores of its kind; a memory
    of 1 keeps only the newest earlier candidate."""
    first_ids, first_mask = _rows([1, 2, 3, 4], [50, 51, 52, 53])
    later_ids, later_mask = _rows([2, 3, 4, 1])
    sm = NeighborSmoother(k=2, memory=8)
    _smooth(sm, first_ids, first_mask, torch.tensor([1.0, -1.0]))
    assert torch.allclose(_smooth(sm, later_ids, later_mask, torch.tensor([0.0])),
                          torch.tensor([0.5]))
    small = NeighborSmoother(k=2, memory=1)
    _smooth(small, first_ids, first_mask, torch.tensor([1.0, -1.0]))  # keeps row 0 (first)
    _smooth(small, *_rows([50, 51, 52, 53]), torch.tensor([3.0]))   # now keeps this one
    assert torch.allclose(_smooth(small, later_ids, later_mask, torch.tensor([0.0])),
                          torch.tensor([1.5]))


def test_selector_ranks_smoothed_scores():
    """With smooth_neighbors the policy's top-k is that of the smoothed scores (raw scores
    are still what Selection.scores reports)."""
    model = tiny_gpt2(seed=4)
    g = torch.Generator().manual_seed(3)
    tgt = torch.randint(0, 97, (4, 10), generator=g)
    cand = torch.randint(0, 97, (8, 10), generator=g)
    cand[4:, :5] = cand[:4, :5]  # pairs of similar texts
    batch = {"input_ids": cand, "labels": cand}
    cfg = SelectionConfig(score="alignment", per_token=False, uniform_mix=0.0,
                          smooth_neighbors=2, content_weight=0.0)
    sel = OnlineSelector.for_target_data(model, cfg, {"input_ids": tgt, "labels": tgt})
    out = sel.select(batch, 3, 0)
    want = _smooth(NeighborSmoother(2, 1024), cand, torch.ones_like(cand), out.scores)
    assert torch.equal(out.indices, torch.argsort(-want.double(), stable=True)[:3].sort().values)
    plain = OnlineSelector.for_target_data(model, SelectionConfig(score="alignment",
                                                                  per_token=False,
                                                                  uniform_mix=0.0),
                                           {"input_ids": tgt, "labels": tgt})
    assert torch.allclose(plain.select(batch, 3, 0).scores, out.scores)
    sel.close()
    plain.close()


def test_bad_smoothing_settings_fail_at_start():
    with pytest.raises(ConfigError, match="smooth_neighbors"):
        SelectionConfig(smooth_neighbors=0)
    with pytest.raises(ConfigError, match="smooth_memory"):
        SelectionConfig(smooth_neighbors=4, smooth_memory=0)
