"""Per-token attribution: scores ``[N, Q, T]`` of training examples against each query token.

The influence of training example n on the loss of query q's token t is
``score[n, q, t] = <g_n, grad l[q, t]>``, with ``l[q, t]`` the loss of predicting label
``labels[q, t]`` (from position ``t - shift``). Summed over t it is the sequence score
``<g_n, grad L_q>`` (``L_q = sum_t l[q, t]``, the default per-example loss).

``grad l[q, t]`` is the gradient of a copy of query q whose labels keep token t only, so
one row per (query, loss-bearing token) goes through the ordinary capture (``collect``)
and stays factorized or projected. The rows stream in chunks (``token_chunks``), each cut
after its last loss-bearing position (exact for causal LMs), sized by ``TokenPlan``
(``row = 4*3*T*sum(I+O)`` bytes, plus ``4*3*sum(I*O)`` for curvature methods'
dense preconditioned query). Measurements and memory: docs/offline_tools.md
("Per-token scores").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dattri_ds.capture.collect import collect
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.errors import ConfigError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops.cost import CostModel

__all__ = ["token_rows", "token_chunks", "token_gradients", "scatter_tokens", "TokenPlan"]

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


def token_chunks(queries: Batch, config: CaptureConfig | None = None, *, chunk: int,
                 trim: bool = True) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """The token rows of ``token_rows`` in chunks of at most ``chunk`` rows, each cut after
    its last loss-bearing position when ``trim`` (exact for causal LMs: module docstring).

    Yields:
        ``(rows, where)``: the chunk's inputs ``[C, T']`` per entry and its ``(q, t)``
        ``[C, 2]``.
    """
    cfg = config or CaptureConfig()
    if chunk < 1:
        raise ConfigError(f"per-token chunk must be >= 1 token rows, got {chunk}")
    rows, where = token_rows(queries, ignore_index=cfg.ignore_index, label_shift=cfg.label_shift)
    width = rows["input_ids"].shape[1]
    for s in range(0, where.shape[0], chunk):
        w = where[s:s + chunk]
        end = int(w[:, 1].max()) + 1 if trim else width
        part = {k: (v[s:s + chunk, :end] if v.dim() >= 2 and v.shape[1] == width
                    else v[s:s + chunk]) for k, v in rows.items()}
        yield part, w


def token_gradients(model: nn.Module, chunks: Iterable[dict[str, torch.Tensor]],
                    config: CaptureConfig | None = None, *, batch_size: int = 16,
                    device: torch.device | str | None = None,
                    cost: CostModel | None = None) -> GradBatch:
    """The gradients of one chunk's token rows (``token_chunks``), as one GradBatch."""
    cfg = config or CaptureConfig()
    if cfg.per_example_loss != "sum":
        raise ConfigError(f"per-token attribution needs capture.per_example_loss='sum' (token "
                          f"scores then sum to the sequence score), got "
                          f"'{cfg.per_example_loss}'")

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        for rows in chunks:
            n = rows["input_ids"].shape[0]
            for s in range(0, n, batch_size):
                yield {k: v[s:s + batch_size] for k, v in rows.items()}

    return GradBatch.cat(list(collect(model, batches(), cfg, device=device, cost=cost)))


def scatter_tokens(values: torch.Tensor, where: torch.Tensor, q: int, t: int) -> torch.Tensor:
    """``[N, R]`` row scores -> ``[N, Q, T]`` (0 at tokens without loss)."""
    out = values.new_zeros(values.shape[0], q, t)
    out[:, where[:, 0], where[:, 1]] = values
    return out


@dataclass(frozen=True)
class TokenPlan:
    """How many token rows a chunk holds and the bytes it is predicted to need.

    Attributes:
        chunk: token rows per chunk. row_bytes: predicted bytes of one row (module
        docstring). rows: loss-bearing token rows in all. budget: the bytes allowed for a
        chunk.
    """

    chunk: int
    row_bytes: int
    rows: int
    budget: int

    @property
    def need(self) -> int:
        """Predicted bytes of the largest chunk."""
        return min(self.chunk, self.rows) * self.row_bytes

    @property
    def chunks(self) -> int:
        return -(-self.rows // self.chunk)

    @staticmethod
    def row_cost(shapes: Iterable[tuple[int, int]], seq_len: int, dense_query: bool) -> int:
        """Predicted bytes of one token row (module docstring): ``shapes`` ``(O, I)`` per
        captured layer, ``dense_query`` for curvature methods."""
        shapes = list(shapes)
        row = 4 * 3 * seq_len * sum(o + i for o, i in shapes)
        if dense_query:
            row += 4 * 3 * sum(o * i for o, i in shapes)
        return row

    @staticmethod
    def make(shapes: Iterable[tuple[int, int]], *, seq_len: int, rows: int, dense_query: bool,
             budget: int, chunk: int | None = None) -> TokenPlan:
        """The largest chunk within ``budget`` bytes, or ``chunk`` checked against it.

        Raises:
            ConfigError: ``chunk`` rows (or one row) need more than ``budget``, naming the
                flag to change and the largest chunk that fits.
        """
        row = TokenPlan.row_cost(shapes, seq_len, dense_query)
        fit = budget // row
        gb, chunk_flag, budget_flag = 1024 ** 3, "--token-chunk", "--token-memory-gb"
        if fit < 1:
            raise ConfigError(
                f"per-token attribution: one token row of a {seq_len}-token query needs about "
                f"{row / gb:.2f} GB, above {budget_flag} {budget / gb:g}; raise {budget_flag} "
                f"or lower --seq-len")
        if chunk is None:
            return TokenPlan(int(min(fit, max(rows, 1))), row, rows, budget)
        if min(chunk, rows) > fit:
            raise ConfigError(
                f"per-token attribution: {chunk_flag} {chunk} needs about "
                f"{min(chunk, rows) * row / gb:.2f} GB ({row / 2**20:.1f} MB per token row), "
                f"above {budget_flag} {budget / gb:g}; lower {chunk_flag} to at most {fit} "
                f"(or raise {budget_flag})")
        return TokenPlan(chunk, row, rows, budget)
