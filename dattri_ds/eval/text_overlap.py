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

__all__ = ["char_ngrams", "tfidf_scores"]


def char_ngrams(text: str, ngrams: Sequence[int] = (3, 4, 5)) -> Counter[str]:
    """Counts of the character n-grams of ``" " + text + " "`` for every n in ``ngrams``."""
    padded = f" {' '.join(text.split())} "
    return Counter(padded[i:i + n] for n in ngrams for i in range(len(padded) - n + 1))


def tfidf_scores(train: Sequence[str], queries: Sequence[str],
                 ngrams: Sequence[int] = (3, 4, 5)) -> torch.Tensor:
    """``[N, Q]`` cosine similarities of TF-IDF character n-gram vectors (module docstring).

    Args:
        train: the N training texts (they define the vocabulary and the idf).
        queries: the Q query texts (n-grams absent from the training texts are dropped).
        ngrams: character n-gram lengths.

    Returns:
        float64 ``[N, Q]``; a text without any known n-gram has zero similarity to all.
    """
    counts = [char_ngrams(t, ngrams) for t in train]
    df: Counter[str] = Counter()
    for c in counts:
        df.update(c.keys())
    vocab = {g: j for j, g in enumerate(sorted(df))}
    idf = torch.tensor([math.log((1 + len(train)) / (1 + df[g])) + 1 for g in vocab],
                       dtype=torch.float64)

    def matrix(texts_counts: list[Counter[str]]) -> torch.Tensor:
        m = torch.zeros(len(texts_counts), len(vocab), dtype=torch.float64)
        for r, c in enumerate(texts_counts):
            cols = [(vocab[g], v) for g, v in c.items() if g in vocab]
            if cols:
                j, v = zip(*cols)
                m[r, list(j)] = torch.tensor(v, dtype=torch.float64)
        m = m * idf
        return m / m.norm(dim=1, keepdim=True).clamp_min(1e-300)

    return matrix(counts) @ matrix([char_ngrams(q, ngrams) for q in queries]).T
