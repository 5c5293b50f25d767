"""Curvature factor forms: one strategy class per form of a layer's K-FAC/EK-FAC factors.

``KFACFactors`` (``ops/kronecker.py``) keeps per-layer sums and an eigenbasis; what those
are, how they accumulate, decompose and rotate a gradient depends on the layer's *form*,
resolved once per layer from the registry (``FORMS``; ``LayerFactors`` holds the object):

* ``kron`` (linear/conv1d): ``A = E_tok[a a^T]`` ``[i, i]``, ``S = (1/N) sum g g^T``
  ``[o, o]``; rotation ``Q_S^T G Q_A``.
* ``kron_index`` (embeddings with index inputs): ``A = diag(token counts) / M`` kept as a
  vector ``[i]``, ``Q_A = I``; rotation ``Q_S^T G``.
* ``full`` (dense-only kinds, e.g. layernorm/rmsnorm, with ``W <= KFACConfig.full_max``):
  the exact empirical Fisher block ``F = (1/N) sum_b v_b v_b^T`` ``[W, W]`` of the captured
  row ``v_b``; rotation ``v Q``. In its own eigenbasis the EK-FAC correction equals the
  eigenvalues, so K-FAC and EK-FAC coincide (and both are exact for the block).
* ``diagonal`` (dense-only kinds wider than ``full_max``): ``F ~ diag((1/N) sum_b v_b^2)``;
  no rotation, K-FAC and EK-FAC coincide.

A new form is one subclass ``class MyForm(FactorForm, name="my_form")``; the factors
object never branches on the form name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from dattri_ds.gradient import Factorized
from dattri_ds.registry import Registry

if TYPE_CHECKING:  # kinds pick their form (LayerKind.factor_form): no import back
    from dattri_ds.layers.base import LayerKind

__all__ = ["FactorForm", "KronForm", "IndexForm", "FullForm", "DiagonalForm", "get_form",
           "FORMS", "LAM_KEYS", "MIN_BLOCK", "add_gram_"]

#: EK-FAC sums: corrected eigenvalue sums ``[o, i]`` and their example count.
LAM_KEYS = ("lam", "lam_examples")
FORMS: Registry[FactorForm] = Registry(
    "curvature factor form", hint="define class MyForm(FactorForm, name='my_form')")


MIN_BLOCK = 256
"""Narrowest column block of ``add_gram_`` (narrower blocks run slower per flop than one
GEMM; measured in docs/throughput.md)."""


def add_gram_(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out += x^T x`` in place for ``x`` ``[N, d]``, ``out`` ``[d, d]`` (same dtype);
    returns ``out``. The symmetric Gram of every form's factor sums (the largest GEMMs of a
    curvature fit on a CPU) on the upper block triangle: ``nb (nb + 1) / 2`` of ``nb^2``
    block products for ``nb = d // MIN_BLOCK`` blocks, each entry the same dot product over
    the same rows as in ``x.T @ x``."""
    d = x.shape[1]
    nb = max(1, d // MIN_BLOCK)
    if nb == 1:
        return out.addmm_(x.T, x)
    w = -(-d // nb)
    for i in range(0, d, w):
        xi = x[:, i:i + w]
        for j in range(i, d, w):
            blk = xi.T @ x[:, j:j + w]
            out[i:i + w, j:j + w] += blk
            if j != i:
                out[j:j + w, i:i + w] += blk.T
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class FactorForm(ABC):
    """Strategy for one form; ``class F(FactorForm, name="f")`` registers an instance."""

    name: ClassVar[str]
    cov_keys: ClassVar[tuple[str, ...]] = ("a", "s", "tokens", "examples")
    """Pass-1 sums (tensor sums and float64 counts)."""
    lam_keys: ClassVar[tuple[str, ...]] = LAM_KEYS
    """EK-FAC (pass-2) sums; empty when the form has no eigenvalue correction."""
    factorized: ClassVar[bool] = True
    """Whether the form works on factors ``(a, g)`` (else on dense rows)."""
    routed_rotation: ClassVar[bool] = False
    """Whether ``rotate`` of factors may be routed by the cost model's ``rotate`` op
    (materialize first when that is cheaper; the dense-row rotation is the same map)."""

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        FORMS.register_class(cls, name, instance=True)

    def __reduce__(self):  # pickles / deep copies resolve to the registered instance
        return get_form, (self.name,)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<FactorForm {self.name!r}>"

    @abstractmethod
    def shapes(self, o: int, i: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensor sums in a working space of ``(o, i)``."""

    def zero_sums(self, sums: dict[str, torch.Tensor], keys: tuple[str, ...],
                  dims: tuple[int, int], dtype: torch.dtype, device) -> None:
        """Create the missing ``keys`` of ``sums`` as zeros (tensor sums in ``dtype``, counts
        in float64) for a working space of ``dims``."""
        shapes = self.shapes(*dims)
        for k in keys:
            if k not in sums:
                dt = dtype if k in shapes else torch.float64
                sums[k] = torch.zeros(shapes.get(k, ()), dtype=dt, device=device)

    def update(self, sums: dict[str, torch.Tensor], x: Factorized | torch.Tensor,
               dims: tuple[int, int], dtype: torch.dtype) -> None:
        """Pass 1 for one batch of one layer: open the sums, then ``accumulate``.

        Args:
            x: factors in the working space (``factorized`` forms; contributing tokens are
                those whose output-grad row is not all zero) or rows ``[B, W]``.
        """
        dev = x.g.device if isinstance(x, Factorized) else x.device
        self.zero_sums(sums, self.cov_keys, dims, dtype, dev)
        mask = (x.g != 0).any(-1) if isinstance(x, Factorized) else None
        self.accumulate(sums, x, mask, dtype)

    @abstractmethod
    def accumulate(self, sums: dict[str, torch.Tensor], x, mask: torch.Tensor | None,
                   dtype: torch.dtype) -> None:
        """Pass 1: fold factors (``mask [B, T]`` contributing tokens) or rows ``[B, W]``."""

    @abstractmethod
    def eigendecompose(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Eigenvalues and bases (float64) from the reduced pass-1 sums."""

    def decompose(self, sums: dict[str, torch.Tensor], dims: tuple[int, int],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``eigendecompose``, then open the (zero) EK-FAC sums of pass 2."""
        eig = self.eigendecompose(sums)
        self.zero_sums(sums, self.lam_keys, dims, dtype, next(iter(sums.values())).device)
        return eig

    @abstractmethod
    def kfac_eigenvalues(self, eig: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[o, i]`` K-FAC eigenvalues (or ``[1, W]``)."""

    @abstractmethod
    def rotate(self, kind: LayerKind, eig: dict[str, torch.Tensor], x: Factorized | torch.Tensor,
               dims: tuple[int, int], dtype: torch.dtype,
               materialize_first: bool = False) -> torch.Tensor:
        """``[B, o, i]`` gradients in the eigenbasis, in ``dtype``.

        ``materialize_first``: factors are materialized (by ``kind``) and the rows rotated,
        the cost model's ``rotate`` dense path; the same map as rotating the factors."""

    @abstractmethod
    def unrotate(self, eig: dict[str, torch.Tensor], r: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
        """Back from the eigenbasis: the inverse of ``rotate`` on ``[B, o, i]``."""


class KronForm(FactorForm, name="kron"):
    """Dense Kronecker factors ``S (x) A`` (module docstring)."""

    routed_rotation = True

    def shapes(self, o, i):
        return {"a": (i, i), "s": (o, o), "lam": (o, i)}

    def _add_a(self, sums: dict[str, torch.Tensor], f: Factorized, mask: torch.Tensor,
               dtype: torch.dtype) -> None:
        add_gram_(sums["a"], f.a[mask].to(dtype))

    def accumulate(self, sums, f, mask, dtype):
        self._add_a(sums, f, mask, dtype)
        add_gram_(sums["s"], f.g.to(dtype).reshape(-1, f.g.shape[-1]))
        sums["tokens"] += mask.sum()
        sums["examples"] += f.g.shape[0]

    def covariances(self, sums: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, S)`` normalized as in the module docstring (``A`` a vector for kron_index)."""
        return (sums["a"].double() / sums["tokens"].clamp_min(1),
                sums["s"].double() / sums["examples"].clamp_min(1))

    def eigendecompose(self, sums):
        a, s = self.covariances(sums)
        (l_s, q_s), (l_a, q_a) = _eigh(s), _eigh(a)
        return {"l_s": l_s, "q_s": q_s, "l_a": l_a, "q_a": q_a}

    def kfac_eigenvalues(self, eig):
        return torch.outer(eig["l_s"], eig["l_a"])

    def rotate(self, kind, eig, x, dims, dtype, materialize_first=False):
        o, i = dims
        if materialize_first and isinstance(x, Factorized):
            x = kind.materialize(Factorized(_cast(x.a, dtype), _cast(x.g, dtype)), dims)
        if isinstance(x, torch.Tensor):
            return _cast(eig["q_s"], dtype).T @ _cast(x, dtype).view(-1, o, i) \
                @ _cast(eig["q_a"], dtype)
        gs = _cast(x.g, dtype) @ _cast(eig["q_s"], dtype)  # rows Q_S^T g_bt
        return torch.bmm(gs.transpose(1, 2), _cast(x.a, dtype) @ _cast(eig["q_a"], dtype))

    def unrotate(self, eig, r, dtype):
        return _cast(eig["q_s"], dtype) @ r @ _cast(eig["q_a"], dtype).T


class IndexForm(KronForm, name="kron_index"):
    """Index inputs: ``A`` diagonal (token counts), kept as a vector; ``Q_A = I``."""

    routed_rotation = False  # its rotation already materializes (Q_A = I)

    def shapes(self, o, i):
        return {"a": (i,), "s": (o, o), "lam": (o, i)}

    def _add_a(self, sums, f, mask, dtype):
        sums["a"] += torch.bincount(f.a[mask], minlength=sums["a"].shape[0]).to(dtype)

    def eigendecompose(self, sums):
        a, s = self.covariances(sums)
        l_s, q_s = _eigh(s)
        return {"l_s": l_s, "q_s": q_s, "l_a": a}

    def rotate(self, kind, eig, x, dims, dtype, materialize_first=False):
        o, i = dims
        q_s = _cast(eig["q_s"], dtype)
        if isinstance(x, torch.Tensor):
            return q_s.T @ _cast(x, dtype).view(-1, o, i)
        gs = Factorized(x.a, _cast(x.g, dtype) @ q_s)
        return kind.materialize(gs, (o, i)).view(-1, o, i)

    def unrotate(self, eig, r, dtype):
        return _cast(eig["q_s"], dtype) @ r


class FullForm(FactorForm, name="full"):
    """Dense-only kinds of small width: the exact Fisher block ``[W, W]`` (no correction).

    On ``benchmarks/lds.py`` (5 seeds, two query sets) the exact block of the norm layers scored
    +0.014 and +0.004 LDS over their diagonal for EK-FAC, as much as dropping them did
    (docs/attribution_fidelity.md).
    """

    cov_keys = ("f", "examples")
    lam_keys = ()
    factorized = False

    def shapes(self, o, i):
        return {"f": (i, i)}

    def accumulate(self, sums, v, mask, dtype):
        add_gram_(sums["f"], v.to(dtype))
        sums["examples"] += v.shape[0]

    def eigendecompose(self, sums):
        l, q = _eigh(sums["f"].double() / sums["examples"].clamp_min(1))
        return {"l": l, "q": q}

    def kfac_eigenvalues(self, eig):
        return eig["l"].view(1, -1)

    def rotate(self, kind, eig, x, dims, dtype, materialize_first=False):
        return (_cast(x, dtype) @ _cast(eig["q"], dtype)).view(-1, *dims)

    def unrotate(self, eig, r, dtype):
        return r @ _cast(eig["q"], dtype).T


class DiagonalForm(FactorForm, name="diagonal"):
    """Dense-only kinds: diagonal empirical Fisher on the captured rows (no correction)."""

    cov_keys = ("d", "examples")
    lam_keys = ()
    factorized = False

    def shapes(self, o, i):
        return {"d": (i,)}

    def accumulate(self, sums, v, mask, dtype):
        v = v.to(dtype)
        sums["d"] += v.pow(2).sum(0)
        sums["examples"] += v.shape[0]

    def eigendecompose(self, sums):
        return {"l": sums["d"].double() / sums["examples"].clamp_min(1)}

    def kfac_eigenvalues(self, eig):
        return eig["l"].view(1, -1)

    def rotate(self, kind, eig, x, dims, dtype, materialize_first=False):
        return _cast(x, dtype).view(-1, *dims)

    def unrotate(self, eig, r, dtype):
        return r


def get_form(name: str | FactorForm) -> FactorForm:
    """The registered FactorForm called ``name`` (a FactorForm is returned as is)."""
    return name if isinstance(name, FactorForm) else FORMS.lookup(name)


def _eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetrized float64 matrix."""
    m = m.double()
    lam, q = torch.linalg.eigh((m + m.T) / 2)
    return lam.clamp_min(0), q
