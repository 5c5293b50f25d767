"""StoreConfig: where and how the gradient store writes (the *what* is a StoreSpec)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from dattri_ds.io import schema

__all__ = ["StoreConfig", "STORE_DTYPES"]

#: Row dtypes a store can hold. ``bfloat16`` rows are kept as raw 16-bit words (numpy has
#: no bfloat16) and reinterpreted on read, so no precision is lost on the way to disk.
STORE_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """How projected per-example gradients are written to disk."""

    path: str
    """Directory of the store (created if missing). Every data-parallel rank writes its own
    shard in it; a reader merges all shards found there."""

    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Dtype of the stored rows. ``float16`` halves the size but overflows above 65504 (an
    error, never a silent inf); ``bfloat16`` keeps the float32 range at 8 bits of mantissa."""

    flush_every: int = field(default=512, metadata=schema.bounds(ge=1, le=2**24))
    """Commit (write, fsync, update the index) once this many new rows are buffered. A crash
    loses at most this many rows per rank, which a resumed run recomputes."""

    async_write: bool = False
    """Write from a background thread, so ``append`` returns without waiting on the disk.
    An error in that thread is raised by the next ``append``, ``flush`` or ``close``."""

    max_queue: int = field(default=8, metadata=schema.bounds(ge=1, le=2**16))
    """Batches the background thread may hold; ``append`` blocks when the queue is full, which
    bounds the host memory a slow disk can take."""

    fsync: bool = True
    """fsync data before the index is replaced (crash safety). Only turn off for throwaway
    stores: without it a power loss can leave an index pointing at unwritten rows."""

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        schema.check(self, "store")  # the dtype Literal mirrors STORE_DTYPES

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreConfig:
        """Build from a dict (a ``"store"`` JSON block), rejecting unknown keys."""
        from dattri_ds.capture.config import from_dict

        return from_dict(cls, d, "store")
