"""GradientStore: a read-only, memory-mapped view that merges every shard of a store.

Rows: shards in rank order, rows of a shard in commit order; reads copy only the requested
rows (``iter_blocks`` needs ``O(block_rows * P)`` memory). An id stored in two shards is an
error by default; ``duplicates="first"`` keeps the first copy in that order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from dattri_ds.errors import ClosedError, ConfigError, StoreCorruptError
from dattri_ds.gradient import Dense, GradBatch, LayerGrad, Space
from dattri_ds.layers.base import get_kind
from dattri_ds.store.format import (
    INFO_NAME, DuplicateSampleError, ShardIndex, ShardPaths, check_sizes, from_storage,
    list_shards, numpy_dtype, read_committed_ids, row_bytes, shard_paths, verify_chunk,
)
from dattri_ds.store.spec import StoreSpec, check_stored, load_manifest, mismatch_error

__all__ = ["GradientStore"]

Rows = slice | int | Sequence[int] | np.ndarray | torch.Tensor


@dataclass(eq=False)
class _Shard:
    """One shard's committed ids/meta and its memory map, with lazy per-commit verification."""

    paths: ShardPaths
    index: ShardIndex
    ids: list[str]
    meta: np.ndarray
    rows: np.memmap | None
    starts: np.ndarray = field(init=False)
    verified: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        sizes = np.array([c.rows for c in self.index.chunks], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.verified = np.zeros(len(sizes), dtype=bool)

    def verify(self, local: np.ndarray | None = None) -> None:
        """Check the data digests of the commits holding ``local`` rows (all when None)."""
        if self.rows is None:
            return
        chunks = (np.arange(len(self.starts)) if local is None else
                  np.unique(np.searchsorted(self.starts, local, side="right") - 1))
        for c in chunks[~self.verified[chunks]]:
            chunk = self.index.chunks[c]
            a = int(self.starts[c])
            verify_chunk(self.paths.data, int(c), self.rows[a:a + chunk.rows], chunk.data)
            self.verified[c] = True


class GradientStore:
    """Merged read-only view of a gradient store; use ``GradientStore.open``.

    Attributes:
        path: the store directory.
        spec: what the rows hold (layers and widths, projection, fingerprint).
        dtype: storage dtype name (``float32`` / ``float16`` / ``bfloat16``).
    """

    def __init__(self, path: Path, spec: StoreSpec, dtype: str, shards: list[_Shard],
                 duplicates: Literal["raise", "first"], verify: str) -> None:
        self.path, self.spec, self.dtype = path, spec, dtype
        self._shards = shards
        self._lazy = verify == "lazy"
        self._np_dtype = numpy_dtype(dtype)
        self._slices = spec.slices()
        #: Each layer's space, read from the manifest's tags once (``Space.parse``).
        self._spaces = {ls.name: Space.parse(ls.projection) for ls in spec.layers}
        ids = [i for sh in shards for i in sh.ids]
        shard_of = np.repeat(np.arange(len(shards), dtype=np.int32),
                             [len(sh.ids) for sh in shards])
        local = np.concatenate([np.arange(len(sh.ids), dtype=np.int64) for sh in shards] or
                               [np.zeros(0, dtype=np.int64)])
        meta = np.concatenate([sh.meta for sh in shards] or [np.zeros((0, 2), np.int64)])
        keep = self._dedupe(ids, shard_of, local, duplicates)
        if keep is not None:
            ids = [i for i, k in zip(ids, keep) if k]
            shard_of, local, meta = shard_of[keep], local[keep], meta[keep]
        self._ids = tuple(ids)
        self._pos = {sid: g for g, sid in enumerate(ids)}
        self._shard_of, self._local, self._meta = shard_of, local, meta

    @classmethod
    def open(cls, path: str | Path, *, expect: StoreSpec | None = None, dtype: str | None = None,
             verify: Literal["lazy", "eager", "off"] = "lazy",
             duplicates: Literal["raise", "first"] = "raise",
             origin: dict[str, str | None] | None = None,
             require_complete: bool = False,
             allow_missing_shards: bool = False) -> GradientStore:
        """Open every committed shard under ``path`` (uncommitted tails are ignored).

        Every shard the manifest's completion record lists, and every rank ``0..world-1``
        the shard indexes name, must be present: a missing shard, index or manifest is a
        StoreCorruptError naming the file, never a partial store.

        Args:
            path: the store directory (``StoreConfig.path``).
            expect: refuse the store unless it holds exactly this spec (None: accept any).
            dtype: refuse the store unless its rows are stored in this dtype (None: any).
            origin: refuse the store unless these provenance fields (``fingerprint``,
                ``run_id``, ``checkpoint``, ``weights_hash``; None values are not checked)
                equal the recorded ones.
            require_complete: refuse a store that was not sealed (``seal_store``): its
                collection was interrupted or is still running.
            allow_missing_shards: only to resume an interrupted or damaged collection (never
                to score): open the shards that are present (still verified) even when
                others, or all, are missing, so the resumed run recomputes their examples.
            verify: data checksums: ``lazy`` checks each commit the first time it is read,
                ``eager`` checks everything now, ``off`` never (ids/meta are always checked).
            duplicates: ``raise`` on an id stored in two shards, or keep the ``first`` copy.

        Raises:
            ConfigError: no store at ``path``, or an unknown option value.
            StoreMismatchError: ``expect``/``dtype``/``origin`` differ from the store (both
                sides shown), or a shard was written under another spec.
            StoreCorruptError: the manifest, a shard index or a shard file is missing,
                truncated or fails a checksum (path named), or the store holds no shard.
            DuplicateSampleError: an id is stored twice and ``duplicates="raise"``.
        """
        if verify not in ("lazy", "eager", "off") or duplicates not in ("raise", "first"):
            raise ConfigError(f"GradientStore.open: verify must be lazy/eager/off and duplicates "
                              f"raise/first, got verify={verify!r}, duplicates={duplicates!r}")
        root = Path(path)
        manifest = load_manifest(root, with_complete=True)
        if manifest is None:
            raise ConfigError(f"No gradient store at '{root}' (no info.json): write one with "
                              f"GradientStoreWriter or StoreCallback, or fix store.path")
        spec, stored_dtype, complete = manifest
        check_stored(spec, stored_dtype, path=str(root), expect=expect, dtype=dtype)
        lines = spec.origin_diff(origin or {})
        if lines:
            raise mismatch_error(str(root), lines, what="The requested run/checkpoint")
        if require_complete and complete is None:
            raise StoreCorruptError(
                f"Gradient store '{root}' is incomplete: its manifest '{root / INFO_NAME}' has "
                f"no completion record (the collection was interrupted or is still running). "
                f"Rerun the collection to finish it (it resumes where it stopped)")
        indexes = {p.rank: ShardIndex.load(p.index, p.rank) for p in list_shards(root)}
        if not allow_missing_shards:
            check_shard_set(root, {r: i.world for r, i in indexes.items()}, complete)
            for r, idx in indexes.items():
                _check_rows(shard_paths(root, r), idx, complete)
        shards = [_open_shard(shard_paths(root, r), idx, spec, stored_dtype)
                  for r, idx in indexes.items()]
        store = cls(root, spec, stored_dtype, shards, duplicates, verify)
        if verify == "eager":
            store.verify()
        return store

    def _dedupe(self, ids: list[str], shard_of: np.ndarray, local: np.ndarray,
                policy: str) -> np.ndarray | None:
        """Keep-mask dropping all but the first copy of each id (None when no duplicates)."""
        if len(set(ids)) == len(ids):
            return None
        first: dict[str, int] = {}
        keep = np.ones(len(ids), dtype=bool)
        dups = []
        for g, sid in enumerate(ids):
            if sid in first:
                keep[g] = False
                dups.append((sid, first[sid], g))
            else:
                first[sid] = g
        if policy == "raise":
            where = [f"{sid!r} in '{self._shards[shard_of[a]].paths.ids.name}' row {local[a]} and "
                     f"'{self._shards[shard_of[b]].paths.ids.name}' row {local[b]}"
                     for sid, a, b in dups[:3]]
            raise DuplicateSampleError(
                f"Gradient store '{self.path}' holds {len(dups)} duplicate sample id(s), e.g. "
                f"{'; '.join(where)}. Ranks stored the same example (a padding sampler such as "
                f"DistributedSampler, or a resume with another world size): open with "
                f"duplicates='first' to keep the first copy in rank order")
        return keep

    # -- metadata --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return (f"GradientStore('{self.path}', rows={len(self)}, width={self.width}, "
                f"dtype={self.dtype}, shards={len(self._shards)})")

    @property
    def ids(self) -> tuple[str, ...]:
        """``[N]`` sample ids in row order."""
        return self._ids

    @property
    def layers(self) -> tuple[str, ...]:
        """Layer names in column order."""
        return self.spec.names

    @property
    def width(self) -> int:
        """``P``: columns of a row."""
        return self.spec.width

    @property
    def steps(self) -> np.ndarray:
        """``[N]`` int64 optimizer step at which each example was captured."""
        return self._meta[:, 0]

    @property
    def token_counts(self) -> np.ndarray:
        """``[N]`` int64 loss-bearing tokens of each example (-1 when not recorded)."""
        return self._meta[:, 1]

    def index_of(self, sample_id: str) -> int:
        """Row of ``sample_id``; raises KeyError naming the store when absent."""
        try:
            return self._pos[sample_id]
        except KeyError:
            raise KeyError(f"Sample id {sample_id!r} is not in gradient store '{self.path}'"
                           ) from None

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._pos

    # -- reading ---------------------------------------------------------------------------

    def _rows(self, rows: Rows) -> np.ndarray:
        n = len(self)
        if isinstance(rows, slice):
            return np.arange(*rows.indices(n), dtype=np.int64)
        if isinstance(rows, torch.Tensor):
            rows = rows.detach().cpu().numpy()
        arr = np.asarray(rows)
        if arr.dtype == bool:
            raise IndexError("GradientStore rows must be row numbers, not a boolean mask: pass "
                             "np.flatnonzero(mask)")
        idx = arr.astype(np.int64).reshape(-1)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"Row index out of range for gradient store '{self.path}' of "
                             f"{n} rows: got min {idx.min()}, max {idx.max()}")
        return np.where(idx < 0, idx + n, idx)

    def read(self, rows: Rows, dtype: torch.dtype | None = torch.float32,
             copy: bool = True) -> torch.Tensor:
        """Rows ``[n, P]`` in ``dtype`` (None: the storage dtype).

        Args:
            rows: a slice, a sequence/array/1-D tensor of row numbers, or one int (``[1, P]``).
            copy: False allows a read-only tensor viewing the memory map when the rows are
                contiguous in one shard and no conversion is needed (streamed scoring).
        """
        idx = self._rows(rows)
        shard_of, local = self._shard_of[idx], self._local[idx]
        if idx.size and bool(np.all(shard_of == shard_of[0])) and _contiguous(local):
            view = self._shard_rows(int(shard_of[0]), local)  # one shard: no masks
            t = from_storage(np.array(view) if copy else view, self.dtype)
            return t if dtype is None else t.to(dtype)
        out = np.empty((idx.size, self.width), dtype=self._np_dtype)
        for s in np.unique(shard_of):
            sel = shard_of == s
            out[sel] = self._shard_rows(int(s), local[sel])
        t = from_storage(out, self.dtype)
        return t if dtype is None else t.to(dtype)

    def _shard_rows(self, s: int, loc: np.ndarray) -> np.ndarray:
        """Rows ``loc`` of shard ``s`` (a view of the memory map when contiguous), verified
        first when ``verify="lazy"``."""
        shard = self._shards[s]
        if shard.rows is None:
            raise ClosedError(f"Gradient store '{self.path}' was closed: read it before close()")
        if self._lazy:
            shard.verify(loc)
        lo = int(loc[0])
        return shard.rows[lo:lo + loc.size] if _contiguous(loc) else shard.rows[loc]

    def layer_view(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split rows ``[n, P]`` into layer name -> ``[n, P_l]`` views (no copy)."""
        return {name: values[:, sl] for name, sl in self._slices.items()}

    def iter_blocks(self, block_rows: int, dtype: torch.dtype | None = torch.float32
                    ) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
        """Stream ``(ids, rows [n, P])`` in row order, ``n <= block_rows``.

        Rows may be read-only views of the memory map (no copy): do not modify them in place.
        """
        if block_rows < 1:
            raise ConfigError(f"block_rows must be >= 1, got {block_rows}")
        for start in range(0, len(self), block_rows):
            stop = min(len(self), start + block_rows)
            yield self._ids[start:stop], self.read(slice(start, stop), dtype, copy=False)

    def to_gradbatch(self, rows: Rows, dtype: torch.dtype = torch.float32) -> GradBatch:
        """Rows as a GradBatch of Dense projected LayerGrads (``step=-1``: see ``steps``).

        The ops of ``dattri_ds.ops.inner`` (``cross_gram``, ``sq_norms``, ...) accept it
        directly, e.g. against a query batch projected with the same ProjectionConfig.
        """
        idx = self._rows(rows)
        values = self.read(idx, dtype)
        views = self.layer_view(values)
        layers = {ls.name: LayerGrad(name=ls.name, kind=get_kind(ls.kind),
                                     data=Dense(views[ls.name]), shape=ls.shape,
                                     space=self._spaces[ls.name])
                  for ls in self.spec.layers}
        counts = torch.from_numpy(self._meta[idx, 1])
        return GradBatch(step=-1, sample_ids=tuple(self._ids[i] for i in idx), layers=layers,
                         token_counts=counts)

    def iter_batches(self, block_rows: int, dtype: torch.dtype = torch.float32
                     ) -> Iterator[GradBatch]:
        """Stream the store as GradBatches of at most ``block_rows`` examples."""
        if block_rows < 1:
            raise ConfigError(f"block_rows must be >= 1, got {block_rows}")
        for start in range(0, len(self), block_rows):
            yield self.to_gradbatch(slice(start, min(len(self), start + block_rows)), dtype)

    def verify(self) -> None:
        """Check every data checksum now (reads the whole store once).

        Raises:
            StoreCorruptError: naming the first damaged shard file.
        """
        for shard in self._shards:
            shard.verify()

    def close(self) -> None:
        """Drop the memory maps (reads afterwards raise)."""
        for shard in self._shards:
            shard.rows = None

    def __enter__(self) -> GradientStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _contiguous(loc: np.ndarray) -> bool:
    return int(loc[-1]) - int(loc[0]) + 1 == loc.size and bool(np.all(np.diff(loc) == 1))


def check_shard_set(root: Path, worlds: dict[int, int],
                    complete: dict[str, dict[int, int]] | None) -> None:
    """Raise StoreCorruptError naming a missing shard index: the shards present must equal
    the completion record when there is one (a rank that stored nothing has no shard), else
    cover ranks ``0..world-1`` of every index.
    """
    if not worlds:
        raise StoreCorruptError(
            f"Gradient store '{root}' holds no committed shard (no shard-*.index.json; "
            f"'{shard_paths(root, 0).index.name}' is missing): nothing was stored, or the "
            f"shard files were deleted. Collect the store again")
    want = set(range(max(worlds.values()))) if complete is None else set(complete["rows"])
    if complete is not None:
        extra = sorted(set(worlds) - set(complete["rows"]))
        if extra:
            raise StoreCorruptError(
                f"Shard index '{shard_paths(root, extra[0]).index}' is not among the shards "
                f"{sorted(complete['rows'])} the manifest '{root / INFO_NAME}' recorded when "
                f"the store was completed: it was copied in from elsewhere; delete it")
    missing = sorted(want - set(worlds))
    if missing:
        raise StoreCorruptError(
            f"Shard index '{shard_paths(root, missing[0]).index}' is missing (shards "
            f"{missing} of the store '{root}' are absent; "
            f"{'the manifest lists them' if complete else 'the shard indexes name ranks up to'}"
            f" {sorted(want)[-1]}): it was deleted. Restore it, or rerun the collection to recompute "
            f"that shard")


def _check_rows(paths: ShardPaths, index: ShardIndex,
                complete: dict[str, dict[int, int]] | None) -> None:
    if complete is None:
        return
    want = complete["rows"].get(paths.rank)
    if want is not None and want != index.rows:
        raise StoreCorruptError(
            f"Shard index '{paths.index}' commits {index.rows} rows but the manifest recorded "
            f"{want} when the store was completed: the index was replaced or damaged; restore "
            f"it, or delete the shard-{paths.rank:05d}.* files and rerun the collection")


def _open_shard(paths: ShardPaths, index: ShardIndex, spec: StoreSpec, dtype: str) -> _Shard:
    digest = spec.digest(dtype)
    if index.spec_digest != digest:
        raise mismatch_error(str(paths.index.parent), [
            f"shard index '{paths.index}' was written with spec digest {index.spec_digest}, "
            f"the manifest (info.json, intact) describes {digest}: the shard belongs to "
            f"another store or configuration; fix: delete the shard-{paths.rank:05d}.* files "
            f"and rerun the collection for that shard"], what="A shard")
    check_sizes(paths, index, row_bytes(spec.width, dtype))
    ids, meta = read_committed_ids(paths, index)
    rows = (np.memmap(paths.data, dtype=numpy_dtype(dtype), mode="r",
                      shape=(index.rows, spec.width)) if index.rows else None)
    return _Shard(paths, index, ids, meta, rows)
