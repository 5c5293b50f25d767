"""Per-token attribution: scores ``[N, Q, T]`` of training examples against each query token.

The influence of training example n on the loss of query q's token t is
``score[n, q, t] = <g_n, grad l[q, t]>``, with ``l[q, t]`` the loss of predicting label
``labels[q, t]`` (from position ``t - shift``). Summed over t it is the sequence score
``<g_n, grad L_q>`` (``L_q = sum_t l[q, t]``, the default per-example loss).

``grad l[q, t]`` is a per-example gradient in its own right: that of a copy of query q
whose labels keep token t only (every other label ``ignore_index``). So one row per
(query, loss-bearing token) goes through the ordinary capture (``collect``): a batch of
copies costs one forward and one backward per row, exactly what ``T`` separate token
gradients cost, and every row stays factorized (or projected) as any GradBatch; the
scoring routes each layer's cross gram through the cost model (ghost vs. dense), so no
per-token weight gradient ``[O, I]`` is built unless the cost model finds it cheaper.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn

from dattri_ds.collect import collect
from dattri_ds.config import CaptureConfig
from dattri_ds.errors import ConfigError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops.cost import CostModel

__all__ = ["token_rows", "collect_per_token", "scatter_tokens"]

Batch = Mapping[str, torch.Tensor]


def token_rows(batch: Batch, *, ignore_index: int = -100,
               label_shift: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One copy of a query per loss-bearing token, labels keeping that token only.

    Args:
        batch: query inputs ``{"input_ids": [Q, T], "labels": [Q, T], ...}`` (without
            ``labels``, every position ``t >= shift`` with ``attention_mask`` 1 bears loss).
        ignore_index: the label that carries no loss.
        label_shift: 1 for causal LMs (``labels[t]`` is predicted at ``t - 1``).

    Returns:
        ``rows``: the copies, ``[R, T]`` per entry; ``where``: ``[R, 2]`` ``(q, t)`` of each.
    """
    ids = batch["input_ids"]
    labels = batch.get("labels")
    if labels is None:
        mask = batch.get("attention_mask")
        labels = ids if mask is None else ids.masked_fill(mask == 0, ignore_index)
    valid = labels != ignore_index
    valid[:, :label_shift] = False  # positions no earlier token predicts
    where = valid.nonzero()
    if where.numel() == 0:
        raise ConfigError("The queries have no loss-bearing token (every label is "
                          f"{ignore_index} or falls before the label shift)")
    q, t = where[:, 0], where[:, 1]
    rows = {k: v[q] for k, v in batch.items()
            if torch.is_tensor(v) and v.shape[:1] == ids.shape[:1]}
    only = torch.full_like(labels[q], ignore_index)
    only[torch.arange(q.numel()), t] = labels[q, t]
    rows["labels"] = only
    return rows, where


def collect_per_token(model: nn.Module, queries: Batch, config: CaptureConfig | None = None, *,
                      batch_size: int = 16, device: torch.device | str | None = None,
                      cost: CostModel | None = None) -> tuple[GradBatch, torch.Tensor]:
    """The gradients ``grad l[q, t]`` of every loss-bearing query token, as one GradBatch.

    ``config.per_example_loss`` must be ``"sum"``: only then do the token scores sum to the
    sequence scores.

    Returns:
        The GradBatch (``R`` rows) and ``where [R, 2]`` ``(q, t)`` of its rows.
    """
    cfg = config or CaptureConfig()
    if cfg.per_example_loss != "sum":
        raise ConfigError(f"per-token attribution needs capture.per_example_loss='sum' (token "
                          f"scores then sum to the sequence score), got "
                          f"'{cfg.per_example_loss}'")
    rows, where = token_rows(queries, ignore_index=cfg.ignore_index, label_shift=cfg.label_shift)
    n = where.shape[0]

    def chunks() -> Iterator[dict[str, torch.Tensor]]:
        for s in range(0, n, batch_size):
            yield {k: v[s:s + batch_size] for k, v in rows.items()}

    grads = GradBatch.cat(list(collect(model, chunks(), cfg, device=device, cost=cost)))
    return grads, where


def scatter_tokens(values: torch.Tensor, where: torch.Tensor, q: int, t: int) -> torch.Tensor:
    """``[N, R]`` row scores -> ``[N, Q, T]`` (0 at tokens without loss)."""
    out = values.new_zeros(values.shape[0], q, t)
    out[:, where[:, 0], where[:, 1]] = values
    return out
