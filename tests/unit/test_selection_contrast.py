"""Contrastive selection scores (selection/contrast.py) against exact references.

score_b = <g_b, g_t/|g_t| - w g_pool/|g_pool|> (/ |g_b| when normalized), with g_t the mean
per-example gradient of the target rows and g_pool that of the first ``contrast_rows``
candidate rows the selector saw; per-example gradients from autograd, one example at a time.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget
from reference import reference_grads, rel_err, tiny_gpt2

RAW = dict(score="alignment", per_token=False, uniform_mix=0.0, refresh_every=100)


def _ids(n, seed, t=10):
    return torch.randint(0, 97, (n, t), generator=torch.Generator().manual_seed(seed))


def _batch(ids):
    return {"input_ids": ids, "labels": ids}


def _unit(grads):
    """``{layer: [D]}`` mean gradient scaled to unit whole-model norm."""
    mean = {n: g.mean(0) for n, g in grads.items()}
    norm = torch.cat(list(mean.values())).norm()
    return {n: v / norm for n, v in mean.items()}


@pytest.mark.parametrize("normalize", [True, False])
def test_contrast_scores_equal_reference(normalize):
    """After the pool sample fills (4 rows of the first candidate batch), every score is
    <g_b, u_t - w u_pool> (/ |g_b|); the first batch itself is already scored that way."""
    model = tiny_gpt2(seed=1)
    tgt = _ids(5, 1)
    cfg = SelectionConfig(**RAW, normalize=normalize, contrast=0.7, contrast_rows=4)
    sel = OnlineSelector.for_target_data(model, cfg, _batch(tgt))
    first, later = _ids(6, 2), _ids(5, 3)
    s1 = sel.select(_batch(first), 2, 0).scores
    s2 = sel.score(_batch(later), 1)[1]
    ut, up = _unit(reference_grads(model, tgt)), _unit(reference_grads(model, first[:4]))
    for cand, got in ((first, s1), (later, s2)):
        rc = reference_grads(model, cand)
        want = sum(rc[n] @ (ut[n] - 0.7 * up[n]) for n in rc)
        if normalize:
            want = want / torch.cat([rc[n] for n in rc], 1).norm(dim=1)
        assert rel_err(got, want) <= 1e-5
        plain = sum(rc[n] @ ut[n] for n in rc)
        assert rel_err(plain, want * (1 if not normalize else
                                      torch.cat([rc[n] for n in rc], 1).norm(dim=1))) > 0.05
    sel.close()


def test_contrast_before_the_pool_sample_is_full_scores_the_unit_target():
    """Fewer candidates seen than contrast_rows: no reference yet, score = <g_b, u_t>."""
    model = tiny_gpt2(seed=1)
    tgt, cand = _ids(4, 1), _ids(3, 2)
    sel = OnlineSelector.for_target_data(
        model, SelectionConfig(**RAW, normalize=False, contrast=1.0, contrast_rows=50),
        _batch(tgt))
    got = sel.select(_batch(cand), 1, 0).scores
    ut, rc = _unit(reference_grads(model, tgt)), reference_grads(model, cand)
    assert rel_err(got, sum(rc[n] @ ut[n] for n in rc)) <= 1e-5
    assert sel.target.reference is None
    sel.close()


def test_contrast_with_adam_preconditions_both_directions():
    """precondition='adam' + contrast: <g_b, P g_t/|P g_t| - w P g_pool/|P g_pool|>."""
    from test_selection_scores import _adam_trained, _reference_p

    model, opt = _adam_trained()
    tgt, first = _ids(5, 1), _ids(6, 2)
    cfg = SelectionConfig(**RAW, normalize=False, precondition="adam", contrast=0.5,
                          contrast_rows=6)
    sel = OnlineSelector.for_target_data(model, cfg, _batch(tgt), optimizer=opt)
    got = sel.select(_batch(first), 2, 0).scores
    p = _reference_p(model, opt)

    def unit_pre(ids):
        g = {n: p[n] * v.mean(0) for n, v in reference_grads(model, ids).items()}
        norm = torch.cat(list(g.values())).norm()
        return {n: v / norm for n, v in g.items()}

    ut, up, rc = unit_pre(tgt), unit_pre(first), reference_grads(model, first)
    assert rel_err(got, sum(rc[n] @ (ut[n] - 0.5 * up[n]) for n in rc)) <= 1e-5
    sel.close()


def test_contrast_bad_settings_fail_at_start():
    """A negative weight or pool size is refused by the config."""
    with pytest.raises(ConfigError, match="contrast"):
        SelectionConfig(contrast=-0.5)
    with pytest.raises(ConfigError, match="contrast_rows"):
        SelectionConfig(contrast=1.0, contrast_rows=0)


def test_selector_built_directly_computes_the_pool_like_its_target():
    """OnlineSelector(model, cfg, ValidationTarget(...)) builds the pool's provider from the
    target's forward and settings: the same scores as for_target_data."""
    model = tiny_gpt2(seed=2)
    tgt, first = _batch(_ids(4, 1)), _batch(_ids(6, 2))
    cfg = SelectionConfig(**RAW, contrast=1.0, contrast_rows=5)
    probe = OnlineSelector.probe_capture(model, cfg)
    target = ValidationTarget(probe, lambda b: model(**b).loss, tgt, batch_size=3)
    direct = OnlineSelector(model, cfg, target, probe=probe)
    a = direct.select(first, 2, 0).scores
    assert direct.target.reference is not None and direct.target.reference.batch_size == 3
    direct.close()
    built = OnlineSelector.for_target_data(model, cfg, tgt)
    assert rel_err(a, built.select(first, 2, 0).scores) <= 1e-6
    built.close()
