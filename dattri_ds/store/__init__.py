"""Crash-safe, sharded, memory-mapped store of projected per-example gradients.

Write: ``GradientStoreWriter`` (or ``StoreCallback`` during training), one shard per
data-parallel rank. Read: ``GradientStore.open`` merges the shards and streams blocks.
Consumers of an existing store open it with ``attach(path, StoreRequest(...), mode=...)``,
which compares what they ask with the manifest first. Layout and commit protocol:
docs/store.md.
"""

from __future__ import annotations

from dattri_ds.store.attach import StoreRequest, attach
from dattri_ds.store.callback import StoreCallback
from dattri_ds.store.config import StoreConfig
from dattri_ds.store.format import (
    FORMAT_VERSION, DuplicateSampleError, StoreCorruptError, StoreMismatchError,
)
from dattri_ds.store.reader import GradientStore
from dattri_ds.store.spec import LayerSpec, StoreSpec, weights_hash
from dattri_ds.store.writer import GradientStoreWriter, seal_store

__all__ = [
    "StoreConfig", "StoreSpec", "LayerSpec", "GradientStoreWriter", "GradientStore",
    "StoreCallback", "StoreCorruptError", "DuplicateSampleError", "FORMAT_VERSION", "seal_store",
    "StoreMismatchError", "weights_hash", "StoreRequest", "attach",
]
