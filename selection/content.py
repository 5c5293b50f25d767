"""Content prior (DSIR-style): how much more likely a candidate's text is under the target
than under the candidate stream, from hashed n-gram multinomials:

    c_b = (1 / n_b) sum over b's valid unigrams and bigrams h of [log p_t(h) - log p_s(h)]

``p_t``: add-one smoothed frequencies of the target documents' hashed unigrams and bigrams;
``p_s``: the same over every candidate this rank has seen, the current ones included. No
model, no gradient; counts are per data-parallel rank. Why it is the default:
docs/selection.md."""

from __future__ import annotations

import torch

from dattri_ds.selection.smoothing import NGRAM_DIM, CandidateText, ngram_features

__all__ = ["ContentPrior", "ContentRanking", "DEFAULT_CONTENT_WEIGHT", "standardize",
           "with_content"]

DEFAULT_CONTENT_WEIGHT = 1.0
"""``selection.content_weight`` when unset and the target is documents (docs/selection.md)."""


def standardize(x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` over the candidates (0 where they are all equal)."""
    x = x.float()
    sd = x.std(unbiased=False) if x.numel() > 1 else x.new_zeros(())
    return (x - x.mean()) / sd if float(sd) > 0 else torch.zeros_like(x)


def with_content(scores: torch.Tensor, content: torch.Tensor, weight: float) -> torch.Tensor:
    """What the policy ranks: ``z(scores) + weight * z(content)``."""
    return standardize(scores) + weight * standardize(content)


class ContentPrior:
    """Target-vs-stream log-likelihood ratio of each candidate's hashed n-grams.

    Args:
        target: target documents' model inputs (``input_ids``, optional ``attention_mask``).
        dim: hash buckets (``ngram_features``).
    """

    def __init__(self, target: dict[str, torch.Tensor], dim: int = NGRAM_DIM) -> None:
        self.dim = dim
        t = self._counts(target["input_ids"], target.get("attention_mask")).sum(0)
        self._log_target = torch.log((t + 1) / (t.sum() + dim))
        self._stream = torch.zeros(dim)

    def _counts(self, ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        valid = torch.ones_like(ids) if valid is None else valid
        return ngram_features(ids, valid, self.dim, normalize=False)

    def scores(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None
               ) -> torch.Tensor:
        """``[C]`` mean log-ratio per candidate; the candidates join the stream counts first."""
        return self.scores_of_counts(self._counts(input_ids, valid))

    def scores_of_counts(self, c: torch.Tensor) -> torch.Tensor:
        """``scores`` on the candidates' raw ``ngram_features`` counts ``c`` ``[C, dim]``."""
        self._stream += c.sum(0)
        log_stream = torch.log((self._stream + 1) / (self._stream.sum() + self.dim))
        return (c @ (self._log_target - log_stream)) / c.sum(1).clamp_min(1)

    def state_dict(self) -> dict:
        """The stream counts ``[dim]`` and the target's log-frequencies (for a checkpoint)."""
        return {"stream": self._stream.clone(), "log_target": self._log_target.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the stream counts.

        Raises:
            ConfigError: the target documents differ from those the state was made with.
        """
        from dattri_ds.errors import ConfigError

        if not torch.equal(state["log_target"], self._log_target):
            raise ConfigError("The content prior's target documents differ from those the "
                              "checkpoint was written with: resume with the same "
                              "selection.target_data (and tokenizer), or start a fresh run")
        self._stream = state["stream"].clone()


class ContentRanking:
    """The ``content_weight`` rank stage (selection/rank.py): ``z(ranked) + weight * z(c)``.

    Args:
        documents: the target documents' model inputs (the prior's target counts).
        weight: ``content_weight`` (> 0).
    """

    def __init__(self, documents: dict[str, torch.Tensor], weight: float) -> None:
        self.prior, self.weight = ContentPrior(documents), weight

    def __call__(self, ranked: torch.Tensor, text: CandidateText) -> torch.Tensor:
        content = text.content  # computed already by the cascade's shortlist
        if content is None:
            content = self.prior.scores_of_counts(text.counts)
        return with_content(ranked, content, self.weight)
