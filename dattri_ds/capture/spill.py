"""Capture once, read many times: a one-shot stream of GradBatches replayed from disk.

Curvature influence reads the training gradients three times (factor sums, the EK-FAC
eigenvalue pass, scoring). A capture generator (``collect``, a training loop's hooks) can
be read only once, and capturing again repeats the forward and backward. ``Spill`` wraps
the stream: the first iteration passes every batch through while keeping it, in memory up
to ``memory_bytes`` (default 1 GiB) and in a folder beyond; every later iteration replays
them (files read back one at a time). The model runs once; memory stays within the budget
plus one batch. ::

    with Spill(collect(model, batches, cfg)) as train:
        factors = fit_factors(train)                                  # capture + pass 2
        scores = make_attributor("ekfac", factors=factors).scores(train, query)  # pass 3

LoGra (factors fitted in a Kronecker-projected space, ``fit_factors(projector=p)``) needs
only each layer's projected sides ``P_in a``, ``P_out g``: ``Spill(stream, projector=p)``
keeps and yields those (``ops.kronecker.logra_sides``), about ``I'/ki`` fold fewer bytes,
and the same factors, EK-FAC eigenvalues and projected rows (``project_batch(b, p)``) up to
float rounding. ::

    with Spill(collect(model, batches, cfg), projector=p) as train:
        factors = fit_factors(train, projector=p)
        rows = [project_batch(b, p) for b in train]

A later iteration started before the first one finished raises (the stream would be
read twice); an iteration after ``close()`` raises. The folder is a temporary one (under
``dir``) removed by ``close()`` / the ``with`` block. Why the memory budget (files cost
CPU too): docs/throughput.md (EK-FAC).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from dattri_ds.errors import ClosedError, ConfigError, StreamItemError, StreamStateError
from dattri_ds.gradient import GradBatch
from dattri_ds.ops.kronecker import logra_sides
from dattri_ds.ops.projection import Projector

__all__ = ["Spill", "DEFAULT_MEMORY_BYTES"]

DEFAULT_MEMORY_BYTES = 1 << 30
"""Batches kept in memory before a Spill writes to disk (1 GiB)."""


def _nbytes(b: GradBatch) -> int:
    """Bytes of a batch's gradient tensors."""
    return sum(v.numel() * v.element_size() for lg in b.layers.values()
               for v in (getattr(lg.data, f.name) for f in dataclasses.fields(lg.data))
               if isinstance(v, torch.Tensor))


class Spill:
    """Re-iterable view of a one-shot GradBatch stream (module docstring).

    Args:
        batches: the stream (any iterable; read exactly once, lazily, on first iteration).
        dir: parent of the temporary folder (default: the system's temporary folder).
        memory_bytes: gradient bytes kept in memory (on the device the batches come on);
            later batches go to disk (0: every batch to disk).
        projector: a Kronecker projector: keep and yield every pass each layer's projected
            sides (``logra_sides``) instead of the exact capture, for LoGra factors and
            rows in that projection's space (not for exact methods).
    """

    def __init__(self, batches: Iterable[GradBatch], dir: str | None = None,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 projector: Projector | None = None) -> None:
        if memory_bytes < 0:
            raise ConfigError(f"Spill: memory_bytes={memory_bytes} must be >= 0 "
                                f"(0 keeps nothing in memory)")
        self._projector = projector
        self._source: Iterable[GradBatch] | None = batches
        self._folder = Path(tempfile.mkdtemp(prefix="dattri_ds_spill_", dir=dir))
        self._items: list[GradBatch | Path] = []  # in memory, or the file holding it
        self._budget = memory_bytes
        self._state = "fresh"  # fresh -> writing -> written -> closed

    def __enter__(self) -> Spill:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[GradBatch]:
        """A pass: the state is checked when the pass starts (its first ``next``)."""
        if self._state == "closed":
            raise ClosedError("Spill was closed: its files are gone; iterate inside the "
                                "'with Spill(...)' block")
        return self._pass()

    def _pass(self) -> Iterator[GradBatch]:
        if self._state == "writing":
            raise StreamStateError("Spill: a second pass started before the first one finished "
                                "(the capture stream is still being written, or its first "
                                "pass was abandoned); finish the first pass (e.g. "
                                "fit_factors) before the next")
        if self._state == "fresh":
            yield from self._write()
        else:
            yield from self._read()

    def _write(self) -> Iterator[GradBatch]:
        self._state = "writing"
        source, self._source = self._source, None
        for n, b in enumerate(source):
            if not isinstance(b, GradBatch):
                raise StreamItemError(f"Spill: item {n} of the stream is a {type(b).__name__}, "
                                    f"not a GradBatch (pass what collect() or a capture yields)")
            if self._projector is not None:
                b = logra_sides(b, self._projector)
            size = _nbytes(b)
            if size <= self._budget:
                self._budget -= size
                self._items.append(b)
            else:
                self._budget = 0  # keep the order simple: once on disk, the rest too
                path = self._folder / f"{n:08d}.pt"
                torch.save(b, path)
                self._items.append(path)
            yield b
        self._state = "written"

    def _read(self) -> Iterator[GradBatch]:
        for item in self._items:
            if isinstance(item, GradBatch):
                yield item
            else:  # our own file, written by _write
                yield torch.load(item, weights_only=False)

    def close(self) -> None:
        """Delete the files and drop the batches held in memory (idempotent)."""
        self._state = "closed"
        self._items = []
        shutil.rmtree(self._folder, ignore_errors=True)
