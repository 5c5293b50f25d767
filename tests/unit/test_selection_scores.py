"""Selection scores and policies added for issue 10, against exact references.

Invariants: per-token scores are inner products of mean-token-loss gradients; Adam-
preconditioned scores are ``<g_b, P g_target>`` with ``P = 1/(sqrt(v_hat)+eps)`` read from a
real torch AdamW state; soft and mixed policies do what their definitions say; bad
settings fail at construction.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.layers import kind_for
from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget
from dattri_ds.selection.policy import fill_uniform, soft_top_k, top_k
from reference import reference_grads, rel_err, tiny_gpt2


RAW = dict(score="alignment", normalize=False, per_token=False, uniform_mix=0.0,
           smooth_neighbors=None, content_weight=0.0)  # plain <g_b, g_target>, top-k


def _ids(n, seed, t=10):
    return torch.randint(0, 97, (n, t), generator=torch.Generator().manual_seed(seed))


def _selector(model, cfg, tgt, optimizer=None):
    probe = OnlineSelector.probe_capture(model, cfg)
    target = ValidationTarget(probe, lambda b: model(**b).loss, tgt, batch_size=2)
    return OnlineSelector(model, cfg, target, probe=probe, optimizer=optimizer)


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


def _adam_trained(steps=3):
    model = tiny_gpt2(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
    for s in range(steps):
        x = _ids(4, 10 + s)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _reference_p(model, opt):
    """``{layer: [D]}`` 1/(sqrt(v_hat)+eps) in canonical layout, from the optimizer state."""
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    out = {}
    for name, m in model.named_modules():
        if kind_for(m) is None or not list(m.parameters(recurse=False)):
            continue
        ps = {}
        for k, p in m.named_parameters(recurse=False):
            st = opt.state[p]
            v_hat = st["exp_avg_sq"] / (1 - beta2 ** int(st["step"]))
            ps[k] = 1.0 / (v_hat.sqrt() + eps)
        out[name] = kind_for(m).canonical(m, ps).flatten()
    return out


@pytest.mark.parametrize("normalize", [False, True])
def test_adam_preconditioned_scores_equal_reference(normalize):
    """precondition='adam': score_b = <g_b, P g_target> (/ ||g_b|| when normalized), P from
    a real AdamW state after 3 steps; the target is preconditioned once per refresh."""
    model, opt = _adam_trained()
    tgt = {"input_ids": _ids(5, 1), "labels": _ids(5, 1)}
    cfg = SelectionConfig(**{**RAW, "normalize": normalize}, precondition="adam",
                          refresh_every=100)
    sel = _selector(model, cfg, tgt, optimizer=opt)
    cand = _ids(6, 2)
    got = sel.score({"input_ids": cand, "labels": cand}, 0)[1]
    rc, rt = reference_grads(model, cand), reference_grads(model, tgt["input_ids"])
    p = _reference_p(model, opt)
    want = sum(rc[n] @ (p[n] * rt[n].mean(0)) for n in rc)
    if normalize:
        want = want / torch.cat([rc[n] for n in rc], 1).norm(dim=1)
    assert rel_err(got, want) <= 1e-5
    plain = sum(rc[n] @ rt[n].mean(0) for n in rc)
    assert rel_err(plain, want) > 0.1  # the preconditioner changes the scores
    first = sel.target.get(0)
    assert sel.target.get(1) is first  # P applied once per refresh, not per step
    sel.close()


def test_adam_preconditioner_is_identity_before_the_first_step():
    """No second moment yet (step 0): the preconditioned score is the plain score."""
    model = tiny_gpt2(seed=3)
    opt = torch.optim.AdamW(model.parameters())
    tgt = {"input_ids": _ids(3, 1), "labels": _ids(3, 1)}
    cand = {"input_ids": _ids(4, 2), "labels": _ids(4, 2)}
    pre = _selector(model, SelectionConfig(precondition="adam", **RAW), tgt, optimizer=opt)
    a = pre.score(cand, 0)[1]
    pre.close()
    plain = _selector(model, SelectionConfig(**RAW), tgt)
    assert rel_err(a, plain.score(cand, 0)[1]) <= 1e-6
    plain.close()


def test_preconditioning_without_second_moments_fails_at_start():
    """SGD keeps no second moment, no optimizer given, projection: ConfigError at start."""
    model = tiny_gpt2()
    tgt = {"input_ids": _ids(3, 1), "labels": _ids(3, 1)}
    with pytest.raises(ConfigError, match="Adam-family optimizer"):
        _selector(model, SelectionConfig(score="alignment", precondition="adam"), tgt,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="needs the training optimizer"):
        _selector(model, SelectionConfig(score="alignment", precondition="adam"), tgt)
    from dattri_ds import ProjectionConfig
    with pytest.raises(ConfigError, match="projection"):
        SelectionConfig(score="alignment", precondition="adam",
                        projection=ProjectionConfig(dim=16))


def test_bad_soft_and_mix_settings_fail_early():
    """temperature <= 0, uniform_mix outside [0, 1], unknown precondition."""
    for bad, match in ((dict(temperature=0.0), "temperature"),
                       (dict(temperature=-1.0), "temperature"),
                       (dict(uniform_mix=1.5), "uniform_mix"),
                       (dict(uniform_mix=-0.1), "uniform_mix"),
                       (dict(precondition="shampoo"), "precondition")):
        with pytest.raises(ConfigError, match=match):
            SelectionConfig(**bad)


def test_soft_top_k_samples_by_standardized_score():
    """Gumbel-top-k: k=1 inclusion frequencies follow softmax(z / T); T -> 0 is top-k;
    -inf candidates come last; the scale of the scores does not matter."""
    s = torch.tensor([0.0, 1.0, 2.0, -1.0])
    z = (s - s.mean()) / s.std(unbiased=False)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 4000
    for _ in range(n):
        counts[soft_top_k(s, 1, 1.0, gen)] += 1
    assert torch.allclose(counts / n, torch.softmax(z, 0), atol=0.03)
    assert soft_top_k(s, 2, 1e-6, gen).tolist() == top_k(s, 2).tolist()
    assert soft_top_k(1000 * s, 2, 1e-6, gen).tolist() == top_k(s, 2).tolist()
    capped = torch.tensor([5.0, float("-inf"), 1.0])
    assert soft_top_k(capped, 2, 100.0, gen).tolist() == [0, 2]
    with pytest.raises(ConfigError, match="temperature"):
        soft_top_k(s, 1, 0.0, gen)


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
