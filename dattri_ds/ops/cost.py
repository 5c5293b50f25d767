"""Cost model: flops AND bytes of the factorized ("ghost") and materialized ("dense") path.

Every gradient operation on a factorized layer can run two ways. This module estimates
both from the shapes alone, converts them to seconds with a roofline of the device,
``t = flops / peak_flops + bytes / bandwidth``, and picks the cheaper. Decisions are
cached per (operation, layer, shapes), can be forced per operation, and explain
themselves (``CostModel.explain()``).

Letters: B1/B2 examples with T/S tokens, I input width (incl. bias column), O output
width, Q dense rows, P dense projection size, ko/ki Kronecker projection sizes, E bytes
per element. ``M(B, T) = 2*B*T*I*O`` flops is materializing ``B`` per-example ``[O, I]``
gradients (``B*T*O`` scatter-adds for index inputs, where ``A.A^T`` costs ``T*S`` compares).

| op           | ghost flops                         | dense flops                     |
|--------------|-------------------------------------|---------------------------------|
| cross_gram   | 2*B1*B2*T*S*(I + O + 1)             | M(B1,T) + M(B2,S) + 2*B1*B2*I*O |
| norm         | 2*B*T*T*(I + O + 1)                 | M(B,T) + 2*B*I*O                |
| cross_dense  | 2*B*T*Q*O*(I + 1)                   | M(B,T) + 2*B*Q*I*O              |
| project_kron | 2*B*T*(O*ko + I*ki + ko*ki)         | M(B,T) + 2*B*ko*I*(O + ki)      |
| project_dense| 2*B*T*P*O*I                         | M(B,T) + 2*B*P*I*O              |
| project_sparse| (none: sparse JL materializes)     | M(B,T) + 2*B*s*I*O              |
| sum          | 2*B*T*I*O                           | M(B,T) + B*I*O                  |
| rotate       | 2*B*T*(O^2 + I^2) + M(B,T)          | M(B,T) + 2*B*O*I*(O + I)        |

Bytes count the factors read, every intermediate written and read back, and the result.

The ``auto`` projection's kind per layer (``choose_projection``, re-exported here) is chosen
in ``ops.projection`` from the kinds' flops at ``REF_TOKENS`` tokens: by the layer's shape and
k only, never by a batch, so train rows and queries land in the same space.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.layers.base import LayerDims
from dattri_ds.ops.projection import (  # re-exported: the projection choice lives there
    REF_TOKENS, SPARSE_NNZ, ProjectionChoice, choose_projection, explain_projection,
)
from dattri_ds.registry import Registry

__all__ = ["PathCost", "Roofline", "Decision", "CostModel", "OPS", "PATHS", "estimate",
           "ProjectionChoice", "choose_projection", "explain_projection", "REF_TOKENS",
           "default_cost_model"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

PATHS = ("ghost", "dense")


@dataclass(frozen=True)
class PathCost:
    """Estimated work of one path: floating-point operations and bytes moved."""

    flops: float
    bytes: float

    def seconds(self, roofline: Roofline) -> float:
        return self.flops / roofline.flops_per_s + self.bytes / roofline.bytes_per_s


@dataclass(frozen=True)
class Roofline:
    """Throughput of a device: sustained matmul flops/s and memory bytes/s, and the fixed
    host cost of one eager kernel.

    Attributes:
        flops_per_s: sustained fp32 matmul throughput.
        bytes_per_s: sustained memory bandwidth (elementwise copy).
        launch_s: seconds the host spends issuing one eager op (a GPU kernel launch; on a
            CPU the dispatcher's overhead). It prices stacking layers of one shape into one
            kernel (``layers.stacking.stack_pays``).
    """

    flops_per_s: float
    bytes_per_s: float
    launch_s: float = 5e-6

    @staticmethod
    def default(device: torch.device | str = "cpu") -> Roofline:
        """Defaults by device type (no measurement): one modern CPU core / one data-centre
        GPU (its launch cost the H200's calibrated ``kernel_latency_s``,
        dattri_ds/plan/estimate.py)."""
        if torch.device(device).type == "cuda":
            return Roofline(flops_per_s=4e13, bytes_per_s=2e12, launch_s=2e-5)
        return Roofline(flops_per_s=1e11, bytes_per_s=2e10, launch_s=5e-6)

    @staticmethod
    def measure(device: torch.device | str = "cpu", size: int = 512) -> Roofline:
        """Measure a ``size``-square matmul and a 64 MB copy on ``device`` (about 0.1 s)."""
        dev = torch.device(device)
        a = torch.randn(size, size, device=dev)
        big = torch.randn(1 << 24, device=dev)
        dst = torch.empty_like(big)  # copy into a live buffer: bandwidth, not page faults
        flops = _best_rate(lambda: a @ a, 2 * size**3, dev)
        bw = _best_rate(lambda: dst.copy_(big), 2 * big.numel() * 4, dev)
        return Roofline(flops_per_s=flops, bytes_per_s=bw)


def _best_rate(fn: Callable[[], object], work: float, dev: torch.device, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return work / max(best, 1e-9)


def _mat(d: LayerDims, b: int, t: int) -> PathCost:
    """Materialize ``b`` examples of ``t`` tokens: flops M(b, t), bytes factors + result."""
    e = d.itemsize
    if d.index_input:
        return PathCost(b * t * d.O, e * (b * t * (d.O + 1) + b * d.I * d.O))
    return PathCost(2 * b * t * d.I * d.O, e * (b * t * (d.I + d.O) + b * d.I * d.O))


def _gram_width(d: LayerDims) -> int:
    """Flops per (t, s) pair of the two ghost products: ``I + O + 1`` (``O + 1`` for indices)."""
    return (0 if d.index_input else d.I) + d.O + 1


def _cross_gram(d: LayerDims, B2: int, S: int) -> dict[str, PathCost]:
    e = d.itemsize
    pairs = d.B * B2 * d.T * S
    ghost = PathCost(2 * pairs * _gram_width(d),
                     e * (d.B * d.T * (d.I + d.O) + B2 * S * (d.I + d.O) + 3 * pairs))
    mx, my = _mat(d, d.B, d.T), _mat(d, B2, S)
    dense = PathCost(mx.flops + my.flops + 2 * d.B * B2 * d.I * d.O,
                     mx.bytes + my.bytes + e * ((d.B + B2) * d.I * d.O + d.B * B2))
    return {"ghost": ghost, "dense": dense}


def _norm(d: LayerDims) -> dict[str, PathCost]:
    e = d.itemsize
    pairs = d.B * d.T * d.T
    ghost = PathCost(2 * pairs * _gram_width(d), e * (d.B * d.T * (d.I + d.O) + 3 * pairs))
    m = _mat(d, d.B, d.T)
    dense = PathCost(m.flops + 2 * d.B * d.I * d.O, m.bytes + e * d.B * d.I * d.O)
    return {"ghost": ghost, "dense": dense}


def _cross_dense(d: LayerDims, Q: int) -> dict[str, PathCost]:
    e = d.itemsize
    width = 1 if d.index_input else d.I + 1
    ghost = PathCost(2 * d.B * d.T * Q * d.O * width,
                     e * (d.B * d.T * (d.I + d.O) + Q * d.I * d.O + 2 * d.B * d.T * Q * d.O))
    m = _mat(d, d.B, d.T)
    dense = PathCost(m.flops + 2 * d.B * Q * d.I * d.O,
                     m.bytes + e * (d.B * d.I * d.O + Q * d.I * d.O + d.B * Q))
    return {"ghost": ghost, "dense": dense}


def _project_kron(d: LayerDims, ko: int, ki: int) -> dict[str, PathCost]:
    e = d.itemsize
    in_flops = 0 if d.index_input else d.I * ki
    ghost = PathCost(2 * d.B * d.T * (d.O * ko + in_flops + ko * ki),
                     e * (d.B * d.T * (d.I + d.O) + ko * d.O + ki * d.I
                          + 2 * d.B * d.T * (ko + ki) + d.B * ko * ki))
    m = _mat(d, d.B, d.T)
    dense = PathCost(m.flops + 2 * d.B * ko * d.I * (d.O + ki),
                     m.bytes + e * (d.B * d.I * d.O + 2 * d.B * ko * d.I + d.B * ko * ki))
    return {"ghost": ghost, "dense": dense}


def _project_dense(d: LayerDims, P: int) -> dict[str, PathCost]:
    e = d.itemsize
    ghost = PathCost(2 * d.B * d.T * P * d.O * (1 if d.index_input else d.I),
                     e * (P * d.I * d.O + d.B * d.T * (d.I + d.O) + 2 * d.B * d.T * P * d.O))
    m = _mat(d, d.B, d.T)
    dense = PathCost(m.flops + 2 * d.B * P * d.I * d.O,
                     m.bytes + e * (d.B * d.I * d.O + P * d.I * d.O + d.B * P))
    return {"ghost": ghost, "dense": dense}


def _project_sparse(d: LayerDims, P: int) -> dict[str, PathCost]:
    """Sparse JL has only the dense path: materialize, then ``s`` scatter-adds per entry
    (reading an int64 row index and an fp32 value per non-zero)."""
    e, s = d.itemsize, min(SPARSE_NNZ, P)
    m = _mat(d, d.B, d.T)
    return {"dense": PathCost(m.flops + 2 * d.B * s * d.I * d.O,
                              m.bytes + e * d.B * d.I * d.O + 12 * s * d.I * d.O
                              + 4 * d.B * P)}


def _sum(d: LayerDims) -> dict[str, PathCost]:
    e = d.itemsize
    ghost = PathCost(_mat(d, 1, d.B * d.T).flops, e * (d.B * d.T * (d.I + d.O) + d.I * d.O))
    m = _mat(d, d.B, d.T)
    dense = PathCost(m.flops + d.B * d.I * d.O, m.bytes + e * (d.B * d.I * d.O + d.I * d.O))
    return {"ghost": ghost, "dense": dense}


def _rotate(d: LayerDims) -> dict[str, PathCost]:
    """EK-FAC rotation ``Q_S^T G_b Q_A`` of factorized gradients: rotate the factors first
    (``g Q_S``, ``a Q_A``: per token, so ``T (O^2 + I^2)``), then materialize in the
    eigenbasis; or materialize, then two matrix products per example (``O I (O + I)``). The
    factors win when ``T < O I (O + I) / (O^2 + I^2)`` (``T < d`` for square layers)."""
    e = d.itemsize
    m = _mat(d, d.B, d.T)
    rows = d.B * d.T * (d.I + d.O)
    ghost = PathCost(2 * d.B * d.T * (d.O ** 2 + d.I ** 2) + m.flops,
                     e * (2 * rows + d.O ** 2 + d.I ** 2) + m.bytes)
    dense = PathCost(m.flops + 2 * d.B * d.O * d.I * (d.O + d.I),
                     m.bytes + e * (4 * d.B * d.I * d.O + d.O ** 2 + d.I ** 2))
    return {"ghost": ghost, "dense": dense}


#: op name -> estimator(dims, **op args) -> {path: PathCost}; a flat routing table.
OPS: Registry[Callable[..., dict[str, PathCost]]] = Registry(
    "gradient op", hint="register its estimator with OPS.register(name, fn)")
for _name, _fn in (("cross_gram", _cross_gram), ("norm", _norm), ("cross_dense", _cross_dense),
                   ("project_kron", _project_kron), ("project_dense", _project_dense),
                   ("project_sparse", _project_sparse), ("sum", _sum), ("rotate", _rotate)):
    OPS.register(_name, _fn)
del _name, _fn


def estimate(op: str, dims: LayerDims, **kwargs: int) -> dict[str, PathCost]:
    """Cost of both paths of ``op`` for a layer of ``dims`` (see the module table)."""
    return OPS.lookup(op)(dims, **kwargs)


@dataclass(frozen=True)
class Decision:
    """One routing decision, readable by a person.

    Attributes:
        op: operation name. layer: module name. path: chosen path.
        costs: estimated cost of each path. seconds: roofline time of each path.
        forced: the path was forced by configuration, not chosen by cost.
        args: the shapes the decision was made for.
    """

    op: str
    layer: str
    path: str
    costs: Mapping[str, PathCost]
    seconds: Mapping[str, float]
    forced: bool
    args: Mapping[str, int] = field(default_factory=dict)

    def explain(self) -> str:
        parts = ", ".join(
            f"{p}: {c.flops / 1e6:.3g} MFLOP + {c.bytes / 1e6:.3g} MB = "
            f"{self.seconds[p] * 1e3:.3g} ms" for p, c in self.costs.items()
        )
        why = "forced" if self.forced else "cheaper"
        shape = " ".join(f"{k}={v}" for k, v in self.args.items())
        return f"{self.layer} {self.op} [{shape}] -> {self.path} ({why}; {parts})"


class CostModel:
    """Chooses ghost vs dense per (op, layer, shapes) and remembers why.

    Args:
        roofline: device throughput; ``Roofline.default("cpu")`` when omitted.
        force: op name (or ``"*"``) -> path, e.g. ``{"cross_gram": "dense"}``.
        calibrate: settle close calls by timing both paths once (see ``run``).
        calibrate_band: estimates within this factor of each other count as close.
    """

    def __init__(self, roofline: Roofline | None = None,
                 force: Mapping[str, str] | None = None, calibrate: bool = False,
                 calibrate_band: float = 2.0) -> None:
        self.roofline = roofline or Roofline.default("cpu")
        self.force = dict(force or {})
        self.calibrate = calibrate
        self.calibrate_band = calibrate_band
        for op, path in self.force.items():
            if op != "*" and op not in OPS:
                raise ConfigError(f"cannot force unknown op '{op}'; known ops: {sorted(OPS)}")
            if path not in PATHS:
                raise ConfigError(f"cannot force op '{op}' to path '{path}'; paths: {PATHS}")
        self._cache: dict[tuple, Decision] = {}

    def choose(self, op: str, layer: str, dims: LayerDims, *, path: str | None = None,
               **kwargs: int) -> Decision:
        """The decision for ``op`` on ``layer``; ``path`` forces it for this call only."""
        key = (op, layer, dims, path, tuple(sorted(kwargs.items())))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        costs = estimate(op, dims, **kwargs)
        secs = {p: c.seconds(self.roofline) for p, c in costs.items()}
        forced = path or self.force.get(op) or self.force.get("*")
        if forced is not None and forced not in PATHS:
            raise ConfigError(f"path must be one of {PATHS}, got '{forced}'")
        if forced is not None and forced not in costs:  # an op with one path (sparse)
            forced = None
        chosen = forced or min(secs, key=secs.__getitem__)
        args = dict(B=dims.B, T=dims.T, I=dims.I, O=dims.O, **kwargs)
        dec = Decision(op, layer, chosen, costs, secs, forced is not None, args)
        self._cache[key] = dec
        logger.debug(dec.explain())
        return dec

    def route(self, op: str, layer: str, kind, data, shape: tuple[int, int],
              paths: Mapping[str, Callable[[], T]], *, path: str | None = None,
              itemsize: int | None = None, **kwargs: int) -> T:
        """THE router: choose ghost vs dense for ``op`` on one layer's factors and run it.

        The one place a path is chosen and the one place ``LayerDims`` is built: ``B, T``
        from ``data.g [B, T, O]``, ``(O, I')`` from ``shape``, the index case from
        ``kind.index_input``, bytes per element from ``itemsize`` (default: the factors').

        Args:
            kind: the layer's LayerKind. data: its ``Factorized`` gradients.
            paths: ``{"ghost": fn, "dense": fn}`` (an op with one path may give one).
            path: force a path for this call. kwargs: the op's extra sizes (``B2``, ``Q``...).
        """
        dims = _dims(kind, data, shape, itemsize)
        return self.run(op, layer, dims, paths, path=path, **kwargs)

    def decide(self, op: str, layer: str, kind, data, shape: tuple[int, int], *,
               path: str | None = None, itemsize: int | None = None, **kwargs: int) -> Decision:
        """The decision ``route`` would take, without running a path (for a caller that
        prepares data ahead of the op, e.g. a query materialized once for many batches)."""
        return self.choose(op, layer, _dims(kind, data, shape, itemsize), path=path, **kwargs)

    def run(self, op: str, layer: str, dims: LayerDims, paths: Mapping[str, Callable[[], T]], *,
            path: str | None = None, **kwargs: int) -> T:
        """Choose a path for ``op`` and run it: ``paths = {"ghost": fn, "dense": fn}``.

        With ``calibrate=True``, a decision whose two estimates lie within
        ``calibrate_band`` of each other (where roofline estimates are unreliable: shapes
        with small inner dimensions run matmuls far below peak) is settled by timing both
        paths once on the real tensors; the faster is cached for this (op, layer, shape).
        """
        dec = self.choose(op, layer, dims, path=path, **kwargs)
        secs = sorted(dec.seconds.values())
        close = secs[-1] <= self.calibrate_band * max(secs[0], 1e-30)
        if not (self.calibrate and close and not dec.forced and "timed" not in dec.args):
            return paths[dec.path]()
        timed, result = {}, None
        for name, fn in paths.items():
            result, timed[name] = _timed(fn)
        best = min(timed, key=timed.__getitem__)
        key = (op, layer, dims, path, tuple(sorted(kwargs.items())))
        self._cache[key] = Decision(op, layer, best, dec.costs, dec.seconds, False,
                                    {**dec.args, "timed": 1})
        return result

    def decisions(self) -> list[Decision]:
        """Every distinct decision made so far, in the order they were made."""
        return list(self._cache.values())

    def explain(self) -> str:
        """One line per decision: layer, op, shapes, chosen path and both estimates."""
        return "\n".join(d.explain() for d in self._cache.values())


def _dims(kind, data, shape: tuple[int, int], itemsize: int | None) -> LayerDims:
    """``LayerDims`` of factors ``data.g [B, T, O]`` of a layer of canonical ``shape``."""
    g = data.g
    return LayerDims(B=g.shape[0], T=g.shape[1], I=shape[1], O=shape[0],
                     index_input=kind.index_input,
                     itemsize=g.element_size() if itemsize is None else itemsize)


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its wall time; CUDA work is synchronized before and after (kernels run
    asynchronously: without it the time is the launch, not the work)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


_DEFAULT_MODELS: dict[str, CostModel] = {}


def default_cost_model(device: torch.device | str = "cpu") -> CostModel:
    """The shared per-device-type cost model used when an op is given none."""
    key = device.type if isinstance(device, torch.device) else torch.device(device).type
    model = _DEFAULT_MODELS.get(key)
    if model is None:
        model = _DEFAULT_MODELS[key] = CostModel(Roofline.default(key))
    return model
