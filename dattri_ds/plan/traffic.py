"""Inter-node bytes per step that capture and online selection add (``plan --nodes``).

Only the collectives dattri-ds issues (or makes the engine issue) are counted, not the
engine's own training traffic (ZeRO's gathers and reduce-scatters of the step itself).
Each collective runs over the ``R`` data-parallel ranks, spread evenly over ``N`` nodes, as
a ring ordered by node: ``N`` of its ``R`` hops cross a node boundary, and each of those
links carries, per call with a payload of ``S`` bytes,

    all_reduce:  2 (R - 1) / R * S        all_gather (S = the gathered total): (R - 1) / R * S

(0 when ``N = 1``: nothing leaves the node). Per optimizer step, with ``e`` bytes per
weight, ``P`` parameters, ``gas`` micro-batches a step, ``k`` the projected width per layer
(``w_l = min(k, I_l O_l)`` floats for each captured layer instance):

* capture (data parallel, any ZeRO stage): no collective; projections are seeded per
  layer and each rank writes its own shard;
* selection, gradient probe under ZeRO-3: ``all_gather`` of the weights (``S = P e``) for
  the candidates' forward and backward, ``2 gas`` calls a step;
* selection, target refresh: ``all_reduce`` of the target rows and their count
  (``S = 4 (1 + sum_l w_l)``), ``1 / refresh_every`` calls a step;
* selection, target refresh under ZeRO-3: ``all_gather`` of the weights (``S = P e``) for
  each target pass forward and backward, ``2 ceil(ceil(n_t / R) / b_t) / refresh_every``
  calls a step.

``n_t`` target documents, ``b_t`` target batch size. A content score (no probe) issues none of
these per step: its statistics are all-reduced once, for the summary. Tensor parallelism is
assumed within a node (its all-reduces of ``[B, w_l]`` per sharded layer stay on the node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dattri_ds.io import schema
from dattri_ds.errors import ConfigError

__all__ = ["TrafficSpec", "Collective", "Traffic", "ring_link_bytes", "traffic"]


@dataclass(frozen=True, kw_only=True)
class TrafficSpec:
    """How the data-parallel ranks spread over nodes, and the selection's refresh settings
    (one ``dattri-ds plan`` flag per field, its docstring the flag's help)."""

    nodes: int = field(default=1, metadata=schema.bounds(ge=1))
    """nodes the data-parallel ranks span (world / nodes ranks on each); above 1 the plan reports
    the inter-node traffic of capture and selection per step."""
    gas: int = field(default=1, metadata=schema.bounds(ge=1))
    """micro-batches per optimizer step (gradient accumulation)."""
    refresh_every: int = field(default=10, metadata=schema.bounds(ge=1))
    """steps between two target refreshes (selection.refresh_every)."""
    target_docs: int = field(default=64, metadata=schema.bounds(ge=1))
    """target documents (selection.target_max_docs)."""
    target_batch_size: int = field(default=8, metadata=schema.bounds(ge=1))
    """examples per target pass (selection.target_batch_size)."""

    def __post_init__(self) -> None:
        schema.check(self, "plan.traffic")


@dataclass(frozen=True)
class Collective:
    """One collective of a path: payload, calls per step and bytes per step on each
    inter-node link."""

    path: str
    what: str
    op: str
    payload: float
    per_step: float
    link_bytes: float


@dataclass(frozen=True)
class Traffic:
    """The collectives of capture and selection and their inter-node bytes per step."""

    nodes: int
    ranks: int
    collectives: tuple[Collective, ...]

    def per_path(self) -> dict[str, float]:
        """``capture`` / ``selection`` -> bytes per step per inter-node link."""
        out = {"capture": 0.0, "selection": 0.0}
        for c in self.collectives:
            out[c.path] += c.link_bytes
        return out

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "ranks": self.ranks,
                "bytes_per_step_per_link": self.per_path(),
                "collectives": [c.__dict__ for c in self.collectives]}

    def table(self) -> str:
        lines = [f"inter-node traffic per step ({self.ranks} ranks on {self.nodes} nodes, "
                 f"bytes per inter-node link, ring by node):"]
        for path, total in self.per_path().items():
            lines.append(f"  {path:<10} {_size(total)}")
        for c in self.collectives:
            lines.append(f"    {c.path}: {c.what} ({c.op} of {_size(c.payload)}, "
                         f"{c.per_step:g} a step) -> {_size(c.link_bytes)}")
        return "\n".join(lines)


def _size(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def ring_link_bytes(op: str, payload: float, ranks: int, nodes: int) -> float:
    """Bytes one inter-node link carries for one ``op`` of ``payload`` bytes over ``ranks``
    ranks on ``nodes`` nodes (a ring ordered by node; module docstring)."""
    if nodes <= 1 or ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks
    if op == "all_reduce":
        return 2 * share * payload
    if op == "all_gather":
        return share * payload
    raise ConfigError(f"ring_link_bytes: op must be all_reduce or all_gather, got {op!r}")


def traffic(model, spec, t: TrafficSpec, k: int) -> Traffic:
    """The inter-node traffic of ``spec`` (a ``plan.RunSpec``) on ``model`` (a
    ``plan.ModelShape``) with ranks spread as ``t`` says; ``k`` the projected width per layer.

    Raises:
        ConfigError: the ranks do not spread evenly over the nodes.
    """
    ranks, nodes = spec.world, t.nodes
    if ranks % nodes:
        raise ConfigError(f"--nodes {nodes} does not divide --world {ranks}: give every node "
                          f"the same number of ranks (world = nodes x processes per node)")
    out: list[Collective] = []

    def add(path: str, what: str, op: str, payload: float, per_step: float) -> None:
        out.append(Collective(path, what, op, payload, per_step,
                              per_step * ring_link_bytes(op, payload, ranks, nodes)))

    selecting = spec.method == "selection"
    if selecting and spec.probes:
        weights = model.num_params * spec.weight_bytes
        layers = model.captured_layers()
        width = sum(s.count * min(k, s.I * s.O) for s in layers)
        if spec.zero_stage == 3:
            add("selection", "probe: weights gathered for the candidates' forward and "
                "backward", "all_gather", weights, 2 * t.gas)
        add("selection", "target refresh: target rows and count", "all_reduce",
            4 * (1 + width), 1 / t.refresh_every)
        if spec.zero_stage == 3:
            passes = math.ceil(math.ceil(t.target_docs / ranks) / t.target_batch_size)
            add("selection", "target refresh: weights gathered for each target pass",
                "all_gather", weights, 2 * passes / t.refresh_every)
    return Traffic(nodes=nodes, ranks=ranks, collectives=tuple(out))
