"""Selection policies: pure functions from candidate scores to the chosen indices.

Scores follow the library's sign convention: higher = the candidate's gradient is more
aligned with the target gradient, so one SGD step on it lowers the target loss more
(first order: ``dL_target ~ -lr * <g_target, g_b>``).

Every policy takes ``scores [C]`` and returns a sorted ``LongTensor`` of chosen indices.
They are registered by name in ``POLICIES`` as ``Policy`` classes that carry their own
properties (``scaled``: reads the scores' scale; ``needs_gram``: GREATS' redundancy term).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops import CostModel, cross_gram
from dattri_ds.registry import Registry

__all__ = ["top_k", "top_fraction", "threshold", "greats", "soft_top_k", "fill_uniform",
           "Policy", "POLICIES", "choose"]


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` highest scores (ties broken by the lower index)."""
    if not 1 <= k <= scores.numel():
        raise ConfigError(f"top_k needs 1 <= k <= {scores.numel()} candidates, got k={k}")
    order = torch.argsort(-scores.double(), stable=True)
    return order[:k].sort().values


def top_fraction(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The top ``ceil(fraction * C)`` scores (at least one)."""
    if not 0 < fraction <= 1:
        raise ConfigError(f"top_fraction needs 0 < fraction <= 1, got {fraction}")
    k = max(1, int(torch.tensor(fraction * scores.numel()).ceil()))
    return top_k(scores, k)


def threshold(scores: torch.Tensor, tau: float, max_k: int | None = None) -> torch.Tensor:
    """Every candidate with ``score > tau`` (best ``max_k`` of them); the best one if none."""
    idx = torch.nonzero(scores > tau).flatten()
    if idx.numel() == 0:
        return top_k(scores, 1)
    if max_k is not None and idx.numel() > max_k:
        return idx[top_k(scores[idx], max_k)]
    return idx


def greats(scores: torch.Tensor, gram: torch.Tensor, k: int, lr: float) -> torch.Tensor:
    """GREATS-style greedy selection that discounts redundancy.

    With ``u_b = <g_target, g_b>`` (``scores``) and ``K = [<g_b, g_c>]`` (``gram``), the
    second-order estimate of the target-loss drop of training on a set S with step ``lr`` is
    ``lr * sum_{b in S} u_b - lr^2 / 2 * sum_{b,c in S} K_bc`` (identity Hessian). Greedily
    add the candidate with the largest marginal gain per unit step,
    ``u_b - lr * (sum_{c in S} K_bc + K_bb / 2)``, until ``k`` are chosen (``lr = 0`` is
    plain top-k).
    """
    c = scores.numel()
    if not 1 <= k <= c:
        raise ConfigError(f"greats needs 1 <= k <= {c} candidates, got k={k}")
    if gram.shape != (c, c):
        raise ConfigError(f"greats needs a [{c}, {c}] gram, got {tuple(gram.shape)}")
    u, kk = scores.double(), gram.double()
    chosen = torch.zeros(c, dtype=torch.bool)
    redundancy = torch.zeros(c, dtype=torch.float64)
    for _ in range(k):
        gain = u - lr * (redundancy + torch.diagonal(kk) / 2)
        gain[chosen] = float("-inf")
        best = int(torch.argmax(gain))
        chosen[best] = True
        redundancy += kk[best]
    return torch.nonzero(chosen).flatten()


def soft_top_k(scores: torch.Tensor, k: int, temperature: float,
               generator: torch.Generator) -> torch.Tensor:
    """Sample ``k`` candidates without replacement, ``P(b) ~ exp(z_b / temperature)``.

    ``z`` are the scores standardized over the finite candidates (mean 0, standard deviation
    1), so the temperature does not depend on the score's scale: ``temperature -> 0`` is
    top-k, large temperatures approach a uniform draw. Candidates scored ``-inf`` come
    last. Gumbel-top-k sampling: exact sequential sampling without replacement.
    """
    if temperature <= 0:
        raise ConfigError(f"soft_top_k needs temperature > 0, got {temperature}")
    c = scores.numel()
    if not 1 <= k <= c:
        raise ConfigError(f"soft_top_k needs 1 <= k <= {c} candidates, got k={k}")
    s = scores.double()
    finite = torch.isfinite(s)
    z = torch.full_like(s, float("-inf"))
    if finite.any():
        f = s[finite]
        sd = f.std(unbiased=False) if f.numel() > 1 else f.new_tensor(0.0)
        z[finite] = (f - f.mean()) / sd.clamp_min(1e-12)
    u = torch.rand(c, generator=generator, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    keys = z / temperature - torch.log(-torch.log(u))
    return top_k(keys, k)


def fill_uniform(chosen: torch.Tensor, c: int, k: int,
                 generator: torch.Generator) -> torch.Tensor:
    """``chosen`` plus a uniform draw from the other of ``c`` candidates, ``k`` in all.

    The mix with uniform choice: a policy picks ``k - round(ratio * k)``, this fills the
    rest (``chosen`` empty = a uniform choice of ``k``).
    """
    if not chosen.numel() <= k <= c:
        raise ConfigError(f"fill_uniform needs {chosen.numel()} <= k <= {c}, got k={k}")
    rest = torch.ones(c, dtype=torch.bool)
    rest[chosen] = False
    pool = torch.nonzero(rest).flatten()
    fill = pool[torch.randperm(pool.numel(), generator=generator)[:k - chosen.numel()]]
    return torch.cat([chosen, fill]).sort().values


class Policy(ABC):
    """A registered choice rule: ``policy(scores, *, k, gram, lr, fraction, tau, temperature,
    generator) -> sorted indices``, with the properties the selection step asks of it.

    Subclass with ``class MyPolicy(Policy, name="mine")`` (registers it in ``POLICIES``).
    """

    name: ClassVar[str]
    scaled: ClassVar[bool] = False
    """Reads the scores' own scale (a threshold, a learning-rate-weighted gain): what it
    chooses from must be a score with a scale (``Score.scale``), not a standardized
    combination (the content prior then does not apply)."""
    needs_gram: ClassVar[bool] = False
    """Needs the candidates' pairwise gradient inner products (``gram``): the step builds
    them from this rank's gradients, or from the gathered projected vectors under global
    scope."""

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        POLICIES.register_class(cls, name, instance=True)

    def gram(self, source: GradBatch | torch.Tensor, cost: CostModel | None = None
             ) -> torch.Tensor:
        """``[C, C]`` candidate gram from a GradBatch or ``[C, P]`` vectors (``needs_gram``)."""
        if isinstance(source, GradBatch):
            layers = list(source.layers)
            return cross_gram(source, source, layers=layers, cost=cost).cpu()
        return source @ source.T

    @abstractmethod
    def __call__(self, scores: torch.Tensor, **params) -> torch.Tensor:
        """Sorted ``LongTensor`` of the chosen candidates' indices."""

    def mixed(self, scores: torch.Tensor, k: int, *, uniform_mix: float,
              gram_source: GradBatch | torch.Tensor | None, cost: CostModel | None,
              generator: torch.Generator, **params) -> torch.Tensor:
        """This policy's ``k - round(uniform_mix * k)`` picks (``k`` capped at ``C``), filled
        up to ``k`` by a uniform draw from the others (``fill_uniform``); the gram comes
        from ``gram_source`` when the policy ``needs_gram``."""
        c = scores.numel()
        k = min(k, c)
        k_policy = k - round(uniform_mix * k)
        chosen = torch.zeros(0, dtype=torch.long)
        if k_policy > 0:
            gram = self.gram(gram_source, cost) if self.needs_gram else None
            chosen = self(scores, k=k_policy, gram=gram, generator=generator, **params)
        return fill_uniform(chosen, c, k, generator) if chosen.numel() < k else chosen


#: name -> Policy (callable as policy(scores, *, k, gram, lr, fraction, tau, ...))
POLICIES: Registry[Policy] = Registry(
    "selection policy", hint="add one with class X(Policy, name='x') and 'x' in "
    "SelectionConfig.policy")


class TopK(Policy, name="topk"):
    """The ``k`` best (``top_k``)."""

    def __call__(self, s, *, k, **_):
        return top_k(s, k)


class Fraction(Policy, name="fraction"):
    """The top ``fraction`` of the candidates (``top_fraction``)."""

    def __call__(self, s, *, fraction, **_):
        return top_fraction(s, fraction)


class Threshold(Policy, name="threshold"):
    """Every candidate above ``tau`` (``threshold``): reads the scores' scale."""

    scaled = True

    def __call__(self, s, *, tau, k, **_):
        return threshold(s, tau, k)


class Greats(Policy, name="greats"):
    """GREATS' greedy gain with a redundancy discount (``greats``): reads the scores' scale
    (``lr``-weighted) and the candidates' gram."""

    scaled = True
    needs_gram = True

    def __call__(self, s, *, k, gram, lr, **_):
        return greats(s, gram, k, lr)


class Soft(Policy, name="soft"):
    """Sampling by standardized scores (``soft_top_k``)."""

    def __call__(self, s, *, k, temperature, generator, **_):
        return soft_top_k(s, k, temperature, generator)


def choose(policy: str, scores: torch.Tensor, **params) -> torch.Tensor:
    """Apply the policy named ``policy`` (see ``POLICIES``)."""
    if policy not in POLICIES:
        raise ConfigError(f"Unknown selection policy '{policy}'; known: {POLICIES.names()}")
    return POLICIES.lookup(policy)(scores, **params)
