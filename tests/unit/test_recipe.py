"""The one per-checkpoint attribution recipe (dattri_ds/methods/recipe.py) shared by attribute and lds.

Invariants: rows whitened by a checkpoint's factors and kept exactly (k above every layer's
size) score as the exact curvature method scores raw rows (``<W g_n, W g_q> = g_n^T F^-p
g_q``); a trajectory reads every checkpoint, a single-checkpoint method the last;
combinations that have no meaning (whitened rows for grad-dot, LoGra without a Kronecker
projection) are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import CaptureConfig, Checkpoint, ProjectionConfig, collect
from dattri_ds.errors import ConfigError
from dattri_ds.methods.recipe import Recipe


def _captures():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1,
                                       n_head=2, tie_word_embeddings=False)).eval()
    ids = torch.randint(0, 32, (6, 8), generator=torch.Generator().manual_seed(1))

    def grads(x, bs):
        return list(collect(model, ({"input_ids": x[s:s + bs], "labels": x[s:s + bs]}
                                    for s in range(0, len(x), bs))))
    return grads(ids, 3), grads(ids[:2], 2)


def _scores(recipe: Recipe, train, query) -> torch.Tensor:
    factors = recipe.fit(train) if recipe.curvature else None
    ck = Checkpoint(recipe.rows(train, factors), recipe.query(query[0]), 1.0, factors)
    return recipe.score(recipe.select([ck])).values


def test_whitened_rows_kept_exactly_score_as_exact_ekfac():
    """Whitened rows (k above every layer: kept exactly) == exact EK-FAC scores. Breaks if
    the recipe whitens rows and query with different factors or projects one side twice."""
    train, query = _captures()
    exact = _scores(Recipe(method="ekfac"), train, query)
    white = _scores(Recipe(method="ekfac", whitened=True,
                           projection=ProjectionConfig(kind="dense", dim=1 << 20)), train, query)
    torch.testing.assert_close(white, exact, rtol=1e-4, atol=1e-6 * float(exact.abs().max()))


def test_properties_and_refusals():
    """Trajectories read all checkpoints, the others the last; meaningless combinations are
    ConfigErrors naming the method or projection."""
    assert Recipe(method="tracin").select([1, 2, 3]) == [1, 2, 3]
    assert Recipe(method="ekfac").select([1, 2, 3]) == [3]
    r = Recipe(method="kfac-trajectory")
    assert (r.trajectory, r.inner, r.curvature) == (True, "kfac", True)
    assert Recipe(method="graddot", projection=ProjectionConfig(dim=8)).query_capture(
        CaptureConfig()).projection.dim == 8
    assert Recipe(method="ekfac", projection=ProjectionConfig(dim=8)).query_capture(
        CaptureConfig()).projection is None  # preconditioned exactly, then projected
    with pytest.raises(ConfigError, match="graddot cannot score whitened"):
        Recipe(method="graddot", whitened=True)
    with pytest.raises(ConfigError, match="Kronecker"):
        Recipe(method="ekfac", logra=True, projection=ProjectionConfig(kind="dense", dim=8))
    with pytest.raises(ConfigError, match="nope"):
        Recipe(method="nope")
