"""Held-out evaluation during training: the target (and general) loss every ``--eval-every`` steps.

``make_evaluator`` returns the ``evaluate()`` that ``RunLog`` (launch/runlog.py) calls at
step 0 and every ``train.eval_every`` steps; ``tokenized_texts`` reads a jsonl file of texts
into model inputs (the evaluation sets here, the selection target in launch/train.py).
"""

from __future__ import annotations

import torch

from dattri_ds.distributed import all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.launch.config import RunConfig

__all__ = ["make_evaluator", "tokenized_texts"]


def tokenized_texts(path: str, tok, seq_len: int, skip: int, limit: int | None):
    """The documents of the jsonl file ``path`` after the first ``skip`` (at most ``limit``;
    None: all), tokenized to ``seq_len``."""
    from dattri_ds.data import load_documents, tokenize_documents

    docs = load_documents(path)[skip:]
    return tokenize_documents(docs[:limit] if limit else docs, tok, seq_len)


def make_evaluator(model, cfg: RunConfig, tok, seq_len: int, ctx, device):
    """``evaluate() -> {"target_loss": ..., "general_loss": ...}`` mean token losses on
    held-out texts (``general_loss`` only with ``train.general_eval_data``), each DP rank a
    share; None when ``train.eval_every`` is 0.

    Every rank runs the same number of forward calls (``ceil(N / (8 * dp_world))``, a rank
    without rows left runs a zero-weight batch) so ZeRO-3 gathers and tensor-parallel
    collectives stay in step; the token-weighted sums are all-reduced over the DP group.
    """
    tc = cfg.train
    if not tc.eval_every:
        return None
    path = tc.eval_data or cfg.selection.target_data
    if path is None:
        raise ConfigError("--eval-every needs held-out texts: pass --eval-data FILE.jsonl")
    sets = {"target_loss": tokenized_texts(path, tok, seq_len,
                                           tc.eval_skip if tc.eval_data is None else 0,
                                           tc.eval_max_docs)}
    if tc.general_eval_data:
        sets["general_loss"] = tokenized_texts(tc.general_eval_data, tok, seq_len, 0,
                                               tc.eval_max_docs)
    losses = {k: _loss_fn(model, ev, ctx, device) for k, ev in sets.items()}
    return lambda: {k: fn() for k, fn in losses.items()}


def _loss_fn(model, ev, ctx, device):
    """``() -> mean token loss`` of the examples ``ev``, split over the DP group."""
    rows = torch.arange(ctx.dp_rank, len(ev), ctx.dp_world)
    n_batches = max(-(-len(ev) // (8 * ctx.dp_world)), 1)  # the same count on every DP rank

    @torch.no_grad()
    def evaluate() -> float:
        was = model.training
        model.eval()
        tot = torch.zeros(2, dtype=torch.float64, device=device)
        for i in range(n_batches):
            idx, weight = rows[i * 8:(i + 1) * 8], 1.0
            if idx.numel() == 0:  # keep collectives in step on every rank
                idx, weight = torch.tensor([0]), 0.0
            b = {k: v.to(device) for k, v in ev.batch(idx).items()}
            n = float((b["labels"][:, 1:] != -100).sum()) * weight
            tot += torch.tensor([float(model(**b).loss) * n, n], dtype=torch.float64,
                                device=device)
        all_reduce_sum(tot, ctx.dp_group, ctx.dp_world)
        model.train(was)
        return float(tot[0] / tot[1].clamp_min(1))
    return evaluate
