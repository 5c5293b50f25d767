"""Contrastive target: what the target asks for beyond what the training pool gives anyway.

Cosine scoring against the mean target gradient ``g_t`` rewards a candidate for every
direction it shares with the target, including the generic ones (common tokens, formatting,
the language model's overall fit) that almost every candidate of the pool shares too. Those
are learned whatever is chosen: the uniformly drawn part of each micro-batch
(``uniform_mix``) and every other step supply them, and an Adam step does not grow with more
of the same direction. The contrastive target scores a candidate by what it adds beyond the
pool,

    d = g_t / |g_t| - w * g_pool / |g_pool|,    score_b = <g_b, d> (/ |g_b| when normalized)

i.e. ``cos(g_b, g_t) - w * cos(g_b, g_pool)`` with cosine scoring: how much more a candidate
is aligned with the target than with the average training example. ``g_pool`` is the mean
gradient of a fixed sample of the candidate stream (the first ``rows`` candidates this rank
sees, kept as model inputs), recomputed with the target (same probe, same refresh, the same
data-parallel reduction), so every rank scores against the same direction. Both norms are
whole-model norms over the scored layers (shard-aware under tensor parallelism).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import torch

from dattri_ds.gradient import Dense, GradBatch
from dattri_ds.ops import norms
from dattri_ds.selection.target import TargetProvider

__all__ = ["PoolSample", "PooledTarget", "ContrastTarget"]

Batch = dict[str, torch.Tensor]


class PoolSample:
    """The first ``rows`` candidate rows seen (model inputs, on CPU): a sample of the pool."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._parts: list[Batch] = []
        self._n = 0

    @property
    def full(self) -> bool:
        return self._n >= self.rows

    def observe(self, batch: Batch) -> None:
        """Keep rows of ``batch`` until ``rows`` are held (copies; later batches ignored)."""
        if self.full:
            return
        take = min(self.rows - self._n, next(iter(batch.values())).shape[0])
        self._parts.append({k: v[:take].detach().cpu().clone() for k, v in batch.items()})
        self._n += take

    def data(self) -> Batch:
        return {k: torch.cat([p[k] for p in self._parts]) for k in self._parts[0]}

    def state_dict(self) -> dict:
        """The rows kept so far (model inputs, per observed batch)."""
        return {"parts": [{k: v.clone() for k, v in p.items()} for p in self._parts],
                "n": self._n}

    def load_state_dict(self, state: dict) -> None:
        self._parts = [{k: v.clone() for k, v in p.items()} for p in state["parts"]]
        self._n = int(state["n"])


class PooledTarget(TargetProvider):
    """A target made from the target gradient and the pool sample's mean gradient.

    The pool's provider is built once, when the sample is full (``make_reference``: a
    ``ValidationTarget`` on the sample's rows, preconditioned like the target); the combined
    rows are recomputed only when either gradient was refreshed. Subclasses say how the two
    combine (``combine``; ``reference`` is None until the sample is full).

    Args:
        target: the target provider (plain or preconditioned).
        pool: the pool sample, fed by the selector with every candidate batch before scoring.
        make_reference: builds the pool's provider from the sample's rows.
    """

    def __init__(self, target: TargetProvider, pool: PoolSample,
                 make_reference: Callable[[Batch], TargetProvider]) -> None:
        self.target, self.pool, self.make_reference = target, pool, make_reference
        self.reference: TargetProvider | None = None
        self._key: tuple | None = None
        self._value: GradBatch | None = None

    @property
    def refreshes(self) -> int:
        return getattr(self.target, "refreshes", 0)

    @property
    def inner(self):
        return getattr(self.target, "inner", self.target)

    def get(self, step: int) -> GradBatch:
        t = self.target.get(step)
        if self.reference is None and self.pool.full:
            self.reference = self.make_reference(self.pool.data())
        r = self.reference.get(step) if self.reference is not None else None
        key = (id(t), None if r is None else id(r))
        if self._value is None or key != self._key:
            self._value = self.combine(t, r)
            self._key = key
        return self._value

    def state_dict(self) -> dict:
        """The target's and the pool reference's states (the combined rows are recombined
        from them on the first ``get``: a pure function, so bit-identical)."""
        return {"target": self.target.state_dict(),
                "reference": None if self.reference is None else self.reference.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore both parts; the pool sample (restored first) rebuilds the reference."""
        self.target.load_state_dict(state["target"])
        self.reference = None
        if state["reference"] is not None:
            self.reference = self.make_reference(self.pool.data())
            self.reference.load_state_dict(state["reference"])
        self._key, self._value = None, None

    @abstractmethod
    def combine(self, target: GradBatch, reference: GradBatch | None) -> GradBatch:
        """The rows candidates are scored against."""


class ContrastTarget(PooledTarget):
    """``g_t/|g_t| - weight * g_pool/|g_pool|`` (one dense row per layer); ``weight`` 0 is
    the plain (unit) target. Other arguments: ``PooledTarget``."""

    def __init__(self, target: TargetProvider, pool: PoolSample,
                 make_reference: Callable[[Batch], TargetProvider], weight: float) -> None:
        super().__init__(target, pool, make_reference)
        self.weight = weight

    def combine(self, target: GradBatch, reference: GradBatch | None) -> GradBatch:
        return contrast(target, reference, self.weight)


@torch.no_grad()
def contrast(target: GradBatch, reference: GradBatch | None, weight: float) -> GradBatch:
    """``target/|target| - weight * reference/|reference|`` over ``target``'s layers (the unit
    target alone while there is no reference yet)."""
    names = list(target.layers)
    nt = float(norms(target, names)[0].clamp_min(1e-30))
    nr = float(norms(reference, names)[0].clamp_min(1e-30)) if reference is not None else 1.0
    out = {}
    for name in names:
        lg = target.layers[name]
        vals = lg.data.values.float() / nt
        if reference is not None and weight:
            vals = vals - weight * reference.layers[name].data.values.float() / nr
        out[name] = lg.replace(data=Dense(vals.to(lg.data.values.dtype)))
    return GradBatch(step=target.step, sample_ids=target.sample_ids, layers=out)
