"""The target of a selection: the one place it is built (``build_target``, ``prepare``).

"Target" names three things, kept apart here and in the selector:

* the target **documents**: model inputs of the texts the user cares about (``target_data``;
  the content prior reads them; a ``target_store`` has none);
* the target **gradient**: a ``TargetProvider`` of their mean gradient (or a store's mean
  vector), refreshed as the model moves, and the held-out part's (``validation_fraction``);
* the score's **rows**: what candidates are scored against, the gradient shaped by the
  optimizer (``precondition``) and by the score (contrast, the step score's pool row),
  built by ``Score.rows`` from the gradient and the pool sample's gradient.

Providers:

* ``ValidationTarget``: the mean per-example gradient of a target set, recomputed every
  ``refresh_every`` steps with probe passes (no parameter gradient is touched), the target
  examples split over data-parallel ranks and the per-layer sums all-reduced.
* ``FixedTarget``: the mean vector of a gradient store (projected space).

Both return a one-row GradBatch of dense per-layer vectors (``[1, D]`` exact or ``[1, P]``
projected): a dense target against factorized candidates is the cheap ``cross_dense``
route of the cost model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from dattri_ds.capture import GradientCapture
from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.gradient import Dense, GradBatch
from dattri_ds.ops import GradAccumulator

if TYPE_CHECKING:
    from torch import nn

    from dattri_ds.selection.config import SelectionConfig

__all__ = ["TargetProvider", "ValidationTarget", "FixedTarget", "Target", "build_target",
           "pool_reference", "prepare"]

Batch = dict[str, torch.Tensor]


class TargetProvider(ABC):
    """Gives the target gradient for a step (recomputing it when stale)."""

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
        from dattri_ds.selection.state import grad_batch_state

        return {"value": grad_batch_state(self._value), "at": self._at,
                "refreshes": self.refreshes}

    def load_state_dict(self, state: dict) -> None:
        from dattri_ds.selection.state import grad_batch_from_state

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
    """A selection's target, its three parts named apart (module docstring).

    Attributes:
        gradient: the target gradient's provider (scored part of the documents, or a store).
        documents: the scoring documents' model inputs (None: a store, no text).
        held_out: the held-out documents' gradient (``validation_fraction``), or None.
    """

    gradient: TargetProvider
    documents: Batch | None = None
    held_out: TargetProvider | None = None

    @classmethod
    def of(cls, gradient: TargetProvider, documents: Batch | None = None,
           held_out: TargetProvider | None = None) -> Target:
        """A target from a provider; ``documents`` default to a ValidationTarget's own."""
        if documents is None and isinstance(gradient, ValidationTarget):
            documents = gradient.data
        return cls(gradient, documents, held_out)


def build_target(config: SelectionConfig, model: nn.Module, documents: Batch | None, *,
                 probe: GradientCapture, ctx: ParallelContext | None = None,
                 device: torch.device | str = "cpu") -> Target:
    """The target of ``config``: the store's ``FixedTarget`` (``target_store``), or a
    ``ValidationTarget`` on the ``documents`` (model inputs), with every
    ``1/validation_fraction``-th document held out into its own provider."""
    from dattri_ds.selection.fallback import split_rows

    def validation_target(rows: Batch) -> ValidationTarget:
        return ValidationTarget(probe, lambda b: model(**b).loss, rows, ctx=ctx,
                                refresh_every=config.refresh_every,
                                batch_size=config.target_batch_size, device=device)

    if config.target_store:
        from dattri_ds.store.attach import checked_target_store  # compared at build time

        return Target(FixedTarget(checked_target_store(config.target_store, probe)))
    if config.validation_fraction > 0:
        keep, held = split_rows(documents["input_ids"].shape[0], config.validation_fraction)
        scoring = {k: v[keep] for k, v in documents.items()}
        return Target(validation_target(scoring), scoring,
                      validation_target({k: v[held] for k, v in documents.items()}))
    return Target(validation_target(documents), documents)


def pool_reference(model: nn.Module, config: SelectionConfig, gradient: TargetProvider,
                   probe: GradientCapture, ctx: ParallelContext | None
                   ) -> Callable[[Batch], TargetProvider]:
    """How a score's pool sample gets its gradient from its rows: like the target gradient
    (its forward, device, batch size and refresh when it is a ``ValidationTarget``; else the
    model's own loss), each rank on its own rows, averaged over all ranks'."""
    inner = getattr(gradient, "inner", gradient)
    if isinstance(inner, ValidationTarget):
        forward, device, bs = inner.forward, inner.device, inner.batch_size
    else:
        forward, bs = (lambda b: model(**b).loss), config.target_batch_size
        device = next(model.parameters()).device

    def make(rows: Batch) -> TargetProvider:
        return ValidationTarget(probe, forward, rows, ctx=ctx, refresh_every=config.refresh_every,
                                batch_size=bs, device=device, own_rows=True)
    return make


def prepare(target: Target, config: SelectionConfig, *, probe: GradientCapture,
            ctx: ParallelContext | None, optimizer=None,
            reference: Callable[[Batch], TargetProvider] | None = None
            ) -> tuple[Target, Callable[[Batch], TargetProvider] | None]:
    """``target`` and the pool's ``reference`` in the optimizer's metric: with
    ``precondition="adam"`` every gradient (target, held-out, pool) becomes ``P g``
    (selection/precondition.py); otherwise both unchanged."""
    if config.precondition != "adam":
        return target, reference
    from dattri_ds.selection.precondition import PreconditionedTarget, second_moments

    moments = second_moments(optimizer, ctx)

    def pre(provider: TargetProvider) -> TargetProvider:
        return PreconditionedTarget(provider, probe.layers, moments, ctx)

    shaped = replace(target, gradient=pre(target.gradient),
                     held_out=None if target.held_out is None else pre(target.held_out))
    if reference is None:
        return shaped, None
    base = reference
    return shaped, lambda rows: pre(base(rows))
