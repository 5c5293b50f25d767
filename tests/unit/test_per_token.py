"""Per-token attribution ``[N, Q, T]``.

Invariants: ``score[n, q, t]`` equals ``<g_n, grad l[q, t]>`` with both gradients from
plain autograd (one backward per token); summed over t it equals the sequence score,
exactly and in a projected space; tokens without loss score 0.
"""

from __future__ import annotations

import torch

import dattri_ds
from dattri_ds import CaptureConfig, GradBatch, ProjectionConfig, make_attributor
from dattri_ds.per_token import collect_per_token, scatter_tokens
from reference import reference_grads, tiny_gpt2


def _data():
    g = torch.Generator().manual_seed(3)
    train = torch.randint(1, 97, (4, 8), generator=g)
    q = torch.randint(1, 97, (2, 7), generator=g)
    labels = q.clone()
    labels[0, 5:] = -100  # a padded query tail
    return {"input_ids": train, "labels": train}, {"input_ids": q, "labels": labels}


def _token_grad(model, queries, qi, t):
    """{layer: [D]} gradient of query qi's loss on label position t, by autograd."""
    only = torch.full_like(queries["labels"][qi:qi + 1], -100)
    only[0, t] = queries["labels"][qi, t]
    ref = reference_grads(model, queries["input_ids"][qi:qi + 1], labels=only)
    return {n: v[0] for n, v in ref.items()}


def test_per_token_scores_match_autograd_and_sum_to_sequence_scores():
    """Exact per-token graddot equals autograd dot products and sums to sequence scores."""
    model = tiny_gpt2()
    train, queries = _data()
    tgrads = GradBatch.cat(list(dattri_ds.collect(model, [train])))
    grads, where = collect_per_token(model, queries, batch_size=5)
    att = make_attributor("graddot")
    per_token = scatter_tokens(att.scores([tgrads], grads).values, where, 2, 7)
    assert per_token.shape == (4, 2, 7)
    assert where.shape[0] == 6 + 4  # positions 1..6 of query 0 minus the padded tail
    assert torch.all(per_token[:, 0, 5:] == 0) and torch.all(per_token[:, :, 0] == 0)
    seq = att.scores([tgrads], next(iter(dattri_ds.collect(model, [queries])))).values
    assert torch.allclose(per_token.sum(2), seq, rtol=1e-4, atol=1e-5)
    ref_train = reference_grads(model, train["input_ids"])
    for qi, t in [(0, 1), (0, 4), (1, 6)]:
        tok = _token_grad(model, queries, qi, t)
        want = sum(ref_train[n] @ tok[n] for n in tok)
        assert torch.allclose(per_token[:, qi, t], want, rtol=1e-4, atol=1e-5), (qi, t)


def test_projected_per_token_scores_sum_to_projected_sequence_scores():
    """With a Kronecker projection, token scores still sum to the sequence scores."""
    model = tiny_gpt2()
    train, queries = _data()
    cfg = CaptureConfig(projection=ProjectionConfig(dim=16))
    tgrads = list(dattri_ds.collect(model, [train], cfg))
    grads, where = collect_per_token(model, queries, cfg)
    att = make_attributor("graddot")
    per_token = scatter_tokens(att.scores(tgrads, grads).values, where, 2, 7)
    seq = att.scores(tgrads, list(dattri_ds.collect(model, [queries], cfg))).values
    assert torch.allclose(per_token.sum(2), seq, rtol=1e-4, atol=1e-4)
