"""GradientStoreWriter: append projected GradBatches to this rank's shard, crash-safely.

Rows are buffered and committed every ``StoreConfig.flush_every`` rows (store/shard.py),
on a background thread with ``async_write``; a writer still open at interpreter exit
commits then (``atexit``, with a warning), and a failed write is one ``WriteError`` naming
the file and the committed rows that stay safe. A sample id already stored in any shard, or
already appended, is skipped silently (cross-shard duplicates: ``GradientStore.open``)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dattri_ds.errors import CaptureError, ConfigError
from dattri_ds.gradient import GradBatch
from dattri_ds.io.outputs import check_dir, writing
from dattri_ds.store.config import StoreConfig
from dattri_ds.store.format import (
    META_COLUMNS, ShardIndex, StoreCorruptError, list_shards, row_bytes, save_info, shard_paths,
    to_storage, torch_dtype,
)
from dattri_ds.store.shard import ShardAppender, other_shard_ids
from dattri_ds.store.spec import StoreSpec, check_stored, load_manifest

__all__ = ["GradientStoreWriter", "seal_store"]

logger = logging.getLogger(__name__)

#: One appended piece: rows ``[n, P]`` (CPU, storage dtype), their ids, meta ``[n, 2]``.
_Rows = tuple[torch.Tensor, list[str], np.ndarray]


class _Background:
    """One worker thread running submitted jobs in order; the first error is kept and
    re-raised to the caller (later jobs are dropped, so the queue never blocks forever)."""

    def __init__(self, max_queue: int, name: str) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_queue)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    job()
            except BaseException as e:  # noqa: BLE001 - handed to the caller thread
                self._error = e
            finally:
                self._queue.task_done()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, job: Callable[[], None]) -> None:
        self.raise_if_failed()
        self._queue.put(job)

    def wait(self) -> None:
        self._queue.join()
        self.raise_if_failed()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class GradientStoreWriter:
    """Appends projected per-example gradients of one data-parallel rank to its shard.

    Example::

        spec = StoreSpec.from_batch(batch, projection=proj_cfg, fingerprint="ckpt-1000")
        with GradientStoreWriter(StoreConfig(path="grads/"), spec, rank=r, world=w) as w:
            w.append(batch)
    """

    def __init__(self, config: StoreConfig, spec: StoreSpec, *, rank: int = 0,
                 world: int = 1) -> None:
        """Open or create the store at ``config.path`` and this rank's shard, resuming it.

        Raises:
            ConfigError: ``rank`` is not in ``[0, world)``.
            StoreMismatchError: the store holds another spec or dtype (both sides shown).
            StoreCorruptError: this shard's committed files are truncated or damaged.
        """
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"Store writer needs 0 <= rank < world, got rank {rank}, "
                              f"world {world}")
        self.config, self.spec, self.rank, self.world = config, spec, rank, world
        self.path = check_dir(config.path, flag="store.path")
        stored = load_manifest(self.path, with_complete=True)
        if stored is None:  # first writer; re-read in case another rank raced us
            with writing(self.path / "info.json", committed=self._kept(0)):
                save_info(self.path, spec.to_json(), config.dtype, config.fsync)
            stored = load_manifest(self.path, with_complete=True) or (spec, config.dtype, None)
        check_stored(*stored[:2], path=str(self.path), expect=spec, dtype=config.dtype)
        self._stored_spec = stored[0]
        self._sealed = stored[2] is not None  # the first commit unseals (see seal_store)
        self._seen = set(other_shard_ids(self.path, rank, row_bytes(spec.width, config.dtype)))
        self._shard = ShardAppender(
            shard_paths(self.path, rank), world=world, spec_digest=spec.digest(config.dtype),
            row_nbytes=row_bytes(spec.width, config.dtype), fsync=config.fsync)
        self._seen.update(self._shard.ids)
        if rank == 0 and self._seen:
            logger.info("Resuming gradient store '%s': %d examples already stored",
                        self.path, len(self._seen))
        self._tdtype = torch_dtype(config.dtype)
        self._pending: list[_Rows] = []
        self._pending_rows = 0
        self._bg = (_Background(config.max_queue, f"dattri_ds-store-{rank}")
                    if config.async_write else None)
        self._closed = False
        self._failed = False
        _OPEN.add(self)

    # -- queries ---------------------------------------------------------------------------

    def has(self, sample_id: str) -> bool:
        """Whether ``sample_id`` is stored or pending (in any shard as of opening, or here)."""
        return sample_id in self._seen

    @property
    def committed_rows(self) -> int:
        """Rows of this shard that are durably committed."""
        return self._shard.rows

    # -- writing ---------------------------------------------------------------------------

    def append(self, batch: GradBatch) -> int:
        """Queue the batch's new examples for storage; returns how many were new.

        Args:
            batch: every layer Dense ``[B, P_l]`` and projected, with exactly the spec's layers.

        Raises:
            ConfigError: a layer is not projected Dense (set capture.projection), or an id
                contains a newline.
            StoreMismatchError: the batch's layers/widths/projection differ from the spec.
            CaptureError: a value is NaN/inf, or overflows float16 storage.
            Exception: an error raised earlier by the background writer thread.
        """
        self._check_open()
        if self._bg is not None:
            self._bg.raise_if_failed()
        self.spec.check_batch(batch, str(self.path))
        keep, ids, fresh = [], [], set()
        for b, sid in enumerate(batch.sample_ids):
            if "\n" in sid:
                raise ConfigError(f"Sample id {sid!r} contains a newline, which the store's "
                                  f"ids file cannot hold; use ids without line breaks")
            if sid not in self._seen and sid not in fresh:
                keep.append(b)
                ids.append(sid)
                fresh.add(sid)
        if not keep:
            return 0
        rows, counts = self._host_rows(batch, keep)
        meta = np.full((len(keep), META_COLUMNS), -1, dtype=np.int64)
        meta[:, 0] = batch.step
        if counts is not None:
            meta[:, 1] = counts.numpy()
        item: _Rows = (rows, ids, meta)
        if self._bg is not None:
            self._bg.submit(lambda: self._write(item))
        else:
            self._write(item)
        self._seen.update(ids)
        return len(keep)

    def _host_rows(self, batch: GradBatch,
                   keep: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[n, P]`` new CPU tensor in the storage dtype (a copy: the caller may reuse
        buffers) and the kept examples' int64 token counts (None without counts).

        Every layer's rows and the token counts (as a float32 column: exact below 2^24)
        come to the host in one copy: one host sync per batch, not one per layer."""
        parts = [batch.layers[ls.name].data.values.detach() for ls in self.spec.layers]
        dev = parts[0].device
        counts = batch.token_counts
        if counts is not None:
            parts.append(counts.detach().to(device=dev, dtype=torch.float32)[:, None])
        host = torch.cat([p.to(device=dev, dtype=torch.float32) for p in parts], dim=1).cpu()
        if len(keep) < host.shape[0]:
            host = host[torch.tensor(keep)]
        if counts is not None:
            host, counts = host[:, :-1], host[:, -1].to(torch.int64)
        rows = host.to(self._tdtype)
        if not bool(torch.isfinite(rows).all()):
            self._raise_nonfinite(batch, keep)
        return rows, counts

    def _raise_nonfinite(self, batch: GradBatch, keep: list[int]) -> None:
        for ls in self.spec.layers:
            v = batch.layers[ls.name].data.values.detach()[keep]
            if not bool(torch.isfinite(v).all()):
                raise CaptureError(
                    f"Layer '{ls.name}' has NaN/inf gradients at step {batch.step}; refusing to "
                    f"store them: set capture.on_nonfinite='skip' to drop such examples")
        raise CaptureError(
            f"Gradients at step {batch.step} overflow store.dtype='{self.config.dtype}' "
            f"(largest float16 is 65504): set store.dtype='bfloat16' or 'float32'")

    def _write(self, item: _Rows) -> None:
        """Buffer one piece; commit once ``flush_every`` rows are buffered (worker side)."""
        self._pending.append(item)
        self._pending_rows += item[0].shape[0]
        if self._pending_rows >= self.config.flush_every:
            self._commit()

    @property
    def closed(self) -> bool:
        """``close()`` was called (no more appends)."""
        return self._closed

    @property
    def pending_rows(self) -> int:
        """Rows appended but not committed yet (buffered here or queued)."""
        return self._pending_rows

    def _kept(self, rows: int) -> str:
        return (f"nothing committed was lost: {self.path} keeps its {rows} committed rows of "
                f"rank {self.rank} (the commit protocol never rewrites them). Fix: free space "
                f"(or raise the limit), then rerun the same command: it resumes after them")

    def _commit(self) -> None:
        if not self._pending:
            return
        pending, self._pending, self._pending_rows = self._pending, [], 0
        data = np.concatenate([to_storage(r, self.config.dtype) for r, _, _ in pending])
        ids = [i for _, piece, _ in pending for i in piece]
        meta = np.concatenate([m for _, _, m in pending])
        need = data.nbytes + meta.nbytes + sum(len(i) + 1 for i in ids)
        try:
            with writing(self._shard.paths.data, nbytes=need,
                         committed=self._kept(self._shard.rows)):
                if self._sealed:  # appending to a complete store: incomplete until sealed
                    save_info(self.path, self._stored_spec.to_json(), self.config.dtype,
                              self.config.fsync)
                    self._sealed = False
                self._shard.commit(data, ids, meta)
        except BaseException:
            self._failed = True
            raise

    def flush(self) -> None:
        """Commit every buffered row now (waits for the background thread)."""
        self._check_open()
        if self._bg is not None:
            self._bg.submit(self._commit)
            self._bg.wait()
        else:
            self._commit()

    def close(self) -> None:
        """Commit what is buffered and release the files; idempotent.

        Raises:
            Exception: an error of the background thread (the files are released anyway).
        """
        if self._closed:
            return
        try:
            if not self._failed:
                self.flush()
            elif self._bg is not None:  # the thread's error, once more, to the caller
                self._bg.raise_if_failed()
        finally:
            self._closed = True
            _OPEN.discard(self)
            if self._bg is not None:
                self._bg.stop()
            self._release()

    def _release(self) -> None:
        """Close the shard's files; after a failed write their buffers cannot be flushed
        (the uncommitted tail is cut when the shard is reopened), so that is not an error."""
        try:
            self._shard.close()
        except OSError:
            if not self._failed:
                raise

    def _check_open(self) -> None:
        if self._closed:
            raise CaptureError(f"GradientStoreWriter for '{self.path}' (rank {self.rank}) is "
                               f"closed; open a new writer to resume appending")

    def __enter__(self) -> GradientStoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Writers not closed yet: committed at interpreter exit (``_commit_at_exit``).
_OPEN: weakref.WeakSet[GradientStoreWriter] = weakref.WeakSet()


@atexit.register
def _commit_at_exit() -> None:
    """Commit the buffered rows of every writer still open when the interpreter exits (a
    capture detached without ``close()``, a script that never closed its writer), warning
    with the store and the count; a writer whose write failed is only released."""
    for w in list(_OPEN):
        if w._closed:
            continue
        if w._failed:  # its error was raised already; the files only need releasing
            with contextlib.suppress(Exception):
                w.close()
            continue
        queued = w._bg is not None and w._bg._queue.unfinished_tasks > 0
        n = w.pending_rows
        try:
            w.close()
        except Exception as e:  # noqa: BLE001 - at exit: say what was not committed
            warnings.warn(f"gradient store '{w.path}' (rank {w.rank}): {n} buffered rows "
                          f"could not be committed at exit: {e}", RuntimeWarning, stacklevel=1)
            continue
        if (n or queued) and not w._failed:
            warnings.warn(f"gradient store '{w.path}' (rank {w.rank}): the writer was not "
                          f"closed; its {n} buffered rows were committed at interpreter exit "
                          f"(close() the writer, or the GradientCapture, to commit them "
                          f"yourself)", RuntimeWarning, stacklevel=1)


def seal_store(path: str | Path, fsync: bool = True) -> dict[int, int]:
    """Record in the manifest that the store is complete: its shards and their row counts.

    Call it once every writer of the store has closed (after a barrier, from one rank):
    the shards present then are the store (a rank that stored nothing has none). Readers
    then refuse the store when a shard, its index or any committed row is missing; a writer
    appending later clears the record until the store is sealed again.

    Returns:
        Shard number -> committed rows.

    Raises:
        StoreCorruptError: no store at ``path``, or its manifest or an index is damaged.
    """
    root = Path(path)
    stored = load_manifest(root)
    if stored is None:
        raise StoreCorruptError(f"Cannot seal '{root}': it holds no gradient store (no info.json)")
    spec, dtype = stored
    counts = {p.rank: ShardIndex.load(p.index, p.rank).rows for p in list_shards(root)}
    save_info(root, spec.to_json(), dtype, fsync, complete={"rows": counts})
    return counts
