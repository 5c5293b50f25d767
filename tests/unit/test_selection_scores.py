"""Per-token scores and the uniform mix, against exact references.

Invariants: per-token scores are inner products of mean-token-loss gradients; the uniform
mix keeps the policy's picks and fills with distinct uniform ones; bad settings fail at
construction.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget
from dattri_ds.selection.policy import fill_uniform, top_k
from reference import reference_grads, rel_err, tiny_gpt2


RAW = dict(score="alignment", normalize=False, per_token=False, uniform_mix=0.0,
           smooth_neighbors=None, content_weight=0.0)  # plain <g_b, g_target>, top-k


def _ids(n, seed, t=10):
    return torch.randint(0, 97, (n, t), generator=torch.Generator().manual_seed(seed))


def _selector(model, cfg, tgt):
    probe = OnlineSelector.probe_capture(model, cfg)
    target = ValidationTarget(probe, lambda b: model(**b).loss, tgt, batch_size=2)
    return OnlineSelector(model, cfg, target, probe=probe)


def _padded(n, seed):
    """Examples of different lengths (pads masked), so sum and mean losses differ."""
    ids = _ids(n, seed)
    mask = torch.ones_like(ids)
    for b in range(n):
        mask[b, 3 + 2 * b:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_per_token_scores_use_mean_token_loss_gradients():
    """per_token=True: score_b = <grad of b's mean token loss, mean over targets of the same>
    (the summed-loss score would prefer long examples for their length)."""
    model = tiny_gpt2()
    tgt, cand = _padded(4, 1), _padded(5, 2)
    sel = _selector(model, SelectionConfig(**{**RAW, "per_token": True}), tgt)
    got = sel.score(cand, 0)[1]
    kw = dict(per_example_loss="mean")
    rc = reference_grads(model, cand["input_ids"], cand["attention_mask"], cand["labels"], **kw)
    rt = reference_grads(model, tgt["input_ids"], tgt["attention_mask"], tgt["labels"], **kw)
    want = sum(rc[n] @ rt[n].mean(0) for n in rc)
    assert rel_err(got, want) <= 1e-5
    sel.close()


def test_bad_mix_settings_fail_early():
    """uniform_mix outside [0, 1], a removed setting (an unknown key)."""
    for bad, match in ((dict(uniform_mix=1.5), "uniform_mix"),
                       (dict(uniform_mix=-0.1), "uniform_mix")):
        with pytest.raises(ConfigError, match=match):
            SelectionConfig(**bad)
    with pytest.raises(ConfigError, match="precondition"):
        SelectionConfig.from_dict({"precondition": "adam"})  # removed after 0eb5305


def test_fill_uniform():
    """fill_uniform keeps the policy's picks and adds distinct uniform ones."""
    gen = torch.Generator().manual_seed(0)
    got = fill_uniform(torch.tensor([3, 1]), 8, 5, gen)
    assert got.numel() == 5 and {1, 3} <= set(got.tolist()) and got.unique().numel() == 5
    assert fill_uniform(torch.zeros(0, dtype=torch.long), 4, 4, gen).tolist() == [0, 1, 2, 3]


def test_selector_mix():
    """uniform_mix=0.5 keeps the policy's best half."""
    model = tiny_gpt2()
    tgt = {"input_ids": _ids(3, 1), "labels": _ids(3, 1)}
    cand = _ids(8, 2)
    batch = {"input_ids": cand, "labels": cand}
    sel = _selector(model, SelectionConfig(**{**RAW, "uniform_mix": 0.5}), tgt)
    out = sel.select(batch, 4, 0)
    best2 = set(top_k(out.scores, 2).tolist())
    assert out.indices.numel() == 4 and best2 <= set(out.indices.tolist())
    sel.close()
