"""Capture once, read many times: a one-shot stream of GradBatches replayed from disk.

Curvature influence reads the training gradients three times (factor sums, the EK-FAC
eigenvalue pass, scoring). A capture generator (``collect``, a training loop's hooks) can
be read only once, and capturing again repeats the forward and backward. ``Spill`` wraps
the stream: the first iteration passes every batch through while writing it to a folder;
every later iteration reads the files back. Peak memory stays one batch; the model runs
once. ::

    with Spill(collect(model, batches, cfg)) as train:
        factors = fit_factors(train)                                  # capture + pass 2
        scores = make_attributor("ekfac", factors=factors).scores(train, query)  # pass 3

A later iteration started before the first one finished raises (the stream would be
read twice); an iteration after ``close()`` raises. The folder is a temporary one (under
``dir``) removed by ``close()`` / the ``with`` block.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from dattri_ds.errors import DattriDSError
from dattri_ds.gradient import GradBatch

__all__ = ["Spill"]


class Spill:
    """Re-iterable view of a one-shot GradBatch stream (module docstring).

    Args:
        batches: the stream (any iterable; read exactly once, lazily, on first iteration).
        dir: parent of the temporary folder (default: the system's temporary folder).
    """

    def __init__(self, batches: Iterable[GradBatch], dir: str | None = None) -> None:
        self._source: Iterable[GradBatch] | None = batches
        self._folder = Path(tempfile.mkdtemp(prefix="dattri_ds_spill_", dir=dir))
        self._paths: list[Path] = []
        self._state = "fresh"  # fresh -> writing -> written -> closed

    def __enter__(self) -> Spill:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[GradBatch]:
        """A pass: the state is checked when the pass starts (its first ``next``)."""
        if self._state == "closed":
            raise DattriDSError("Spill was closed: its files are gone; iterate inside the "
                                "'with Spill(...)' block")
        return self._pass()

    def _pass(self) -> Iterator[GradBatch]:
        if self._state == "writing":
            raise DattriDSError("Spill: a second pass started before the first one finished "
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
                raise DattriDSError(f"Spill: item {n} of the stream is a {type(b).__name__}, "
                                    f"not a GradBatch (pass what collect() or a capture yields)")
            path = self._folder / f"{n:08d}.pt"
            torch.save(b, path)
            self._paths.append(path)
            yield b
        self._state = "written"

    def _read(self) -> Iterator[GradBatch]:
        for path in self._paths:  # our own files, written by _write
            yield torch.load(path, weights_only=False)

    def close(self) -> None:
        """Delete the files (idempotent)."""
        self._state = "closed"
        shutil.rmtree(self._folder, ignore_errors=True)
