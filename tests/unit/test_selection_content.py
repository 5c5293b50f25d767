"""Content prior of selection (selection/content.py) on hand-made texts.

Invariants: a candidate's content score is the mean, over its valid unigrams and bigrams,
of log p_target - log p_stream (add-one smoothed hashed counts; the stream includes the
current candidates), checked against a dictionary count by hand; text like the target
scores above text unlike it; the selector ranks z(smoothed score) + w z(content); settings
that cannot work fail at start.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.selection import OnlineSelector, SelectionConfig
from dattri_ds.selection.content import ContentPrior, standardize, with_content
from dattri_ds.selection.smoothing import NeighborSmoother
from reference import tiny_gpt2
from test_selection_smoothing import _rows, _smooth

DIM = 64


def _buckets(toks, dim):
    """The hashed unigram and bigram buckets of one text (ngram_features' hashing)."""
    from dattri_ds.selection.smoothing import _P1, _P2, _P3
    uni = [(t * _P1) % dim for t in toks]
    bi = [(a * _P2 + b * _P3) % dim for a, b in zip(toks, toks[1:])]
    return uni + bi


def test_scores_equal_a_count_by_hand():
    target = [[5, 6, 7, 8], [5, 6, 9]]
    cands = [[5, 6, 7], [30, 31, 32, 33, 34], [5]]
    prior = ContentPrior(dict(zip(("input_ids", "attention_mask"), _rows(*target))), dim=DIM)
    got = prior.scores(*_rows(*cands))
    t = Counter(h for toks in target for h in _buckets(toks, DIM))
    s = Counter(h for toks in cands for h in _buckets(toks, DIM))
    nt, ns = sum(t.values()), sum(s.values())
    want = []
    for toks in cands:
        hs = _buckets(toks, DIM)
        want.append(sum(math.log((t[h] + 1) / (nt + DIM)) - math.log((s[h] + 1) / (ns + DIM))
                        for h in hs) / len(hs))
    assert torch.allclose(got, torch.tensor(want), atol=1e-5)
    assert got[0] > got[2] > got[1]  # like the target > one shared token > unlike it
    # the stream grows: the same candidates again are judged against both batches
    again = prior.scores(*_rows(*cands))
    s2 = Counter({h: 2 * c for h, c in s.items()})
    hs = _buckets(cands[1], DIM)
    w1 = sum(math.log((t[h] + 1) / (nt + DIM)) - math.log((s2[h] + 1) / (2 * ns + DIM))
             for h in hs) / len(hs)
    assert abs(float(again[1]) - w1) < 1e-5


def test_standardized_combination():
    s = torch.tensor([1.0, 2.0, 3.0])
    c = torch.tensor([10.0, 0.0, 5.0])
    z = standardize(s)
    assert torch.allclose(z.mean(), torch.tensor(0.0), atol=1e-7)
    assert torch.allclose(z.std(unbiased=False), torch.tensor(1.0))
    assert torch.equal(standardize(torch.full((3,), 4.0)), torch.zeros(3))
    assert torch.allclose(with_content(s, c, 2.0), z + 2 * standardize(c))


def test_selector_ranks_gradient_plus_content():
    """With content_weight the policy's top-k is that of z(smoothed) + w z(content);
    Selection.scores stay the raw gradient scores."""
    model = tiny_gpt2(seed=4)
    g = torch.Generator().manual_seed(5)
    tgt = torch.randint(0, 97, (4, 10), generator=g)
    cand = torch.randint(0, 97, (8, 10), generator=g)
    cand[:3, :6] = tgt[:3, :6]  # three candidates share text with the target
    batch = {"input_ids": cand, "labels": cand}
    target = {"input_ids": tgt, "labels": tgt}
    cfg = SelectionConfig(score="alignment", per_token=False, uniform_mix=0.0,
                          smooth_neighbors=2, content_weight=1.5)
    sel = OnlineSelector.for_target_data(model, cfg, target)
    out = sel.select(batch, 3, 0)
    ones = torch.ones_like(cand)
    want = with_content(_smooth(NeighborSmoother(2, 1024), cand, ones, out.scores),
                        ContentPrior(target).scores(cand, ones), 1.5)
    assert torch.equal(out.indices, torch.argsort(-want.double(), stable=True)[:3].sort().values)
    plain = OnlineSelector.for_target_data(
        model, SelectionConfig(score="alignment", per_token=False, uniform_mix=0.0,
                               smooth_neighbors=2), target)
    assert torch.allclose(plain.select(batch, 3, 0).scores, out.scores)
    heavy = OnlineSelector.for_target_data(  # content dominates: the three shared texts
        model, SelectionConfig(score="alignment", per_token=False, uniform_mix=0.0,
                               content_weight=100.0), target)
    assert heavy.select(batch, 3, 0).indices.tolist() == [0, 1, 2]
    for s in (sel, plain, heavy):
        s.close()


def test_bad_content_settings_fail_at_start(tmp_path):
    """A negative weight, and a weight with a store target (no documents to count)."""
    import dattri_ds
    from dattri_ds import CaptureConfig, ProjectionConfig
    from dattri_ds.store import GradientStoreWriter, StoreConfig, StoreSpec

    with pytest.raises(ConfigError, match="content_weight"):
        SelectionConfig(content_weight=-1.0)
    model = tiny_gpt2(seed=4)
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    proj = ProjectionConfig(dim=16)
    cfg = CaptureConfig(projection=proj)
    rows = list(dattri_ds.collect(model, [{"input_ids": ids, "labels": ids}], cfg))
    spec = StoreSpec.from_batch(rows[0], projection=proj, fingerprint="m", capture=cfg)
    with GradientStoreWriter(StoreConfig(path=str(tmp_path)), spec) as w:
        w.append(rows[0])
    sc = SelectionConfig(score="alignment", content_weight=0.5, target_store=str(tmp_path),
                         projection=proj)
    with pytest.raises(ConfigError, match="content_weight=0.5 needs the target documents"):
        OnlineSelector.for_target_data(model, sc, None)
    unset = OnlineSelector.for_target_data(  # the default: off for a store (no text)
        model, SelectionConfig(score="alignment", target_store=str(tmp_path), projection=proj),
        None)
    assert unset.content_weight == 0.0
    unset.close()
    target = {"input_ids": ids, "labels": ids}
    docs = OnlineSelector.for_target_data(model, SelectionConfig(score="alignment"), target)
    assert docs.content_weight == 1.0  # the default with target documents and a gradient
    docs.close()
