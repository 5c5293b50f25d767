"""collect: per-example gradients of a model on batches of inputs, one GradBatch per batch.

The probe loop every offline consumer needs (stores, curvature fits, attribution queries,
demos): each batch runs one forward and a backward to the captured layers' outputs only
(``GradientCapture.probe``), so no parameter ``.grad`` is touched and a model that is
being trained (DDP, FSDP2, ZeRO-3) can be probed between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from dattri_ds.capture.hooks import GradientCapture
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.errors import CaptureError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops.cost import CostModel

if TYPE_CHECKING:
    from dattri_ds.ops.kronecker import KFACFactors

__all__ = ["collect"]

Batch = Mapping[str, torch.Tensor]


def _hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def collect(model: nn.Module, batches: Iterable[Batch], config: CaptureConfig | None = None, *,
            user_ids: Iterable[Sequence[str]] | None = None,
            loss_fn: Callable[[nn.Module, Batch], torch.Tensor] = _hf_loss,
            device: torch.device | str | None = None,
            cost: CostModel | None = None,
            factors: KFACFactors | None = None) -> Iterator[GradBatch]:
    """Yield the per-example gradients of every batch, in order (projected if configured).

    With ``config.whiten`` the capture whitens every batch by ``factors`` and then projects
    it (``GradientCapture(factors=)``): the rows of a whitened store (layer tags
    ``<projection tag>+whitened:<method>``).

    Args:
        model: the model; its mode is left as it is (call ``model.eval()`` for no dropout).
        batches: model inputs per batch (``{"input_ids": [B, T], "labels": ..., ...}``).
        config: what to capture; ``loss_reduction`` must say how ``loss_fn`` reduces the
            batch (Hugging Face models: ``token_mean``, the default).
        user_ids: per batch, one id per example, prefixed to the content-hash sample ids.
        loss_fn: ``loss_fn(model, batch) -> reduced loss``, calling the model once.
        device: move every tensor of a batch there first (default: leave it).
        cost: cost model for the projection routing.
        factors: eigendecomposed curvature factors of this model (``config.whiten`` only;
            EK-FAC needs corrected eigenvalues).

    Raises:
        CaptureError: a batch produced no gradient (its loss does not depend on any
            captured layer, or the model is not called inside ``loss_fn``).
        ConfigError: ``config.whiten`` without ``factors``, or ``factors`` without it.

    Example:
        >>> grads = dattri_ds.GradBatch.cat(list(dattri_ds.collect(model, loader, cfg)))
    """
    ids_iter = iter(user_ids) if user_ids is not None else None
    with GradientCapture(model, config, probe_only=True, cost=cost, factors=factors) as cap:
        for i, batch in enumerate(batches):
            if device is not None:
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            if ids_iter is not None:
                cap.tag(list(next(ids_iter)))
            got = cap.probe(lambda b=batch: loss_fn(model, b))
            if got is None:
                raise CaptureError(
                    f"Batch {i} produced no per-example gradient: its loss does not depend on "
                    f"any captured layer (include={list(cap.config.include)}), or loss_fn does "
                    f"not call the model")
            yield got
