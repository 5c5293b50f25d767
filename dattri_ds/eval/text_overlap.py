"""Text-overlap baseline: TF-IDF cosine similarity of character n-grams (no model at all).

The reference point of an attribution benchmark: a method that does not beat "the training
text looks like the query" has learned nothing about the model. For every document the
counts of its character n-grams (``n`` in ``ngrams``, with a word-boundary space added at
both ends) are weighted ``tf * idf`` with the smoothed idf of the training documents,
``idf(t) = ln((1 + N) / (1 + df(t))) + 1``, L2-normalized, and ``score[n, q]`` is the
cosine similarity of training document n and query q (>= 0; higher = more alike).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

from dattri_ds.errors import ConfigError

__all__ = ["char_ngrams", "tfidf_scores", "with_text_prior", "zscore"]


def char_ngrams(text: str, ngrams: Sequence[int] = (3, 4, 5)) -> Counter[str]:
    """Counts of the character n-grams of ``" " + text + " "`` for every n in ``ngrams``."""
    padded = f" {' '.join(text.split())} "
    return Counter(padded[i:i + n] for n in ngrams for i in range(len(padded) - n + 1))


def tfidf_scores(train: Sequence[str], queries: Sequence[str],
                 ngrams: Sequence[int] = (3, 4, 5)) -> torch.Tensor:
    """``[N, Q]`` cosine similarities of TF-IDF character n-gram vectors (module docstring).

    Sparse: two passes over ``train`` (document frequencies, then each document's norm and
    its dot products with the queries' vectors); memory is the n-gram vocabulary's counts,
    the queries' vectors and the ``[N, Q]`` result, never an ``[N, V]`` matrix.

    Args:
        train: the N training texts (they define the vocabulary and the idf).
        queries: the Q query texts (n-grams absent from the training texts are dropped).
        ngrams: character n-gram lengths.

    Returns:
        float64 ``[N, Q]``; a text without any known n-gram has zero similarity to all.
    """
    df: Counter[str] = Counter()
    n = 0
    for text in train:
        df.update(char_ngrams(text, ngrams).keys())
        n += 1

    def idf(g: str) -> float:
        return math.log((1 + n) / (1 + df[g])) + 1

    qvec: dict[str, list[float]] = {}  # n-gram -> its weight in each query (unit vectors)
    for j, q in enumerate(queries):
        w = {g: c * idf(g) for g, c in char_ngrams(q, ngrams).items() if g in df}
        norm = max(math.sqrt(sum(v * v for v in w.values())), 1e-300)
        for g, v in w.items():
            qvec.setdefault(g, [0.0] * len(queries))[j] = v / norm
    out = torch.zeros(n, len(queries), dtype=torch.float64)
    for r, text in enumerate(train):
        w = {g: c * idf(g) for g, c in char_ngrams(text, ngrams).items()}
        norm = max(math.sqrt(sum(v * v for v in w.values())), 1e-300)
        row = [0.0] * len(queries)
        for g, v in w.items():
            hit = qvec.get(g)
            if hit is not None:
                for j, u in enumerate(hit):
                    row[j] += v * u
        out[r] = torch.tensor(row, dtype=torch.float64) / norm
    return out


def with_text_prior(scores: torch.Tensor, overlap: torch.Tensor, weight: float) -> torch.Tensor:
    """A method's ``[N, Q]`` scores plus a text-overlap prior, in the scores' own units.

    Per query column: ``s + weight * std(s) * z(overlap)``, ``z`` standardized over the N
    training rows. Within a query this ranks as ``z(s) + weight * z(overlap)`` (what
    ``benchmarks/lds.py --hybrid-weights`` measures), while a score keeps its scale and, for
    weight 0, is the method's own. A column whose overlap is constant adds nothing.

    Raises:
        ConfigError: shapes differ, or ``weight`` is negative or not finite.
    """
    if scores.shape != overlap.shape or scores.dim() != 2:
        raise ConfigError(f"with_text_prior: scores {tuple(scores.shape)} and overlap "
                          f"{tuple(overlap.shape)} must both be [N, Q]")
    if not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"text weight must be a finite number >= 0, got {weight}")
    if weight == 0 or scores.shape[0] < 2:
        return scores
    z = zscore(overlap.to(torch.float64))
    return scores + (weight * scores.to(torch.float64).std(0, keepdim=True) * z).to(scores.dtype)


def zscore(values: torch.Tensor) -> torch.Tensor:
    """``[N, Q]`` scores standardized per query over the N training rows,
    ``(s - mean_N s) / std_N s``; a constant column becomes 0."""
    sd = values.std(0, keepdim=True)
    z = (values - values.mean(0, keepdim=True)) / sd.clamp_min(torch.finfo(values.dtype).tiny)
    return torch.where(sd > 0, z, torch.zeros_like(z))
