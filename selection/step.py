"""What one selection step carries from stage to stage (``StepState``) and what it returns
(``Selection``).

Each stage (selection/stages.py) takes the step's state and returns a new one
(``dataclasses.replace``); nothing about a step is kept on the selector between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dattri_ds.gradient import GradBatch
from dattri_ds.selection.smoothing import CandidateText

__all__ = ["Batch", "Selection", "StepState"]

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Selection:
    """The outcome of one selection.

    Attributes:
        batch: model inputs of the chosen examples (``[k, T]`` tensors).
        indices: chosen candidate indices (into this rank's candidates).
        scores: ``[C]`` scores of this rank's candidates (of the kept ones when candidates
            with a NaN/inf gradient or score were dropped).
        chosen_ids: sample ids (content hashes) of the chosen examples.
        chosen_scores: ``[k]`` their scores.
        loss: with ``reuse_forward``, the model's loss on ``batch`` computed from the
            candidates' retained forward graphs: back-propagate it instead of forwarding
            ``batch`` again. None: forward ``batch`` as usual.
        probed: the positions of the candidates ``scores`` covers when not all were
            probed (the cascade's shortlist less dropped ones); ``chosen_scores`` is NaN for
            chosen examples outside it (the uniform share). None: ``scores`` covers all.
    """

    batch: Batch
    indices: torch.Tensor
    scores: torch.Tensor
    chosen_ids: tuple[str, ...]
    chosen_scores: torch.Tensor
    loss: torch.Tensor | None = None
    probed: torch.Tensor | None = None


@dataclass(frozen=True)
class StepState:
    """One micro-batch's selection so far.

    Attributes:
        batch: all ``C`` candidates' model inputs.
        k: examples to train from them.
        step: the optimizer step.
        user_ids: prefixes of the candidates' sample ids (e.g. document ids), or None.
        reuse: the probe keeps one graph per candidate for the training backward.
        text: the hashed n-grams of the candidates in play (``pool``).
        pool: positions (into ``batch``) of the candidates in play: the shortlist, less
            those dropped for a non-finite gradient or score. None: all ``C``.
        shortlisted: ``pool`` is the cascade's shortlist (the uniform share then comes
            from all ``C``, and ``Selection.probed`` names the pool).
        ids: sample ids of all ``C`` candidates, when a stage computed them without a
            probe (the shortlist, a text score).
        grads: the per-example gradients of the candidates in play (no layers for a score
            that reads none).
        scores: ``[P]`` scores of the candidates in play (float32, CPU): what is logged.
        ranked: ``[P]`` what the policy ranks (the scores through the rank stages).
        losses: with ``reuse``, the probed candidates' own losses (one graph each).
        selection: the outcome, set by the choosing stage.
    """

    batch: Batch
    k: int
    step: int
    user_ids: list[str] | None = None
    reuse: bool = False
    text: CandidateText | None = None
    pool: torch.Tensor | None = None
    shortlisted: bool = False
    ids: tuple[str, ...] | None = None
    grads: GradBatch | None = None
    scores: torch.Tensor | None = None
    ranked: torch.Tensor | None = None
    losses: tuple[torch.Tensor, ...] | None = None
    selection: Selection | None = None

    @property
    def candidates(self) -> int:
        """``C``: the micro-batch's candidates."""
        return self.batch["input_ids"].shape[0]

    def rows(self, positions: torch.Tensor) -> Batch:
        """The model inputs of the candidates at ``positions`` (into ``batch``)."""
        return {n: v[positions.to(v.device)] for n, v in self.batch.items()}

    def in_play(self) -> tuple[Batch, list[str] | None]:
        """The model inputs and user ids of the candidates in play (``pool``)."""
        if self.pool is None:
            return self.batch, self.user_ids
        users = None if self.user_ids is None else [self.user_ids[i] for i in self.pool.tolist()]
        return self.rows(self.pool), users
