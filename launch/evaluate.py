"""Held-out evaluation during training: the target (and general) loss every ``--eval-every`` steps.

``make_evaluator`` returns the ``evaluate()`` that ``RunLog`` (launch/runlog.py) calls at
step 0 and every ``train.eval_every`` steps; ``tokenized_texts`` reads a jsonl file of texts
into model inputs through the run's tokenizer (the evaluation sets here, the selection target
in launch/train.py); ``text_reads`` names the files a run reads.
"""

from __future__ import annotations

import torch

from dattri_ds.distributed import all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.launch.config import RunConfig

__all__ = ["make_evaluator", "tokenized_texts", "text_reads"]


def text_reads(cfg: RunConfig) -> list[tuple[str, str, slice, bool]]:
    """The jsonl texts a run reads besides its training data, ``(path, flag, rows,
    held_out)``: the selection target (``--target-data``, its first ``target_max_docs``), the
    held-out target (``--eval-data``, else the target file after ``eval_skip``) and
    ``--general-eval-data``."""
    sc, tc = cfg.selection, cfg.train
    reads = []
    if sc.enabled and sc.target_data is not None and not sc.target_store:
        reads.append((sc.target_data, "--target-data", slice(0, sc.target_max_docs), False))
    if tc.eval_every and tc.eval_data is not None:
        reads.append((tc.eval_data, "--eval-data", slice(0, tc.eval_max_docs), True))
    elif tc.eval_every and sc.target_data is not None:  # held out from the target file
        reads.append((sc.target_data, "--target-data",
                      slice(tc.eval_skip, tc.eval_skip + tc.eval_max_docs), True))
    if tc.eval_every and tc.general_eval_data is not None:
        reads.append((tc.general_eval_data, "--general-eval-data", slice(0, tc.eval_max_docs),
                      True))
    return reads


def tokenized_texts(path: str, tok, seq_len: int, rows: slice = slice(None)):
    """The documents ``rows`` of the jsonl file ``path``, one example each of ``seq_len``
    tokens, tokenized as the training corpus stores a document (``tokenize_documents``)."""
    from dattri_ds.data import load_documents, tokenize_documents

    return tokenize_documents(load_documents(path)[rows], tok, seq_len)


def make_evaluator(model, cfg: RunConfig, tok, seq_len: int, ctx, device):
    """``evaluate() -> {"target_loss": ..., "general_loss": ...}`` mean token losses on
    held-out texts (``text_reads``; ``general_loss`` only with ``train.general_eval_data``),
    each DP rank a share; None when ``train.eval_every`` is 0.

    Every rank runs the same number of forward calls (``ceil(N / (8 * dp_world))``, a rank
    without rows left runs a zero-weight batch) so ZeRO-3 gathers and tensor-parallel
    collectives stay in step; the token-weighted sums are all-reduced over the DP group.
    """
    tc = cfg.train
    if not tc.eval_every:
        return None
    if (tc.eval_data or cfg.selection.target_data) is None:
        raise ConfigError("--eval-every needs held-out texts: pass --eval-data FILE.jsonl")
    sets = {"general_loss" if flag == "--general-eval-data" else "target_loss":
            tokenized_texts(path, tok, seq_len, rows)
            for path, flag, rows, held_out in text_reads(cfg) if held_out}
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
