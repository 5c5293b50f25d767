"""Curvature factor forms: one strategy class per form of a layer's K-FAC/EK-FAC factors.

``KFACFactors`` (``ops/kronecker.py``) keeps per-layer sums and an eigenbasis; what those
are, how they accumulate, decompose and rotate a gradient depends on the layer's *form*,
looked up once per layer in the registry (``get_form(name)``):

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
from typing import ClassVar

import torch

from dattri_ds.errors import registered
from dattri_ds.gradient import Factorized
from dattri_ds.layers.base import get_kind
from dattri_ds.ops.gram import add_gram_

__all__ = ["FactorForm", "KronForm", "IndexForm", "FullForm", "DiagonalForm", "get_form",
           "LAM_KEYS"]

#: EK-FAC sums: corrected eigenvalue sums ``[o, i]`` and their example count.
LAM_KEYS = ("lam", "lam_examples")
_FORMS: dict[str, FactorForm] = {}


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
        if name is not None:
            cls.name = name
            _FORMS[name] = cls()

    @abstractmethod
    def shapes(self, o: int, i: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensor sums in a working space of ``(o, i)``."""

    @abstractmethod
    def accumulate(self, sums: dict[str, torch.Tensor], x, mask: torch.Tensor | None,
                   dtype: torch.dtype) -> None:
        """Pass 1: fold factors (``mask [B, T]`` contributing tokens) or rows ``[B, W]``."""

    @abstractmethod
    def eigendecompose(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Eigenvalues and bases (float64) from the reduced pass-1 sums."""

    @abstractmethod
    def kfac_eigenvalues(self, eig: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[o, i]`` K-FAC eigenvalues (or ``[1, W]``)."""

    @abstractmethod
    def rotate(self, kind: str, eig: dict[str, torch.Tensor], x: Factorized | torch.Tensor,
               dims: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """``[B, o, i]`` gradients in the eigenbasis, in ``dtype``."""

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

    def _covariances(self, sums):
        return (sums["a"].double() / sums["tokens"].clamp_min(1),
                sums["s"].double() / sums["examples"].clamp_min(1))

    def eigendecompose(self, sums):
        a, s = self._covariances(sums)
        (l_s, q_s), (l_a, q_a) = _eigh(s), _eigh(a)
        return {"l_s": l_s, "q_s": q_s, "l_a": l_a, "q_a": q_a}

    def kfac_eigenvalues(self, eig):
        return torch.outer(eig["l_s"], eig["l_a"])

    def rotate(self, kind, eig, x, dims, dtype):
        o, i = dims
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
        a, s = self._covariances(sums)
        l_s, q_s = _eigh(s)
        return {"l_s": l_s, "q_s": q_s, "l_a": a}

    def rotate(self, kind, eig, x, dims, dtype):
        o, i = dims
        q_s = _cast(eig["q_s"], dtype)
        if isinstance(x, torch.Tensor):
            return q_s.T @ _cast(x, dtype).view(-1, o, i)
        gs = Factorized(x.a, _cast(x.g, dtype) @ q_s)
        return get_kind(kind).materialize(gs, (o, i)).view(-1, o, i)

    def unrotate(self, eig, r, dtype):
        return _cast(eig["q_s"], dtype) @ r


class FullForm(FactorForm, name="full"):
    """Dense-only kinds of small width: the exact Fisher block ``[W, W]`` (no correction).

    On ``tools/lds.py`` (5 seeds, two query sets) the exact block of the norm layers scored
    +0.014 and +0.004 LDS over their diagonal for EK-FAC, as much as dropping them did
    (README, issue 14).
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

    def rotate(self, kind, eig, x, dims, dtype):
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

    def rotate(self, kind, eig, x, dims, dtype):
        return _cast(x, dtype).view(-1, *dims)

    def unrotate(self, eig, r, dtype):
        return r


def get_form(name: str) -> FactorForm:
    """The registered FactorForm called ``name``."""
    return registered(_FORMS, name, "curvature factor form")


def _eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetrized float64 matrix."""
    m = m.double()
    lam, q = torch.linalg.eigh((m + m.T) / 2)
    return lam.clamp_min(0), q
