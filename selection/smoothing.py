"""Neighbour smoothing: a candidate's score shared with the texts most like it, so the choice
follows what a *kind* of text does for the target (docs/selection.md):

    s~_b = mean of s_j over the K nearest of {b} + memory, by cosine of phi(b), phi(j)

``phi`` is a hashed, unit-norm bag of unigrams and bigrams of the valid tokens; the memory
holds the last ``memory`` scored candidates of this rank (no communication)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from dattri_ds.errors import ConfigError

__all__ = ["NGRAM_DIM", "ngram_features", "unit_rows", "CandidateText", "NeighborSmoother"]

_P1, _P2, _P3 = 1_000_003, 998_244_353, 911_382_323

NGRAM_DIM = 2048
"""Hash buckets of ``ngram_features`` (smoothing and the content prior share them)."""


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit norm (zero rows stay zero)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def ngram_features(input_ids: torch.Tensor, valid: torch.Tensor, dim: int = NGRAM_DIM,
                   normalize: bool = True) -> torch.Tensor:
    """``[C, dim]`` unit-norm hashed counts of each row's valid unigrams and bigrams.

    Args:
        input_ids: ``[C, T]`` token ids.
        valid: ``[C, T]`` bool, the positions that hold tokens (attention mask).
        dim: hash buckets.
        normalize: unit-norm rows (False: the raw counts).
    """
    ids = input_ids.long().cpu()
    ok = valid.bool().cpu()
    c = ids.shape[0]
    out = torch.zeros(c, dim, dtype=torch.float32)
    uni = (ids * _P1) % dim
    out.scatter_add_(1, uni, ok.float())
    if ids.shape[1] > 1:
        bi = (ids[:, :-1] * _P2 + ids[:, 1:] * _P3) % dim
        out.scatter_add_(1, bi, (ok[:, :-1] & ok[:, 1:]).float())
    return unit_rows(out) if normalize else out


@dataclass(frozen=True)
class CandidateText:
    """A micro-batch's candidates as text, hashed once and shared by every rank stage.

    Attributes:
        ids: ``[C, T]`` token ids.
        valid: ``[C, T]`` attention mask (None: every position holds a token).
        content: ``[C]`` content-prior scores this step already computed (the cascade's
            shortlist): the content rank stage reads them instead of scoring (and counting
            into the stream) the same candidates again. None: not computed.
    """

    ids: torch.Tensor
    valid: torch.Tensor | None = None
    content: torch.Tensor | None = None

    def subset(self, positions: torch.Tensor,
               content: torch.Tensor | None = None) -> CandidateText:
        """The candidates at ``positions`` (their hashed counts indexed, not recomputed),
        with ``content [C]`` (of all of these candidates) or this text's own."""
        pos = positions.to(self.ids.device)
        content = self.content if content is None else content
        out = CandidateText(self.ids[pos], None if self.valid is None else self.valid[pos],
                            None if content is None else content[positions])
        if "counts" in self.__dict__:
            out.__dict__["counts"] = self.counts[positions]  # prefill the cached_property
        return out

    @cached_property
    def counts(self) -> torch.Tensor:
        """``[C, NGRAM_DIM]`` raw hashed unigram + bigram counts of the valid tokens."""
        valid = torch.ones_like(self.ids) if self.valid is None else self.valid
        return ngram_features(self.ids, valid, NGRAM_DIM, normalize=False)

    @cached_property
    def unit(self) -> torch.Tensor:
        """``counts`` with unit-norm rows (the smoothing's content features)."""
        return unit_rows(self.counts)


class NeighborSmoother:
    """Replaces each score by the mean score of its ``k`` nearest texts (itself included).

    The ``smooth_neighbors`` rank stage (selection/rank.py): ``smoother(ranked, text)``.

    Args:
        k: neighbours averaged (``1``: no smoothing).
        memory: earlier scored candidates kept as neighbours (FIFO).
        dim: feature buckets of ``ngram_features``.
    """

    def __init__(self, k: int, memory: int, dim: int = NGRAM_DIM) -> None:
        self.k, self.memory, self.dim = k, memory, dim
        self._feats = torch.zeros(0, dim)
        self._scores = torch.zeros(0)

    def __call__(self, ranked: torch.Tensor, text: CandidateText) -> torch.Tensor:
        """The rank stage: ``smooth_features`` on the candidates' hashed text."""
        return self.smooth_features(text.unit, ranked)

    def smooth_features(self, f: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``[C]`` smoothed scores of a batch's candidates from their unit-norm
        ``ngram_features`` ``f`` ``[C, dim]``; the batch then joins the memory."""
        s = scores.detach().float().cpu()
        feats, vals = torch.cat([f, self._feats]), torch.cat([s, self._scores])
        sim = f @ feats.T  # [C, C + M]; a row's own column (similarity 1) comes first
        k = min(self.k, feats.shape[0])
        near = sim.topk(k, dim=1).indices
        smoothed = vals[near].mean(1)
        self._feats = feats[:self.memory]
        self._scores = vals[:self.memory]
        return smoothed.to(scores.dtype)

    def state_dict(self) -> dict:
        """The memory for a checkpoint: features ``[M, dim]`` and scores ``[M]``."""
        return {"feats": self._feats.clone(), "scores": self._scores.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the memory ``state_dict`` saved.

        Raises:
            ConfigError: a memory of another width or longer than ``memory``.
        """
        feats, scores = state["feats"], state["scores"]
        if (feats.dim() != 2 or feats.shape[1] != self.dim or feats.shape[0] > self.memory
                or scores.shape != (feats.shape[0],)):
            raise ConfigError(f"The smoothing memory in the checkpoint holds "
                              f"{tuple(feats.shape)} features, this smoother keeps up to "
                              f"({self.memory}, {self.dim}): resume with the selection "
                              f"settings that wrote it (selection.smooth_memory)")
        self._feats, self._scores = feats.clone(), scores.clone()
