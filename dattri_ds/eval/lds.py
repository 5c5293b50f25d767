"""Linear Datamodeling Score (LDS): how well attribution scores predict retrained-model losses.

Protocol (Park et al., 2023, "TRAK"): draw S random subsets ``D_s`` of the N training
examples, each of ``round(fraction * N)`` examples (``subset_masks``, ``M [S, N]``); train a
fresh model from the same initialization on each subset and measure its query losses
(``retrain_losses``, ``actual [S, Q]``). Attribution scores ``tau [N, Q]`` predict the
subset outcome additively::

    pred[s, q] = - sum_n M[s, n] tau[n, q]          (predicted, up to a constant per query)

The minus sign follows the convention of ``dattri_ds.methods.base``: ``tau[n, q] > 0``
means training on n *lowers* q's loss, so a subset holding more proponents of q is
predicted a lower loss. The score of query q is the Spearman rank correlation across
subsets of predicted and actual losses, and the LDS is its mean over queries::

    LDS = (1/Q) sum_q spearman(pred[:, q], actual[:, q])

Rank correlation makes the score invariant to any per-query scale or offset of the
scores (learning rate, loss normalization, damping level), so only the ordering of
subsets counts. A perfect linear datamodel gives 1, a sign error -1, noise 0.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from dattri_ds.errors import ConfigError, ShapeError

__all__ = ["LDSResult", "subset_masks", "retrain_losses", "predicted", "rankdata", "spearman",
           "lds"]

logger = logging.getLogger(__name__)


class LDSResult(NamedTuple):
    """LDS of one set of scores.

    Attributes:
        mean: mean over queries with a defined correlation (NaN if none).
        std: standard deviation over those queries (0 with one query).
        per_query: ``[Q]`` Spearman correlation of each query (NaN where either side is
            constant across subsets, so the correlation is undefined).
    """

    mean: float
    std: float
    per_query: torch.Tensor


def subset_masks(n_train: int, n_subsets: int, fraction: float = 0.5,
                 seed: int = 0) -> torch.Tensor:
    """``[S, N]`` boolean masks of S random subsets, each of exactly ``round(fraction * N)``.

    Subset s is the first ``m`` entries of a uniformly random permutation of ``range(N)``
    drawn from a CPU generator seeded with ``seed``: reproducible on any machine.

    Raises:
        ConfigError: ``n_train < 2``, ``n_subsets < 2`` or a fraction that leaves a subset
            empty or equal to the whole training set.
    """
    if n_train < 2 or n_subsets < 2:
        raise ConfigError(f"LDS needs n_train >= 2 and n_subsets >= 2 (a correlation across "
                          f"subsets), got n_train={n_train}, n_subsets={n_subsets}")
    m = round(fraction * n_train)
    if not 0 < m < n_train:
        raise ConfigError(f"LDS subset fraction {fraction} keeps {m} of {n_train} examples; "
                          f"choose a fraction in (0, 1) keeping between 1 and {n_train - 1}")
    gen = torch.Generator().manual_seed(seed)
    masks = torch.zeros(n_subsets, n_train, dtype=torch.bool)
    for s in range(n_subsets):
        masks[s, torch.randperm(n_train, generator=gen)[:m]] = True
    return masks


def retrain_losses(train_fn: Callable[[torch.Tensor, int], torch.nn.Module],
                   masks: torch.Tensor, query: Callable[[torch.nn.Module], torch.Tensor], *,
                   seeds: Sequence[int] = (0,)) -> torch.Tensor:
    """Query losses of models retrained on each subset, ``actual [S, Q]``.

    ``actual[s, q] = (1/|seeds|) sum_r query(train_fn(masks[s], r))[q]``: ``train_fn`` must
    train a fresh model from the same initialization on the examples where the mask is
    True (data order and other randomness drawn from ``r`` only), so that subsets differ
    only by their data; averaging over several seeds further reduces training noise.

    Args:
        train_fn: ``(mask [N] bool, seed) -> trained model``.
        masks: ``[S, N]`` subset masks (``subset_masks``).
        query: ``model -> [Q]`` losses of the queries under that model (evaluated under
            ``torch.no_grad``).
        seeds: training seeds averaged per subset.

    Returns:
        ``[S, Q]`` float64 on the CPU.

    Raises:
        ShapeError: ``masks`` is not 2-D, or ``query`` returns different lengths.
    """
    if masks.dim() != 2:
        raise ShapeError(f"retrain_losses: masks must be [S, N], got {list(masks.shape)}")
    if not seeds:
        raise ConfigError("retrain_losses needs at least one training seed")
    rows: list[torch.Tensor] = []
    t0 = time.time()
    for s, mask in enumerate(masks.bool()):
        runs = []
        for r in seeds:
            model = train_fn(mask, r)
            with torch.no_grad():
                runs.append(torch.as_tensor(query(model)).detach().double().cpu().reshape(-1))
        if rows and runs[0].shape != rows[0].shape:
            raise ShapeError(f"retrain_losses: query returned {runs[0].numel()} losses for "
                             f"subset {s}, {rows[0].numel()} before")
        rows.append(torch.stack(runs).mean(0))
        logger.info("retrained subset %d/%d (%d examples, %d seed(s)): mean query loss %.4f "
                    "(%.1f s)", s + 1, len(masks), int(mask.sum()), len(seeds),
                    float(rows[-1].mean()), time.time() - t0)
    return torch.stack(rows)


def predicted(scores: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Predicted subset losses ``pred [S, Q] = -(M @ tau)``, up to a per-query constant.

    Args:
        scores: ``tau [N, Q]``, ``tau[n, q] > 0`` = n lowers q's loss (``methods.base``).
        masks: ``M [S, N]`` subset masks.

    Raises:
        ShapeError: N differs between the two.
    """
    if scores.dim() != 2 or masks.dim() != 2 or masks.shape[1] != scores.shape[0]:
        raise ShapeError(f"predicted: need scores [N, Q] and masks [S, N] with the same N, got "
                         f"scores {list(scores.shape)} and masks {list(masks.shape)}")
    return -(masks.double() @ scores.double())


def rankdata(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks along dim 0, ties sharing their average rank (``scipy.stats.rankdata``);
    columns holding a NaN are all NaN.

    Args:
        x: ``[S]`` or ``[S, Q]``.

    Returns:
        float64 ranks of the same shape.
    """
    col = x.dim() == 1
    x2 = x.detach().double().cpu().reshape(x.shape[0], -1)
    out = torch.empty_like(x2)
    for q in range(x2.shape[1]):
        v = x2[:, q]
        if torch.isnan(v).any():
            out[:, q] = math.nan
            continue
        _, inverse, counts = torch.unique(v, sorted=True, return_inverse=True,
                                          return_counts=True)
        ends = counts.cumsum(0).double()
        out[:, q] = (ends - (counts.double() - 1) / 2)[inverse]
    return out.reshape(-1) if col else out.reshape(x2.shape)


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Spearman correlation along dim 0: Pearson correlation of ``rankdata`` ranks; NaN where
    a column is constant (the correlation is undefined) or holds a NaN.

    Args:
        x, y: ``[S]`` or ``[S, Q]`` of the same shape.

    Returns:
        ``[]`` (0-d) for 1-D input, else ``[Q]``, float64.

    Raises:
        ShapeError: the shapes differ or S < 2.
    """
    if x.shape != y.shape or x.shape[0] < 2:
        raise ShapeError(f"spearman: need two [S] or [S, Q] tensors of one shape with S >= 2, "
                         f"got {list(x.shape)} and {list(y.shape)}")
    r = rankdata(x)
    u = rankdata(y)
    r = r - r.mean(0)
    u = u - u.mean(0)
    den = (r.pow(2).sum(0) * u.pow(2).sum(0)).sqrt()
    num = (r * u).sum(0)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, math.nan))


def lds(pred: torch.Tensor, actual: torch.Tensor) -> LDSResult:
    """``LDS = mean_q spearman(pred[:, q], actual[:, q])`` (module docstring).

    Args:
        pred: ``[S, Q]`` predicted losses (``predicted(scores, masks)``).
        actual: ``[S, Q]`` losses of the retrained models (``retrain_losses``).

    Returns:
        LDSResult; queries whose correlation is undefined (constant predictions, e.g. an
        all-zero score column) are left out of mean and std and reported as NaN.

    Raises:
        ShapeError: the shapes differ or are not ``[S, Q]``.
    """
    if pred.dim() != 2 or pred.shape != actual.shape:
        raise ShapeError(f"lds: pred and actual must both be [S, Q], got {list(pred.shape)} "
                         f"and {list(actual.shape)}")
    rho = spearman(pred, actual)
    ok = rho[~torch.isnan(rho)]
    if ok.numel() < rho.numel():
        logger.warning("LDS: %d of %d queries have an undefined rank correlation (constant "
                       "predicted or actual losses); they are left out of the mean",
                       rho.numel() - ok.numel(), rho.numel())
    if ok.numel() == 0:
        return LDSResult(math.nan, math.nan, rho)
    std = float(ok.std()) if ok.numel() > 1 else 0.0
    return LDSResult(float(ok.mean()), std, rho)
