"""K-FAC / EK-FAC per layer: streaming factor sums, eigenbases, query preconditioning.

Notation: example b has the per-example gradient ``G_b = sum_t g_bt a_bt^T`` (``[O, I']``,
bias folded into ``a``), flattened row-major, so ``vec(G_b) = sum_t g_bt (x) a_bt``. The
curvature is the empirical Fisher of per-example (summed-over-tokens) losses,
``F = (1/N) sum_b vec(G_b) vec(G_b)^T``, approximated per layer as ``F ~ S (x) A`` with::

    A = (1/M) sum_{b,t in V} a_bt a_bt^T        [I', I']   (M = |V| counted tokens)
    S = (1/N) sum_{b,t}      g_bt g_bt^T        [O, O]     (N = examples)

``V`` is the set of tokens whose output-grad row is not all zero (tokens that contribute to
some ``G_b``), so padding and prompt-masked positions change nothing. Dropping cross-token
terms and assuming ``a`` independent of ``g``,
``F ~ (1/N) sum_{b,t} (g g^T) (x) (a a^T) ~ [(1/N) sum_{b,t} g g^T] (x) E_tok[a a^T] = S (x) A``:
A is a per-token mean, S a per-example sum of token terms (the standard K-FAC for
per-example-sum losses; the Kronecker order matches the row-major ``[O, I']`` layout).
Since ``(S (x) A) vec(X) = vec(S X A)``, with ``S = Q_S diag(l_S) Q_S^T`` and
``A = Q_A diag(l_A) Q_A^T`` (``torch.linalg.eigh`` in float64; rotations by ``Q`` in
``KFACConfig.dtype``)::

    K-FAC:   H^-1 vec(G) = vec( Q_S [ (Q_S^T G Q_A) / (l_S l_A^T + lambda) ] Q_A^T )
    EK-FAC:  same with l_S l_A^T replaced by L_ij = (1/N) sum_b (Q_S^T G_b Q_A)_ij^2

``L`` (George et al., 2018) is the diagonal of F in the Kronecker eigenbasis, accumulated in
a second pass from factors without building ``G_b``:
``Q_S^T G_b Q_A = sum_t (Q_S^T g_bt)(Q_A^T a_bt)^T``. Damping ``lambda`` is absolute, or
relative: ``damping * mean(eigenvalues)`` of the layer (``mean(l_S) mean(l_A)`` or
``mean(L)``). Larger damping makes ``H^-1 -> I / lambda``, i.e. plain gradient dot products.

Forms, by layer kind (``LayerKind.factor_form`` picks): ``kron`` (linear/conv1d),
``kron_index`` (embeddings), ``full`` and ``diagonal`` (norm rows); one ``FactorForm`` class
each, held by ``LayerFactors.form`` (``ops/factor_forms.py`` says what each keeps).

Projection (LoGra): with a Kronecker ``Projector``, ``a`` and ``g`` are projected per side
before accumulation (``a' = P_in a``, ``g' = P_out g``), so the factors are exactly
``P_in A P_in^T`` and ``P_out S P_out^T`` and the projected gradients of a store
(``P_out G_b P_in^T``) can be corrected and preconditioned. Layers with ``O*I' <= dim`` are
kept exactly (``identity:<tag>``), as ``ops.project`` does. Fitting needs factorized data
(a dense gradient has lost ``a`` and ``g``); dense-projected factorized kinds are refused.
Tensor-parallel shards are independent layers: block-diagonal K-FAC over shards.

Phases: ``update`` (factor sums) -> ``reduce`` -> ``eigendecompose`` -> ``update_correction``
(EK-FAC sums) -> ``reduce``. Sums and counts are all-reduced, so R ranks give the single-process
factors up to float rounding. ``save``/``load`` use ``torch.save`` of plain tensors and JSON.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from dattri_ds.distributed import ParallelContext, all_gather_object, all_reduce_sum
from dattri_ds.errors import ConfigError, FactorFileError, FactorStateError, ShapeError, UnsupportedLayerError
from dattri_ds.gradient import CANONICAL, Dense, Factorized, GradBatch, LayerGrad, Space
from dattri_ds.layers.base import COMPUTE_DTYPE, KINDS, LayerKind
from dattri_ds.layers.outer import GHOST_CHUNK_ELEMENTS, OuterProductKind, row_chunks
from dattri_ds.ops.cost import CostModel, default_cost_model
from dattri_ds.layers.factor_forms import FORMS, FactorForm
from dattri_ds.ops.projection import Projector
from dattri_ds.ops.space import project
from dattri_ds.io.schema import bounds, check

__all__ = ["KFACConfig", "LayerFactors", "KFACFactors", "METHODS", "logra_sides"]

#: Eigenvalue methods -> whether they read the EK-FAC corrected eigenvalues.
CORRECTED = {"kfac": False, "ekfac": True}
METHODS = tuple(CORRECTED)
_FORMAT = "dattri_ds.kfac/1"


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """How curvature factors are accumulated and inverted."""

    damping: float = field(default=0.003, metadata=bounds(gt=0))
    """Added to every eigenvalue before inverting: absolute value, or a fraction of the
    layer's mean eigenvalue (``damping_mode``). Must be > 0. The default, ``lambda = 0.003 *
    mean(eigenvalues)`` per layer, is a function of the fitted spectrum only; chosen on
    ``benchmarks/lds.py`` (docs/attribution_fidelity.md, "KFACConfig defaults")."""

    damping_mode: Literal["relative", "absolute"] = "relative"
    """``relative``: ``lambda = damping * mean(eigenvalues)`` per layer; ``absolute``:
    ``lambda = damping``."""

    power: float = field(default=0.8, metadata=bounds(gt=0, le=1))
    """Exponent ``p`` of the curvature inverse: the query is preconditioned by
    ``(F + lambda)^-p`` (whitened rows by ``(F + lambda)^-p/2``). 1 is the influence
    function; below 1 the low-curvature directions, in which a finite training run has not
    converged, are amplified less (0 would be grad-dot). The default 0.8 was chosen on four
    benchmarks and re-checked leave-one-regime-out on 15 (docs/attribution_fidelity.md, "The
    power"); for single-checkpoint influence on a well-converged, Adam-trained model, 1 may
    fit better."""

    dtype: Literal["float64", "float32"] = "float32"
    """Dtype of the factor and EK-FAC sums and of the eigenbasis rotations
    ``Q_S^T G Q_A`` (pass 2 and preconditioning); its scores equal float64's to float32
    rounding. Eigendecompositions always run in float64; counts are always float64."""

    full_max: int = field(default=1024, metadata=bounds(ge=0))
    """Dense-only layers (layernorm/rmsnorm rows) of at most this many values get their
    exact empirical Fisher block ``[W, W]`` (form ``full``: one float64 eigenbasis of
    ``8 W^2`` bytes, 8 MiB at 1024); wider ones the diagonal (form ``diagonal``); 0 = always
    diagonal (docs/attribution_fidelity.md, "Norm layers")."""

    def __post_init__(self) -> None:
        check(self, "kfac")  # types, choices and the damping range (dattri_ds/io/schema.py)


@dataclass
class LayerFactors:
    """One layer's factor sums and eigenbasis.

    Attributes:
        name, kind, shape: as in LayerGrad (the LayerKind object; the canonical ``(O, I')``).
        space: the ``Space`` of the vectors these factors act on (canonical, projected or
            kept exactly); ``projection`` reads its tag back, as factor files record it.
        form: the ``FactorForm`` (``kron``, ``kron_index``, ``full`` or ``diagonal``, module
            docstring) doing this layer's sums, eigenbasis and rotations. Factor files
            record the names of kind and form (``meta`` / ``from_meta``).
        dims: ``(o, i)`` of the working space: ``shape``, ``(ko, ki)`` when Kronecker
            projected, ``(1, W)`` for ``full`` and ``diagonal``.
        sums: ``a`` (``[i, i]`` or ``[i]``), ``s`` ``[o, o]``, ``f`` ``[W, W]``, ``d`` ``[W]``,
            ``lam`` ``[o, i]`` and the float64 counts ``tokens``, ``examples``,
            ``lam_examples``.
        eig: ``q_a``, ``l_a``, ``q_s``, ``l_s`` once eigendecomposed (float64).
    """

    name: str
    kind: LayerKind
    shape: tuple[int, int]
    space: Space
    form: FactorForm
    dims: tuple[int, int]
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    eig: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shape, self.dims = tuple(self.shape), tuple(self.dims)

    @property
    def projection(self) -> str | None:
        """The tag of ``space`` (``Space.tag``), as factor files record it."""
        return self.space.tag

    def meta(self) -> dict:
        return {"name": self.name, "kind": self.kind.name, "shape": list(self.shape),
                "projection": self.projection, "form": self.form.name, "dims": list(self.dims)}

    @classmethod
    def from_meta(cls, m: dict) -> LayerFactors:
        """The layer a factor file's ``meta`` describes (kind and form looked up by name)."""
        return cls(m["name"], KINDS.lookup(m["kind"]), m["shape"], Space.parse(m["projection"]),
                   FORMS.lookup(m["form"]), m["dims"])

    def zero_sums(self, keys: Iterable[str], dtype: torch.dtype, device) -> None:
        """Create the missing sums ``keys`` as zeros (``FactorForm.zero_sums``)."""
        self.form.zero_sums(self.sums, tuple(keys), self.dims, dtype, device)


class KFACFactors:
    """Per-layer K-FAC/EK-FAC state: streaming sums, reduction, eigenbases, preconditioning.

    Args:
        config: damping and accumulation dtype.
        projector: Kronecker projector of the store the factors will precondition (LoGra
            factors ``P_in A P_in^T``, ``P_out S P_out^T``); None for unprojected gradients.
    """

    def __init__(self, config: KFACConfig | None = None, projector: Projector | None = None):
        self.config = config or KFACConfig()
        self.projector = projector
        self.layers: dict[str, LayerFactors] = {}
        self._reduced: set[str] = set()
        #: (layer, method, whiten) -> (the factors' tensors, their versions, ``_inverse``)
        self._inverses: dict[tuple, tuple[tuple, tuple, torch.Tensor]] = {}
        self._dtype = getattr(torch, self.config.dtype)
        self._itemsize = torch.empty((), dtype=self._dtype).element_size()

    @property
    def eigendecomposed(self) -> bool:
        return bool(self.layers) and all(lf.eig for lf in self.layers.values())

    @property
    def has_correction(self) -> bool:
        """Whether EK-FAC eigenvalues were accumulated for every Kronecker layer."""
        return self.eigendecomposed and all(
            float(lf.sums["lam_examples"]) > 0 for lf in self.layers.values()
            if lf.form.lam_keys)

    # ---- pass 1: factor sums --------------------------------------------------------
    def _layout(self, lg: LayerGrad) -> tuple[LayerFactors, tuple[Space, torch.Tensor] | None]:
        """The layer's factors (form, working space, dims), and the ``(space, rows)`` a
        dense-only kind was read as (None for factors)."""
        if lg.shard is not None:
            raise UnsupportedLayerError(
                f"Layer '{lg.name}' is a tensor-parallel shard: K-FAC factors need the whole "
                f"layer; pass dattri_ds.ops.space.unshard_batch(batch) (all-gathers the "
                f"sharded factor)")
        kind = lg.kind
        o, i = lg.shape
        p = self.projector
        if kind.dense_only:
            space, rows = self._dense_rows(lg)
            width = rows.shape[1]
            return LayerFactors(lg.name, kind, lg.shape, space, kind.factor_form(
                width, self.config.full_max), (1, width)), (space, rows)
        if not isinstance(lg.data, Factorized):
            state = "unprojected dense" if lg.space.canonical else f"projected ({lg.projection})"
            raise ShapeError(
                f"Layer '{lg.name}' ({lg.kind}) holds {state} gradients: K-FAC factors need the "
                f"factorized form (a, g). Fit factors from a capture without "
                f"capture.projection and pass KFACFactors(projector=Projector(<store config>)) "
                f"to precondition projected stores")
        form = kind.factor_form(o * i, self.config.full_max)
        if p is None or o * i <= p.config.dim:
            space = CANONICAL if p is None else p.exact_space
            return LayerFactors(lg.name, kind, lg.shape, space, form, (o, i)), None
        if not p.kind.factorized:
            raise ConfigError(
                f"Layer '{lg.name}': K-FAC on a '{p.config.kind}' projection has no Kronecker "
                f"structure; use ProjectionConfig(kind='kronecker') (LoGra) or unprojected data")
        return LayerFactors(lg.name, kind, lg.shape, p.space,
                            kind.factor_form(o * i, self.config.full_max, side_projected=True),
                            p.side_dims(o, i)), None

    def _dense_rows(self, lg: LayerGrad) -> tuple[Space, torch.Tensor]:
        """``(space, rows [B, W])`` of a layer fitted on dense rows."""
        if not lg.space.canonical or self.projector is None:
            return lg.space, lg.kind.rows(lg.data, lg.shape)
        done = project(lg, self.projector)
        return done.space, done.data.values

    def _factors(self, lf: LayerFactors, lg: LayerGrad) -> Factorized:
        """Factors in ``lf``'s working space (side-projected when Kronecker projected, unless
        they came so: ``logra_sides``)."""
        f = lg.data
        if lg.space.projected:
            self._check(lf, lg)
            return f
        if not lf.space.projected or lf.space.identity:
            return f
        p_out, p_in = self.projector.kron_sides(lf.name, *lf.shape, f.g.device, self._dtype)
        return lf.kind.side_project(f, p_out, p_in)

    def update(self, batch: GradBatch) -> None:
        """Fold a batch's factors into the sums (pass 1); new layers are added as they come."""
        if self.eigendecomposed or "cov" in self._reduced:
            raise FactorStateError("KFACFactors.update() after reduce()/eigendecompose(): factor "
                                "sums are final; start a new KFACFactors for new data")
        for name, lg in batch.layers.items():
            lf, rows = self.layers.get(name), None
            if lf is None:
                lf, rows = self._layout(lg)
                self.layers[name] = lf
            self._check(lf, lg, allow_projection_change=True)
            if lf.form.factorized:
                if not isinstance(lg.data, Factorized):
                    self._layout(lg)  # raises the explanatory error
                x = self._factors(lf, lg)  # tokens with a zero output-grad row add nothing
            else:
                space, x = rows or self._dense_rows(lg)
                self._check(lf, lg, space=space)
                self._width(lf, x)
            lf.form.update(lf.sums, x, lf.dims, self._dtype)

    # ---- distributed / merging --------------------------------------------------------
    def _phase(self) -> str:
        return "lam" if self.eigendecomposed else "cov"

    def _phase_keys(self, lf: LayerFactors, phase: str) -> tuple[str, ...]:
        return lf.form.cov_keys if phase == "cov" else lf.form.lam_keys

    def _device(self):
        for lf in self.layers.values():
            for t in lf.sums.values():
                return t.device
        return torch.device("cpu")

    def reduce(self, ctx: ParallelContext | None = None) -> KFACFactors:
        """Sum this phase's sums and counts over the data-parallel group (no-op at world 1).

        Before eigendecomposition it reduces the factor sums, after it the EK-FAC sums.
        Layers are matched by name (a rank that saw none of a layer contributes zeros), so
        every rank must call it, once per phase.
        """
        ctx = ctx or ParallelContext.from_default_group()
        phase = self._phase()
        if phase in self._reduced:
            raise FactorStateError(f"KFACFactors.reduce() called twice in the '{phase}' phase: the "
                                f"sums would be counted world-size times")
        self._reduced.add(phase)
        if ctx.dp_world == 1:
            return self
        if phase == "cov":
            metas = all_gather_object([lf.meta() for lf in self.layers.values()],
                                      ctx.dp_group, ctx.dp_world)
            for m in (m for rank in metas for m in rank):
                self._adopt(LayerFactors.from_meta(m))
        dev = self._device()
        for name in sorted(self.layers):
            lf = self.layers[name]
            keys = self._phase_keys(lf, phase)
            lf.zero_sums(keys, self._dtype, dev)
            for k in keys:
                all_reduce_sum(lf.sums[k], ctx.dp_group, ctx.dp_world)
        return self

    def _adopt(self, other: LayerFactors) -> LayerFactors:
        mine = self.layers.setdefault(other.name, LayerFactors.from_meta(other.meta()))
        if mine.meta() != other.meta():
            raise FactorFileError(
                f"Layer '{other.name}': factors disagree between the parts being merged: "
                f"{mine.meta()} vs {other.meta()}; fit every part with the same capture and "
                f"projection configuration")
        return mine

    def merge(self, other: KFACFactors) -> KFACFactors:
        """Add another part's sums of the current phase (data split in parts == one pass).

        Both must be in the same phase; in the EK-FAC phase both must share the eigenbasis
        (e.g. ``copy()`` of one eigendecomposed object, then different data).
        """
        phase = self._phase()
        if other._phase() != phase:
            raise FactorStateError("KFACFactors.merge(): one part is eigendecomposed, the other "
                                "is not; merge factor sums before eigendecompose()")
        for name, olf in other.layers.items():
            lf = self._adopt(olf)
            if phase == "lam" and any(not torch.equal(lf.eig[k], olf.eig[k]) for k in lf.eig):
                raise FactorStateError(f"Layer '{name}': EK-FAC sums of different eigenbases "
                                    f"cannot be merged; copy() one eigendecomposed object")
            for k in self._phase_keys(olf, phase):
                if k in olf.sums:
                    lf.zero_sums((k,), self._dtype, olf.sums[k].device)
                    lf.sums[k] += olf.sums[k].to(lf.sums[k].device)
        return self

    def copy(self) -> KFACFactors:
        """Deep copy (e.g. one per data part for the EK-FAC pass)."""
        return copy.deepcopy(self)

    # ---- eigendecomposition and the EK-FAC pass ---------------------------------------
    def eigendecompose(self) -> KFACFactors:
        """``eigh`` of A and S per layer in float64 (eigenvalues clamped at 0)."""
        if not self.layers:
            raise FactorStateError("KFACFactors.eigendecompose(): no batch was added (update())")
        for lf in self.layers.values():
            lf.eig.update(lf.form.decompose(lf.sums, lf.dims, self._dtype))
        return self

    def update_correction(self, batch: GradBatch) -> None:
        """EK-FAC pass: ``lam += sum_b (Q_S^T G_b Q_A)^2`` (factorized or matching dense rows)."""
        if not self.eigendecomposed:
            raise FactorStateError("KFACFactors.update_correction() needs eigendecompose() first")
        if "lam" in self._reduced:
            raise FactorStateError("KFACFactors.update_correction() after the EK-FAC reduce()")
        costs: dict[str, CostModel] = {}
        for name, lg in batch.layers.items():
            lf = self._get(name)
            if not lf.form.lam_keys:
                continue
            x = self._prepare(lf, lg, costs)
            b = x.g.shape[0] if isinstance(x, Factorized) else x.shape[0]
            for sl in _chunks(b, lf.dims[0] * lf.dims[1]):
                rot = self._rotate(lf, _rows(x, sl, b), costs)
                lf.sums["lam"] += rot.pow(2).sum(0).to(self._dtype)
            lf.sums["lam_examples"] += b

    # ---- preconditioning --------------------------------------------------------------
    def precondition(self, batch: GradBatch, method: str = "ekfac") -> GradBatch:
        """``(H + lambda)^-p g`` (``p = KFACConfig.power``) for every layer of a (query)
        batch: dense LayerGrads ``[Q, o*i]``."""
        costs: dict[str, CostModel] = {}
        return batch.with_layers({n: self._scaled(lg, method, False, costs)
                                  for n, lg in batch.layers.items()})

    def precondition_layer(self, lg: LayerGrad, method: str = "ekfac") -> LayerGrad:
        """One layer: ``Q_S [(Q_S^T G Q_A) / (eigenvalues + lambda)^p] Q_A^T`` -> Dense
        float32 (``p = KFACConfig.power``).

        Args:
            lg: factorized or dense (projected as the factors are) query gradients.
            method: ``kfac`` (eigenvalues ``l_S l_A^T``) or ``ekfac`` (corrected ``L``).

        Raises:
            ShapeError: the layer is unknown to the factors or its shape/projection differs.
        """
        return self._scaled(lg, method, whiten=False)

    def whiten(self, batch: GradBatch, method: str = "ekfac") -> GradBatch:
        """``whiten_layer`` for every layer of a batch (train or query side)."""
        costs: dict[str, CostModel] = {}
        return batch.with_layers({n: self._scaled(lg, method, True, costs)
                                  for n, lg in batch.layers.items()})

    def whiten_layer(self, lg: LayerGrad, method: str = "ekfac") -> LayerGrad:
        """``r = (Q_S^T G Q_A) / (eigenvalues + lambda)^(p/2)``: Dense ``[B, o*i]`` float32.

        ``r`` is ``(F + lambda)^-p/2 vec(G)`` in the Kronecker eigenbasis (an orthogonal
        change of coordinates), so ``<r_n, r_q> = <g_n, (F + lambda)^-p g_q>``: influence as a
        plain dot product of whitened rows. Random projections of whitened rows keep
        their JL error relative to ``|r_n| |r_q|`` (balanced), whereas projecting
        ``g_n`` against a preconditioned ``H^-1 g_q`` (dominated by low-curvature
        directions where ``g_n`` is small) drowns the signal. Tagged
        ``whitened:<method>[:<projection>]``; ``ops.project`` may project it further.
        """
        return self._scaled(lg, method, whiten=True)

    def _scaled(self, lg: LayerGrad, method: str, whiten: bool,
                costs: dict[str, CostModel] | None = None) -> LayerGrad:
        """``precondition_layer`` / ``whiten_layer``; ``costs``: the default cost models
        resolved so far in this batch (by device type)."""
        costs = {} if costs is None else costs
        if method not in METHODS:
            raise ConfigError(f"method must be one of {METHODS}, got '{method}'")
        lf = self._get(lg.name)
        if not lf.eig:
            raise FactorStateError("KFACFactors.precondition() needs eigendecompose() first")
        inv = self._inverse(lf, method, whiten)
        x = self._prepare(lf, lg, costs)
        o, i = lf.dims
        b = x.g.shape[0] if isinstance(x, Factorized) else x.shape[0]
        out = torch.empty(b, o * i, dtype=COMPUTE_DTYPE, device=inv.device)
        for sl in _chunks(b, o * i):  # bounds the float64 intermediates
            rot = self._rotate(lf, _rows(x, sl, b), costs)
            if whiten and rot.dtype == out.dtype:  # scaled straight into the rows: no copy
                torch.mul(rot, inv, out=out[sl].view(-1, o, i))
                continue
            r = rot * inv
            out[sl] = (r if whiten else self._unrotate(lf, r)).reshape(-1, o * i)
        if not whiten:
            return lg.replace(data=Dense(out), space=lf.space)
        return lg.replace(data=Dense(out), space=lf.space.replace(whitened=method))

    def _inverse(self, lf: LayerFactors, method: str, whiten: bool) -> torch.Tensor:
        """``(eigenvalues + lambda)^-p`` (``p/2`` to whiten) in ``KFACConfig.dtype``, 0 where
        not positive: a function of the factors alone, kept until they change (their tensors'
        versions), so a batch does not recompute it (nor read the EK-FAC count back)."""
        deps = (*lf.eig.values(), *lf.sums.values())
        versions = tuple(t._version for t in deps)
        key = (lf.name, method, whiten)
        hit = self._inverses.get(key)
        if hit is not None and hit[1] == versions and len(hit[0]) == len(deps) and all(
                a is b for a, b in zip(hit[0], deps)):
            return hit[2]
        ev = self._eigenvalues(lf, method)
        mean = ev.mean()
        lam = self.config.damping * (mean if self.config.damping_mode == "relative" else 1.0)
        power = self.config.power / 2 if whiten else self.config.power
        inv = torch.where(ev + lam > 0, (ev + lam).clamp_min(1e-300).pow(-power), 0.0)
        inv = inv.to(self._dtype)
        self._inverses[key] = (deps, versions, inv)
        return inv

    def _eigenvalues(self, lf: LayerFactors, method: str) -> torch.Tensor:
        if not (CORRECTED[method] and lf.form.lam_keys):
            return lf.form.kfac_eigenvalues(lf.eig)
        n = float(lf.sums["lam_examples"])
        if n == 0:
            raise FactorStateError(
                f"Layer '{lf.name}': EK-FAC eigenvalues were not accumulated; run "
                f"update_correction() over the training data (and reduce()), or use method='kfac'")
        return lf.sums["lam"].double() / n

    def _get(self, name: str) -> LayerFactors:
        lf = self.layers.get(name)
        if lf is None:
            raise ShapeError(f"Layer '{name}' has no curvature factors; fitted layers are "
                             f"{sorted(self.layers)}. Fit factors on the same capture.include/"
                             f"exclude as the query, or restrict the query to fitted layers")
        return lf

    def _check(self, lf: LayerFactors, lg: LayerGrad, allow_projection_change: bool = False,
               space: Space | None = None):
        """Kind and shape match the factors; and the space (``lg``'s, or the given ``space``
        of rows derived from it) unless ``allow_projection_change``."""
        if lg.kind is not lf.kind or tuple(lg.shape) != lf.shape:
            raise ShapeError(f"Layer '{lf.name}': factors are for kind '{lf.kind}' shape "
                             f"{lf.shape}, got kind '{lg.kind}' shape {lg.shape}")
        space = lg.space if space is None else space
        if not allow_projection_change and space != lf.space:
            raise ShapeError(
                f"Layer '{lf.name}': gradients have projection {space.tag!r} but the "
                f"factors act on {lf.projection!r}; project queries with the store's "
                f"ProjectionConfig (or build KFACFactors with that projector)")

    def _width(self, lf: LayerFactors, v: torch.Tensor) -> None:
        if v.shape[1] != lf.dims[0] * lf.dims[1]:
            raise ShapeError(f"Layer '{lf.name}': expected {lf.dims[0]}*{lf.dims[1]} = "
                             f"{lf.dims[0] * lf.dims[1]} columns (projection {lf.projection!r}), "
                             f"got shape {tuple(v.shape)}")

    def _prepare(self, lf: LayerFactors, lg: LayerGrad,
                 costs: dict[str, CostModel]) -> Factorized | torch.Tensor:
        """Query/train data in the factors' working space: factors (unprojected) or rows."""
        if lg.space.canonical and lf.space.projected and self.projector is not None:
            lg = project(lg, self.projector, _cost(costs, lg.device))
        self._check(lf, lg)
        dev = next(iter(lf.sums.values())).device  # compute where the factors live
        if isinstance(lg.data, Factorized) and lf.form.factorized:
            f = lg.data
            return f if f.g.device == dev else f.to(dev)
        v = lg.kind.rows(lg.data, lg.shape)
        self._width(lf, v)
        return v.to(dev)

    def _rotate(self, lf: LayerFactors, x: Factorized | torch.Tensor,
                costs: dict[str, CostModel]) -> torch.Tensor:
        """``Q_S^T G_b Q_A`` ``[B, o, i]`` in ``KFACConfig.dtype`` (the form's rotation).

        Factors are rotated first, or materialized first where the cost model's ``rotate``
        op says that is cheaper (short sequences of wide layers: ``T`` above about the
        layer width); both compute the same map."""
        form, args = lf.form, (lf.kind, lf.eig, x, lf.dims, self._dtype)
        if not (isinstance(x, Factorized) and form.routed_rotation):
            return form.rotate(*args)
        return _cost(costs, x.g.device).route(
            "rotate", lf.name, lf.kind, x, lf.dims,
            {"ghost": partial(form.rotate, *args),
             "dense": partial(form.rotate, *args, materialize_first=True)},
            itemsize=self._itemsize)

    def _unrotate(self, lf: LayerFactors, r: torch.Tensor) -> torch.Tensor:
        return lf.form.unrotate(lf.eig, r, self._dtype)

    def fingerprint(self) -> str:
        """Digest of what preconditioning depends on: the config (damping, power, ...), the
        layers, their projections and eigenvalues (K-FAC and EK-FAC). Equal fingerprints =
        the same whitening; a whitened store records it (``StoreSpec.whitened_by``)."""
        if not self.eigendecomposed:
            raise FactorStateError("KFACFactors.fingerprint() needs eigendecompose() first")
        h = hashlib.blake2b(digest_size=12)
        h.update(json.dumps(asdict(self.config), sort_keys=True).encode())
        for name in sorted(self.layers):
            lf = self.layers[name]
            h.update(json.dumps(lf.meta(), sort_keys=True).encode())
            parts = [lf.eig[k] for k in sorted(lf.eig) if k.startswith("l")]
            parts += [lf.sums[k] for k in lf.form.lam_keys if k in lf.sums]
            for t in parts:
                h.update(t.detach().double().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    # ---- persistence --------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write config, layer metadata (JSON text) and plain tensors with ``torch.save``."""
        state = {"format": _FORMAT, "config": json.dumps(asdict(self.config)),
                 "reduced": json.dumps(sorted(self._reduced)),
                 "layers": json.dumps([lf.meta() for lf in self.layers.values()]),
                 "sums": {n: {k: t.cpu() for k, t in lf.sums.items()}
                          for n, lf in self.layers.items()},
                 "eig": {n: {k: t.cpu() for k, t in lf.eig.items()}
                         for n, lf in self.layers.items()}}
        torch.save(state, Path(path))

    @classmethod
    def load(cls, path: str | Path, projector: Projector | None = None,
             map_location: str | torch.device = "cpu") -> KFACFactors:
        """Read factors written by ``save`` (``weights_only``: no pickled objects)."""
        from dattri_ds.io.files import load_torch
        state = load_torch(path, "K-FAC factor file", map_location=map_location,
                           fix="pass a factors file written by tools/fit.py")
        if state.get("format") != _FORMAT:
            raise FactorFileError(f"{path} is not a K-FAC factor file ({_FORMAT}), got "
                                     f"format {state.get('format')!r}")
        config = json.loads(state["config"])
        # Files written before KFACConfig.power existed used the exact inverse: keep it.
        config.setdefault("power", 1.0)
        out = cls(KFACConfig(**config), projector)
        out._reduced = set(json.loads(state["reduced"]))
        for m in json.loads(state["layers"]):
            lf = out.layers[m["name"]] = LayerFactors.from_meta(m)
            lf.sums, lf.eig = dict(state["sums"][lf.name]), dict(state["eig"][lf.name])
        if projector is not None:
            tags = {lf.space.projection for lf in out.layers.values() if lf.space.projected}
            if tags - {projector.space.projection}:
                raise FactorFileError(f"{path}: factors were fitted under projection "
                                         f"{sorted(tags)}, the projector is "
                                         f"{projector.config.tag!r}")
        return out



def logra_sides(batch: GradBatch, projector: Projector) -> GradBatch:
    """A batch in LoGra's working space: each factorized outer-product layer that a
    Kronecker ``projector`` projects (``O*I' > dim``, not a tensor-parallel shard) becomes
    its projected sides ``(P_in a, P_out g)`` float32 in ``projector.space``; other layers
    are unchanged.

    Everything a LoGra fit and store need is a function of these sides: the factors
    ``P_in A P_in^T`` / ``P_out S P_out^T`` (``KFACFactors(projector=...)``), the EK-FAC
    eigenvalues, and the rows ``vec(P_out G_b P_in^T) = vec(sum_t g'_bt a'_bt^T)``
    (``ops.space.project`` materializes them), while a batch shrinks about ``I'/ki`` and
    ``O/ko`` fold per side (``Spill(projector=...)`` keeps these). Not for exact methods.

    Raises:
        ConfigError: the projection is not Kronecker.
    """
    if not projector.kind.factorized:
        raise ConfigError(f"logra_sides: projection kind {projector.config.kind!r} has no "
                          f"per-side factors; use ProjectionConfig(kind='kronecker') (LoGra)")
    layers = {}
    for n, lg in batch.layers.items():
        o, i = lg.shape
        if (isinstance(lg.data, Factorized) and isinstance(lg.kind, OuterProductKind)
                and lg.space.canonical and lg.shard is None and o * i > projector.config.dim):
            p_out, p_in = projector.kron_sides(n, o, i, lg.data.g.device)
            lg = lg.replace(data=lg.kind.side_project(lg.data, p_out, p_in),
                            space=projector.space)
        layers[n] = lg
    return batch.with_layers(layers)


def _chunks(n_rows: int, row_elems: int) -> list[slice]:
    """Row slices bounding the ``[c, o, i]`` intermediates (``layers.outer.row_chunks``;
    one slice, without asking it, when everything fits)."""
    if 0 < n_rows * row_elems <= GHOST_CHUNK_ELEMENTS:
        return [slice(0, n_rows)]
    return list(row_chunks(n_rows, row_elems))


def _cost(costs: dict[str, CostModel], device: torch.device) -> CostModel:
    """The default cost model of ``device``'s type, asked once per batch (``costs``)."""
    return costs.get(device.type) or costs.setdefault(device.type, default_cost_model(device))


def _rows(x: Factorized | torch.Tensor, sl: slice, b: int) -> Factorized | torch.Tensor:
    """Examples ``sl`` of factors or rows (all of them without a copy or a new object)."""
    if sl.start == 0 and sl.stop == b:
        return x
    return Factorized(x.a[sl], x.g[sl]) if isinstance(x, Factorized) else x[sl]
