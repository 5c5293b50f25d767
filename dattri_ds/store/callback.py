"""StoreCallback: write every captured GradBatch to this rank's shard of a gradient store."""

from __future__ import annotations

from typing import Any

from dattri_ds.capture.callbacks import TrainingCallback
from dattri_ds.gradient import GradBatch
from dattri_ds.ops.projection import ProjectionConfig
from dattri_ds.store.config import StoreConfig
from dattri_ds.store.spec import StoreSpec
from dattri_ds.store.writer import GradientStoreWriter

__all__ = ["StoreCallback"]


class StoreCallback(TrainingCallback):
    """Appends each projected micro-batch to the store, commits on ``detach()`` and closes it
    when the capture closes (an unclosed writer also commits at interpreter exit).

    The writer opens on the first batch (its layers define the spec), or at construction
    when ``spec`` is given, which makes ``has`` usable before the first batch (to skip
    recomputing examples a resumed run already stored).
    """

    def __init__(self, config: StoreConfig, *, projection: ProjectionConfig, fingerprint: str,
                 rank: int = 0, world: int = 1, spec: StoreSpec | None = None,
                 capture: Any = None, run_id: str | None = None,
                 checkpoint: str | None = None, weights_hash: str | None = None,
                 data: dict | None = None) -> None:
        """
        Args:
            config: where and how to write.
            projection: the ProjectionConfig of ``capture.projection`` (its tag and seed are
                recorded and every batch is checked against it).
            fingerprint: model/checkpoint identity recorded in the store.
            rank: data-parallel rank (= shard number).
            world: data-parallel world size.
            spec: open the writer now with this spec instead of on the first batch.
            capture: the CaptureConfig producing the batches (its loss semantics are
                recorded in the manifest).
            run_id, checkpoint, weights_hash: provenance recorded in the manifest (see
                StoreSpec); None = not recorded (e.g. rows captured over many steps).
            data: the data record of the examples (``StoreSpec.data``); None = not recorded.
        """
        self.config, self.projection, self.fingerprint = config, projection, fingerprint
        self._origin = {"capture": capture, "run_id": run_id, "checkpoint": checkpoint,
                        "weights_hash": weights_hash, "data": data}
        self.rank, self.world = rank, world
        self.writer: GradientStoreWriter | None = None
        if spec is not None:
            self._open(spec)

    def _open(self, spec: StoreSpec) -> GradientStoreWriter:
        self.writer = GradientStoreWriter(self.config, spec, rank=self.rank, world=self.world)
        return self.writer

    def has(self, sample_id: str) -> bool:
        """Whether the store already holds ``sample_id`` (False before the writer opens)."""
        return self.writer is not None and self.writer.has(sample_id)

    def on_batch(self, batch: GradBatch) -> None:
        writer = self.writer
        if writer is None:
            writer = self._open(StoreSpec.from_batch(batch, projection=self.projection,
                                                     fingerprint=self.fingerprint, **self._origin))
        writer.append(batch)

    def on_detach(self) -> None:
        """Commit the buffered rows (``detach()`` without ``close()`` loses none); the
        writer stays open for a later ``attach()``."""
        if self.writer is not None and not self.writer.closed:
            self.writer.flush()

    def on_close(self) -> None:
        if self.writer is not None:
            self.writer.close()
