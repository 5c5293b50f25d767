"""Selection policies: pure functions from candidate scores to the chosen indices.

Scores follow the library's sign convention: higher = the candidate's gradient is more
aligned with the target gradient, so one SGD step on it lowers the target loss more
(first order: ``dL_target ~ -lr * <g_target, g_b>``).

Every policy takes ``scores [C]`` and returns a sorted ``LongTensor`` of chosen indices.
They are registered by name in ``POLICIES`` (flat table, no if/elif chains).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dattri_ds.errors import ConfigError

__all__ = ["top_k", "top_fraction", "threshold", "greats", "soft_top_k", "fill_uniform",
           "cap_repeats", "POLICIES", "choose"]


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
    top-k, large temperatures approach a uniform draw. Candidates scored ``-inf`` (e.g. over
    a repeat cap) come last. Gumbel-top-k sampling: exact sequential sampling without
    replacement.
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


def cap_repeats(scores: torch.Tensor, counts: torch.Tensor, cap: int | None) -> torch.Tensor:
    """Scores with candidates already trained ``>= cap`` times set to ``-inf`` (None: no cap).

    Policies then pick capped candidates only when too few others remain.
    """
    if cap is None:
        return scores
    if cap < 1:
        raise ConfigError(f"cap_repeats needs cap >= 1 (or None), got {cap}")
    return torch.where(counts >= cap, torch.full_like(scores, float("-inf")), scores)


#: name -> policy(scores, *, k, gram, lr, fraction, tau) adapter
POLICIES: dict[str, Callable[..., torch.Tensor]] = {
    "topk": lambda s, *, k, **_: top_k(s, k),
    "fraction": lambda s, *, fraction, **_: top_fraction(s, fraction),
    "threshold": lambda s, *, tau, k, **_: threshold(s, tau, k),
    "greats": lambda s, *, k, gram, lr, **_: greats(s, gram, k, lr),
    "soft": lambda s, *, k, temperature, generator, **_: soft_top_k(s, k, temperature, generator),
}


def choose(policy: str, scores: torch.Tensor, **params) -> torch.Tensor:
    """Apply the policy named ``policy`` (see ``POLICIES``)."""
    try:
        fn = POLICIES[policy]
    except KeyError:
        raise ConfigError(f"Unknown selection policy '{policy}'; known: {sorted(POLICIES)}") \
            from None
    return fn(scores, **params)
