"""TrainingCallback: what consumers of captured gradients implement (no-op defaults)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dattri_ds.gradient import GradBatch

__all__ = ["TrainingCallback", "DropBatches"]


class TrainingCallback:
    """Receives captured gradients during training; override what you need.

    ``on_batch`` runs at the end of every backward pass that produced a GradBatch (one per
    micro-batch), ``on_step_end`` at every optimizer-step boundary, ``on_detach`` whenever
    the capture detaches (``detach()``: it may attach again), ``on_close`` once when the
    capture closes.
    """

    def on_batch(self, batch: GradBatch) -> None:
        """A micro-batch's per-example gradients are ready."""

    def on_step_end(self, step: int) -> None:
        """Optimizer step ``step`` finished."""

    def on_detach(self) -> None:
        """The capture detached (and may attach again): make what was received durable
        (a store commits its buffered rows), keep resources open."""

    def on_close(self) -> None:
        """The capture detached; flush and release resources."""


class DropBatches(TrainingCallback):
    """Consumes and drops every batch: for a rank that must capture but keeps no rows.

    A tensor-parallel rank other than 0 holds the same examples as TP rank 0, which stores
    them; it still captures, because the projections of sharded layers all-reduce over the
    TP group. Without a callback its batches would wait in ``GradientCapture``'s queue for a
    ``pop()`` that never comes (memory growing by one batch per micro-batch).
    """

    def on_batch(self, batch: GradBatch) -> None:
        """Nothing: another rank keeps these rows."""
