"""Per-example gradients of tokenized rows for the tools, by probe passes, with their ids."""

from __future__ import annotations

import torch

from dattri_ds import collect
from dattri_ds.capture.semantics import batch_info
from dattri_ds.tools.progress import bar as progress_bar

__all__ = ["gradients", "example_ids"]


def example_ids(data, rows: torch.Tensor, label_shift: int = 1) -> list[str]:
    """The sample ids capture will give these rows (``<doc id>#<content hash>``)."""
    batch = data.batch(rows)
    info = batch_info((), batch, label_shift=label_shift,
                      user_ids=[data.docs[i].id for i in rows.tolist()])
    return list(info.sample_ids)


def gradients(model, data, rows: torch.Tensor, *, capture, batch_size: int,
              device: torch.device | str = "cpu", progress: str | None = None,
              factors=None):
    """Per-example gradients (GradBatch per ``batch_size`` rows) by probe passes
    (``dattri_ds.collect``): no parameter ``.grad`` is touched. ``capture`` is a
    CaptureConfig (projection and whitening by ``factors`` apply); sample ids are
    ``<doc id>#<content hash>``; ``progress`` names a progress bar (tqdm on a terminal,
    else log lines; None: none)."""
    chunks = [rows[s:s + batch_size] for s in range(0, rows.numel(), batch_size)]
    bar = progress_bar(rows.numel(), progress)
    batches = (data.batch(idx) for idx in chunks)
    ids = ([data.docs[i].id for i in idx.tolist()] for idx in chunks)
    for idx, got in zip(chunks, collect(model, batches, capture, user_ids=ids, device=device,
                                        factors=factors)):
        if bar is not None:
            bar.update(idx.numel())
        yield got
    if bar is not None:
        bar.close()
