"""Attributor: the shared train x query scoring loop of inner-product attribution methods.

Every method scores a training example n against a query q as an inner product of their
per-example gradients after a method-specific *preconditioning of the query side*::

    score[n, q] = c_n c_q <g_n, M g_q>         (M = I, H^-1, ...; c = optional normalizers)

Sign convention: ``score[n, q] > 0`` means training on example n lowers the loss of query
q to first order. One SGD step of size ``lr`` on example n changes the query loss by
``-lr <g_q, g_n>``; upweighting n by ``eps`` in an objective with curvature H changes it by
``-eps <g_q, H^-1 g_n>``. So positive scores are *proponents*, negative *opponents*.

Methods override ``precondition(query) -> GradBatch`` (and optionally ``query_scale`` /
``train_scale``). Training gradients are read once, in batches, never preconditioned; both
sides may be factorized or projected rows in the same ``LayerGrad.space``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar, NamedTuple

import torch

from dattri_ds.errors import ShapeError
from dattri_ds.gradient import Dense, Factorized, GradBatch
from dattri_ds.ops.cost import CostModel
from dattri_ds.ops.inner import cross_gram, default_cost_model, materialize, project
from dattri_ds.ops.projection import Projector
from dattri_ds.registry import Registry

__all__ = ["Scores", "Attributor", "get_attributor", "registered_attributors",
           "make_attributor"]

METHODS: Registry[type[Attributor]] = Registry(
    "attribution method", hint="define class M(Attributor, name='m') before using it")


class Scores(NamedTuple):
    """Attribution scores; unpacks as ``train_ids, values = scores``.

    Attributes:
        train_ids: sample id of each row, in the order the training batches came.
        values: ``[N, Q]`` float32 on CPU, ``values[n, q] > 0`` = n helps q (module docstring).
    """

    train_ids: tuple[str, ...]
    values: torch.Tensor


class Attributor(ABC):
    """Base of attribution methods; ``class M(Attributor, name="m")`` registers ``m``.

    Args:
        layers: layer names to score on (default: every layer of the query).
        cost: cost model for the ghost/dense routing of the inner products.
        projector: the projection of the training rows (a store's ``ProjectionConfig``):
            query layers still unprojected after ``precondition`` are projected with it,
            so ``<P g_n, P (M g_q)>`` estimates ``<g_n, M g_q>`` (exact preconditioning,
            then one random projection: the error is that of the projection alone).
    """

    name: ClassVar[str]
    #: The weight of the text-overlap prior (``dattri_ds.eval.with_text_prior``) that
    #: ``attribute`` adds to the method's scores by default: chosen leave-one-regime-out on
    #: 16 LDS regimes, where it raised the method on every held-out regime or tied
    #: (docs/attribution_fidelity.md, "A second data set, and text overlap mixed into the
    #: scores"). Methods not measured with it (TracIn, grad-dot, grad-cos): 0.
    text_weight: ClassVar[float] = 0.0

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        METHODS.register_class(cls, name)

    def __init__(self, *, layers: Iterable[str] | None = None,
                 cost: CostModel | None = None, projector: Projector | None = None) -> None:
        self.layers = tuple(layers) if layers is not None else None
        self.cost = cost
        self.projector = projector

    # ---- what methods override ----------------------------------------------------------
    @abstractmethod
    def precondition(self, query: GradBatch) -> GradBatch:
        """The query side ``M g_q`` (same ids, same layers, any LayerGrad form)."""

    def query_scale(self, query: GradBatch, layers: tuple[str, ...]) -> torch.Tensor | None:
        """Optional per-query factor ``c_q`` ``[Q]`` (None = 1)."""
        return None

    def train_scale(self, train: GradBatch, layers: tuple[str, ...]) -> torch.Tensor | None:
        """Optional per-train-example factor ``c_n`` ``[B]`` (None = 1)."""
        return None

    # ---- the shared loop ----------------------------------------------------------------
    def select(self, batch: GradBatch) -> GradBatch:
        """Restrict a batch to ``self.layers`` (raising ShapeError naming a missing layer)."""
        if self.layers is None:
            return batch
        missing = [n for n in self.layers if n not in batch.layers]
        if missing:
            raise ShapeError(f"Layers {missing} are not in the gradient batch (it has "
                             f"{list(batch.layers)[:8]}...); capture them or drop them "
                             f"from layers=")
        return GradBatch(batch.step, batch.sample_ids, {n: batch.layers[n] for n in self.layers},
                         batch.micro_batch, batch.token_counts)

    def scores(self, train: Iterable[GradBatch],
               query: GradBatch | Iterable[GradBatch]) -> Scores:
        """``[N, Q]`` scores of every training example against every query, streaming.

        Args:
            train: training gradients, one GradBatch at a time (any batch sizes).
            query: the query gradients ``[Q]`` (preconditioned once here), or several
                query batches (``GradBatch.cat`` joins them).

        Returns:
            Scores with the concatenated train ids and ``values [N, Q]``.

        Raises:
            ShapeError: a scored layer is missing from a train batch, or the two sides are
                in different spaces (projection or shape), naming the layer.
        """
        if not isinstance(query, GradBatch):
            query = GradBatch.cat(list(query))
        query = self.select(query)
        names = tuple(query.layers)
        pq = self.precondition(query)
        if self.projector is not None:
            pq = _into_space(pq, self.projector, self.cost)
        qs = self.query_scale(query, names)
        ids: list[str] = []
        blocks: list[torch.Tensor] = []
        for batch in train:
            missing = [n for n in names if n not in batch.layers]
            if missing:
                raise ShapeError(
                    f"Layer '{missing[0]}' of the query is missing from the training batch "
                    f"(step {batch.step}, first id {batch.sample_ids[:1]}); score with "
                    f"layers= restricted to layers both sides hold")
            if not blocks:
                pq = _materialize_once(batch, pq, names, self.cost)
            s = cross_gram(batch, pq, names, self.cost)
            ts = self.train_scale(batch, names)
            if ts is not None:
                s = s * ts.to(s.device).unsqueeze(1)
            if qs is not None:
                s = s * qs.to(s.device).unsqueeze(0)
            blocks.append(s.detach().float().cpu())
            ids.extend(batch.sample_ids)
        values = torch.cat(blocks) if blocks else torch.zeros(0, query.batch_size)
        return Scores(tuple(ids), values)


def _into_space(pq: GradBatch, projector: Projector, cost: CostModel | None) -> GradBatch:
    """Project the (preconditioned or whitened) query's still unprojected layers."""
    layers = {n: project(lg, projector, cost) if lg.space.canonical
              or lg.space.awaiting_projection else lg for n, lg in pq.layers.items()}
    return GradBatch(pq.step, pq.sample_ids, layers, pq.micro_batch, pq.token_counts)


def _materialize_once(train: GradBatch, pq: GradBatch, names: tuple[str, ...],
                      cost: CostModel | None) -> GradBatch:
    """Materialize factorized query layers once when the cost model routes the first train
    batch's product dense (``CostModel.decide``), instead of once per batch: every batch then
    takes the ``cross_dense`` route (same values up to float rounding)."""
    layers = dict(pq.layers)
    for n in names:
        x, y = train.layers[n], layers[n]
        if not (isinstance(x.data, Factorized) and isinstance(y.data, Factorized)) or \
                x.shard is not None or y.shard is not None:
            continue
        fy = y.data
        dec = (cost or default_cost_model(x.device)).decide(
            "cross_gram", n, x.kind, x.data, x.shape, B2=fy.g.shape[0], S=fy.g.shape[1])
        if dec.path == "dense":
            layers[n] = y.replace(data=Dense(materialize(y)))
    return GradBatch(pq.step, pq.sample_ids, layers, pq.micro_batch, pq.token_counts)


def get_attributor(name: str) -> type[Attributor]:
    """The registered Attributor class called ``name`` (ConfigError listing them otherwise)."""
    return METHODS.lookup(name)


def registered_attributors() -> dict[str, type[Attributor]]:
    """Name -> class of every registered attribution method."""
    return METHODS.as_dict()


def make_attributor(name: str, **kwargs) -> Attributor:
    """Instantiate a registered method, e.g. ``make_attributor("ekfac", factors=f)``."""
    return get_attributor(name)(**kwargs)
