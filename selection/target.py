"""The target of a selection, built in one place (``build_target``): the documents, their
gradient's ``TargetProvider`` and the score's rows (docs/selection_stages.md, "Three things
called target").

``ValidationTarget``: the mean per-example gradient of the target set, recomputed every
``refresh_every`` steps with probe passes; ``FixedTarget``: the mean vector of a gradient
store. Both give a one-row GradBatch of dense per-layer vectors (``[1, D]`` or ``[1, P]``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dattri_ds.capture.hooks import GradientCapture
from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.gradient import Dense, GradBatch
from dattri_ds.ops import GradAccumulator

from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.state import grad_batch_from_state, grad_batch_state

if TYPE_CHECKING:
    from torch import nn

__all__ = ["TargetProvider", "ValidationTarget", "FixedTarget", "Target", "build_target"]

Batch = dict[str, torch.Tensor]


class TargetProvider(ABC):
    """Gives the target gradient for a step (recomputing it when stale)."""

    refreshes: int = 0
    """Times the target was (re)computed so far (0: a fixed target)."""

    @property
    def rows_per_rank(self) -> int:
        """Target examples this rank forwards per refresh (0: a fixed target)."""
        return 0

    @abstractmethod
    def get(self, step: int) -> GradBatch:
        """One-row GradBatch: the target gradient to score candidates against at ``step``."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this provider (default: nothing, a provider whose
        ``get`` depends on the step alone, such as ``FixedTarget``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved."""


class ValidationTarget(TargetProvider):
    """Mean per-example gradient of a target set, refreshed every ``refresh_every`` steps.

    Args:
        probe: a probe capture on the trained model (its projection, if any, applies).
        forward: ``forward(batch) -> reduced loss`` calling the model once.
        data: target model inputs ``{"input_ids": [N, T], ...}`` (``attention_mask``,
            ``labels`` optional), on CPU.
        ctx: data-parallel group; each rank takes rows ``rank::world`` and sums are reduced.
        refresh_every: steps between recomputations.
        batch_size: examples per probe pass.
        device: where the batches go.
        own_rows: ``data`` differs between data-parallel ranks (e.g. each rank's own sample
            of its candidates): every rank uses all of its rows and the mean is over the
            union (every rank must hold the same number). Default: the rows are the same on
            every rank and are split between them.
    """

    def __init__(self, probe: GradientCapture, forward: Callable[[Batch], torch.Tensor],
                 data: Batch, *, ctx: ParallelContext | None = None, refresh_every: int = 10,
                 batch_size: int = 8, device: torch.device | str = "cpu",
                 own_rows: bool = False) -> None:
        n = data["input_ids"].shape[0]
        if n == 0:
            raise ConfigError("The target set is empty: give selection.target_data at least "
                              "one document")
        self.probe, self.forward, self.data = probe, forward, data
        self.ctx = ctx or ParallelContext()
        self.refresh_every, self.batch_size, self.device = refresh_every, batch_size, device
        self.n, self.own_rows = n, own_rows
        self._value: GradBatch | None = None
        self._at = -1
        self.refreshes = 0

    def get(self, step: int) -> GradBatch:
        if self._value is None or step - self._at >= self.refresh_every:
            self._value = self._compute()
            self._at = step
            self.refreshes += 1
        return self._value

    def state_dict(self) -> dict:
        """The refresh clock (step of the last refresh, refresh count) and the cached rows:
        saved, not recomputed, since they hold the model of the last refresh."""
        return {"value": grad_batch_state(self._value), "at": self._at,
                "refreshes": self.refreshes}

    def load_state_dict(self, state: dict) -> None:
        self._value = grad_batch_from_state(state["value"], self.probe.layers)
        self._at, self.refreshes = int(state["at"]), int(state["refreshes"])

    @property
    def rows_per_rank(self) -> int:
        """Target examples this rank forwards per refresh."""
        return self._rows().numel()

    def _rows(self) -> torch.Tensor:
        ctx = self.ctx
        if self.own_rows or self.n < ctx.dp_world:  # own rows, or too few to split: all
            return torch.arange(self.n)
        return torch.arange(ctx.dp_rank, self.n, ctx.dp_world)

    def _compute(self) -> GradBatch:
        acc = GradAccumulator(self.probe.cost)
        rows = self._rows()
        for start in range(0, rows.numel(), self.batch_size):
            idx = rows[start:start + self.batch_size]
            batch = {k: v[idx].to(self.device) for k, v in self.data.items()}
            got = self.probe.probe(lambda b=batch: self.forward(b))
            if got is not None:
                acc.add(got)
        split = self.own_rows or self.n >= self.ctx.dp_world  # reduce over ranks
        total = acc.total()
        count = torch.tensor(float(acc.count), device=self.device)
        if split:
            all_reduce_sum(count, self.ctx.dp_group, self.ctx.dp_world)
        layers = {}
        for name, lg in total.layers.items():
            vals = lg.data.values
            if split:
                all_reduce_sum(vals, self.ctx.dp_group, self.ctx.dp_world)
            layers[name] = lg.replace(data=Dense(vals / count.to(vals.device)))
        return GradBatch(step=-1, sample_ids=("target",), layers=layers)


class FixedTarget(TargetProvider):
    """The mean vector of a gradient store: a fixed target in the store's projected space."""

    def __init__(self, path: str, block_rows: int = 4096) -> None:
        from dattri_ds.store import GradientStore

        acc = GradAccumulator()
        with GradientStore.open(path) as store:
            if len(store) == 0:
                raise ConfigError(f"The target store '{path}' holds no examples")
            for batch in store.iter_batches(block_rows):
                acc.add(batch)
        self._value = acc.mean("target")

    def get(self, step: int) -> GradBatch:
        return self._value


@dataclass(frozen=True)
class Target:
    """A selection's target, its parts named apart (module docstring).

    Attributes:
        gradient: the target gradient's provider (the documents', or a store's).
        documents: the documents' model inputs (None: a store, no text).
    """

    gradient: TargetProvider
    documents: Batch | None = None


def build_target(config: SelectionConfig, model: nn.Module, documents: Batch | None, *,
                 probe: GradientCapture, ctx: ParallelContext | None = None,
                 device: torch.device | str = "cpu") -> Target:
    """The target of ``config``: the store's ``FixedTarget`` (``target_store``), or a
    ``ValidationTarget`` on the ``documents`` (model inputs)."""
    if config.target_store:
        from dattri_ds.store.attach import checked_target_store  # compared at build time

        return Target(FixedTarget(checked_target_store(config.target_store, probe)))
    return Target(ValidationTarget(probe, lambda b: model(**b).loss, documents, ctx=ctx,
                                   refresh_every=config.refresh_every,
                                   batch_size=config.target_batch_size, device=device),
                  documents)
