"""ShardAppender: crash-safe appends to one rank's shard: append rows, ids and meta, fsync
them, then replace the index atomically (docs/store.md, "On-disk layout"); ``open``
truncates a torn tail. ``rollback_to_step`` drops the committed rows captured at or after a
training step (an elastic resume) by committing a shorter index under the shard's lock."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # not POSIX: no protection against two writers of one shard
    fcntl = None  # type: ignore[assignment]

import numpy as np

from dattri_ds.errors import ConfigError
from dattri_ds.io.outputs import write_json_atomic
from dattri_ds.store.format import (
    META_COLUMNS, Chunk, ShardIndex, ShardPaths, StoreCorruptError, check_sizes, digest,
    list_shards, read_committed_ids, row_bytes, save_info, verify_data,
)
from dattri_ds.store.spec import mismatch_error

__all__ = ["ShardAppender", "rollback_to_step"]

logger = logging.getLogger(__name__)


class ShardAppender:
    """Owns the files of one shard for appending; one writer per shard at a time."""

    def __init__(self, paths: ShardPaths, *, world: int, spec_digest: str, row_nbytes: int,
                 fsync: bool = True) -> None:
        """Open (or create) the shard, truncating any uncommitted tail.

        Raises:
            ConfigError: another live writer holds this shard (two processes with one rank).
            StoreCorruptError: a committed file is shorter than its index, or a checksum of
                the committed data/ids/meta fails (the file is named): resuming never keeps
                damaged rows.
            StoreMismatchError: the shard was written under another spec/dtype.
        """
        self.paths = paths
        self.row_nbytes = row_nbytes
        self.fsync = fsync
        self._files: list[IO[bytes]] = []
        self._lock = _acquire(paths)
        try:
            self._recover(world, spec_digest)
        except BaseException:
            self._lock.close()
            raise
        self._files = [open(p, "ab") for p in (paths.data, paths.ids, paths.meta)]
        self._failed: BaseException | None = None

    def _recover(self, world: int, spec_digest: str) -> None:
        """Load the committed index (or start one) and truncate the uncommitted tail."""
        paths = self.paths
        if paths.index.exists():
            self.index = ShardIndex.load(paths.index, paths.rank)
            if self.index.spec_digest != spec_digest:
                raise mismatch_error(str(paths.index.parent), [
                    f"shard '{paths.index.name}' was written with spec digest "
                    f"{self.index.spec_digest}, this writer has {spec_digest} (info.json was "
                    f"replaced after the shard was written); fix: delete the shard-"
                    f"{paths.rank:05d}.* files or point store.path at a new directory"])
            check_sizes(paths, self.index, self.row_nbytes)
            self.ids, _ = read_committed_ids(paths, self.index)
            verify_data(paths, self.index, self.row_nbytes)
        else:
            self.index = ShardIndex(rank=paths.rank, world=world, spec_digest=spec_digest)
            self.ids = []
        self.index.world = world
        self._truncate_tail()

    def _truncate_tail(self) -> None:
        """Cut every file back to its committed size (creating missing files)."""
        sizes = {self.paths.data: self.index.rows * self.row_nbytes,
                 self.paths.ids: self.index.ids_bytes,
                 self.paths.meta: self.index.rows * META_COLUMNS * 8}
        cut = 0
        for path, size in sizes.items():
            with open(path, "ab") as f:
                extra = f.tell() - size
                if extra > 0:
                    f.truncate(size)
                    cut += extra
                    if self.fsync:
                        os.fsync(f.fileno())
        if cut:
            logger.info("Shard '%s': dropped %d uncommitted bytes after %d committed rows",
                        self.paths.index, cut, self.index.rows)

    @property
    def rows(self) -> int:
        return self.index.rows

    def commit(self, data: np.ndarray, ids: list[str], meta: np.ndarray) -> None:
        """Append ``data [n, P]``, ``ids`` (n) and ``meta [n, 2]`` int64, then commit them."""
        n = data.shape[0]
        if n == 0:
            return
        id_buf = "".join(f"{i}\n" for i in ids).encode("utf-8")
        data = np.ascontiguousarray(data)
        meta = np.ascontiguousarray(meta, dtype="<i8")
        if data.nbytes != n * self.row_nbytes or len(ids) != n or meta.shape != (n, META_COLUMNS):
            raise StoreCorruptError(f"Internal error: inconsistent commit of {n} rows to "
                                    f"'{self.paths.data}'")
        if self._failed is not None:
            raise StoreCorruptError(f"Shard '{self.paths.index}' is unusable after a failed "
                                    f"commit ({self._failed!r}); reopen the store to resume "
                                    f"from its last commit") from self._failed
        try:
            for f, buf in zip(self._files, (data, id_buf, meta)):
                f.write(memoryview(buf).cast("B"))
            for f in self._files:
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            old = self.index
            chunk = Chunk(n, len(id_buf), digest(data), digest(id_buf), digest(meta))
            new = ShardIndex(rank=old.rank, world=old.world, spec_digest=old.spec_digest,
                             rows=old.rows + n, ids_bytes=old.ids_bytes + len(id_buf),
                             chunks=[*old.chunks, chunk])
            write_json_atomic(self.paths.index, new.to_json(), self.fsync)
        except BaseException as e:  # the files now hold an uncommitted tail: stop appending
            self._failed = e
            raise
        self.index = new
        self.ids.extend(ids)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []
        self._lock.close()


def _acquire(paths: ShardPaths) -> IO[bytes]:
    """Hold an exclusive flock on the shard's lock file (the OS drops it if the process dies)."""
    f = open(paths.lock, "ab")
    if fcntl is None:
        return f
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ConfigError(
            f"Shard '{paths.data}' is already open by another writer: two processes were given "
            f"rank {paths.rank}, or an earlier writer of this process was not closed. Give each "
            f"data-parallel rank its own rank, or close() the other writer") from None
    except OSError:  # file system without flock support: proceed unprotected
        pass
    return f


def other_shard_ids(root: Path, rank: int, row_nbytes: int) -> list[str]:
    """Committed ids of every other shard in ``root`` (a snapshot; used to skip on resume),
    after checking their data, ids and meta checksums: an example is skipped only when its
    stored row is intact."""
    out: list[str] = []
    for paths in list_shards(root):
        if paths.rank == rank:
            continue
        index = ShardIndex.load(paths.index, paths.rank)
        check_sizes(paths, index, row_nbytes)
        ids, _ = read_committed_ids(paths, index)
        verify_data(paths, index, row_nbytes)
        out.extend(ids)
    return out


def rollback_to_step(root: str | Path, step: int, fsync: bool = True) -> dict[int, int]:
    """Drop every committed row of ``root`` captured at training step ``step`` or later.

    Each shard's rows are in step order (a training run captures step after step), so the
    rows kept are a prefix: the new index keeps the commits before the cut whole and the
    cut commit's first rows (their digests recomputed); the bytes after it become an
    uncommitted tail, cut when a writer next opens the shard. Each shard is edited under
    its lock (no live writer); a sealed store is unsealed (its row counts changed).

    Returns:
        Shard number -> rows dropped (shards that lost none are left out).

    Raises:
        ConfigError: a live writer holds a shard.
        StoreCorruptError: a shard is damaged, or its rows are not in step order (it was
            not written by one training run; nothing is dropped from it).
    """
    from dattri_ds.store.spec import load_manifest

    root = Path(root)
    stored = load_manifest(root, with_complete=True)
    if stored is None:
        return {}
    spec, dtype, complete = stored
    nbytes = row_bytes(spec.width, dtype)
    dropped: dict[int, int] = {}
    for paths in list_shards(root):
        lock = _acquire(paths)
        try:
            index = ShardIndex.load(paths.index, paths.rank)
            check_sizes(paths, index, nbytes)
            ids, meta = read_committed_ids(paths, index)
            late = meta[:, 0] >= step
            if not late.any():
                continue
            cut = int(np.argmax(late))
            if not late[cut:].all():
                raise StoreCorruptError(
                    f"Shard '{paths.index}' holds rows of step >= {step} before rows of "
                    f"earlier steps (row {cut}): it was not written by one training run, so "
                    f"its rows after step {step} cannot be told apart; move the store away "
                    f"(store.path) and resume into a new one")
            write_json_atomic(paths.index, _prefix(paths, index, cut, nbytes, ids, meta)
                              .to_json(), fsync)
            dropped[paths.rank] = index.rows - cut
        finally:
            lock.close()
    if dropped and complete is not None:
        save_info(root, spec.to_json(), dtype, fsync)
    return dropped


def _prefix(paths: ShardPaths, index: ShardIndex, cut: int, nbytes: int, ids: list[str],
            meta: np.ndarray) -> ShardIndex:
    """The index of the first ``cut`` committed rows of a shard."""
    chunks, start, id_bytes = [], 0, 0
    for c in index.chunks:
        if start + c.rows <= cut:
            chunks.append(c)
            id_bytes += c.id_bytes
        elif start < cut:  # the commit the cut falls in: its first rows, digests recomputed
            k = cut - start
            with open(paths.data, "rb") as f:
                f.seek(start * nbytes)
                data = f.read(k * nbytes)
            id_buf = "".join(f"{i}\n" for i in ids[start:cut]).encode("utf-8")
            part = np.ascontiguousarray(meta[start:cut], dtype="<i8")
            chunks.append(Chunk(k, len(id_buf), digest(data), digest(id_buf), digest(part)))
            id_bytes += len(id_buf)
        start += c.rows
    return ShardIndex(rank=index.rank, world=index.world, spec_digest=index.spec_digest,
                      rows=cut, ids_bytes=id_bytes, chunks=chunks)
