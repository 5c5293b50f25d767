"""Per-token attribution ``[N, Q, T]``.

Invariants: ``score[n, q, t]`` equals ``<g_n, grad l[q, t]>`` with both gradients from
plain autograd (one backward per token); summed over t it equals the sequence score,
exactly and in a projected space; tokens without loss score 0.
"""

from __future__ import annotations

import torch

import dattri_ds
from dattri_ds import CaptureConfig, GradBatch, ProjectionConfig, make_attributor
from dattri_ds.methods.per_token import scatter_tokens, token_chunks, token_gradients
from reference import reference_grads, tiny_gpt2


def collect_per_token(model, queries, config=None, *, batch_size=16):
    """Every loss-bearing token row's gradient at once (untrimmed), and its ``(q, t)``."""
    parts = list(token_chunks(queries, config, chunk=batch_size, trim=False))
    grads = token_gradients(model, (rows for rows, _ in parts), config, batch_size=batch_size)
    return grads, torch.cat([w for _, w in parts])


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


def test_chunked_token_rows_equal_all_rows_at_once():
    """Streaming the token rows in chunks (each cut after its last loss-bearing position)
    gives the scores of all rows captured at once, for plain and EK-FAC-preconditioned
    queries: chunking and trimming change the memory, never the scores."""
    from dattri_ds import KFACConfig, fit_factors

    model = tiny_gpt2()
    train, queries = _data()
    tgrads = GradBatch.cat(list(dattri_ds.collect(model, [train])))
    whole, where = collect_per_token(model, queries, batch_size=64)
    factors = fit_factors([tgrads], config=KFACConfig(), ekfac=True)
    # EK-FAC on 4 examples is ill-conditioned: the capture batch size alone moves its scores
    # by 2e-5 of their largest; graddot stays at float rounding
    for att, tol in ((make_attributor("graddot"), 1e-5),
                     (make_attributor("ekfac", factors=factors), 2e-4)):
        want = att.scores([tgrads], whole).values
        for chunk in (1, 3, 4):
            parts = list(token_chunks(queries, chunk=chunk))
            assert all(rows["input_ids"].shape[1] == int(w[:, 1].max()) + 1
                       for rows, w in parts)  # trimmed after the last loss-bearing token
            got = torch.cat([att.scores([tgrads], token_gradients(model, [rows])).values
                             for rows, _ in parts], dim=1)
            assert torch.equal(torch.cat([w for _, w in parts]), where)
            err = float((got - want).abs().max() / want.abs().max())
            assert err <= tol, (type(att).__name__, chunk, err)


def test_token_plan_sizes_the_chunk_and_refuses_a_larger_one():
    """The chunk is the largest within the budget; a --token-chunk above it, or a query
    whose single row does not fit, is refused naming the flag to change."""
    import pytest

    from dattri_ds.errors import ConfigError
    from dattri_ds.methods.per_token import TokenPlan

    shapes = [(384, 129), (128, 129), (1024, 129)]
    row = TokenPlan.row_cost(shapes, 256, dense_query=True)
    assert row == (4 * 3 * 256 * sum(o + i for o, i in shapes)
                   + 4 * 3 * sum(o * i for o, i in shapes))
    plan = TokenPlan.make(shapes, seq_len=256, rows=255, dense_query=True, budget=10 * row + 5)
    assert (plan.chunk, plan.chunks, plan.need) == (10, 26, 10 * row)
    assert TokenPlan.make(shapes, seq_len=256, rows=4, dense_query=True, budget=10 * row).chunk == 4
    with pytest.raises(ConfigError, match=r"--token-chunk 11 .*at most 10"):
        TokenPlan.make(shapes, seq_len=256, rows=255, dense_query=True, budget=10 * row + 5,
                       chunk=11)
    with pytest.raises(ConfigError, match="raise --token-memory-gb"):
        TokenPlan.make(shapes, seq_len=256, rows=255, dense_query=True, budget=row - 1)
