"""Writing a checkpoint all or nothing: a temporary folder, fsynced, renamed, then listed.

Every backend writes its files (and the loop its per-rank state) into
``checkpoints/<tag>.tmp``; once every rank is done, rank 0 fsyncs the folder, renames it to
``checkpoints/<tag>`` and points ``checkpoints/latest`` at it, and only then does the run
list the tag (``trajectory.json``, ``summary.json``: launch/runlog.py). A write that fails
(no space, a file size limit, permission) is one line naming the file, the cause and the
fix, and leaves no partial folder; a temporary folder a killed run left is removed by the
next save. docs/training.md ("Checkpoints").
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from dattri_ds.distributed import all_gather_object
from dattri_ds.errors import DattriDSError, WriteError
from dattri_ds.io.outputs import write_atomic, write_error, write_failure

__all__ = ["TMP", "write_checkpoint", "held_write_failures"]

#: Suffix of a checkpoint folder being written (``checkpoints/<tag>.tmp``).
TMP = ".tmp"


def write_checkpoint(ckpt_dir: Path, tag: str, rank: int, write: Callable[[Path], None],
                     complete: list[str]) -> None:
    """Write checkpoint ``tag`` all or nothing (collective): every rank calls
    ``write(folder)`` on ``checkpoints/<tag>.tmp`` (temporaries of earlier saves removed
    first); then rank 0 fsyncs it, renames it to ``checkpoints/<tag>`` and points
    ``checkpoints/latest`` at it. The caller lists the tag (trajectory.json, summary.json)
    only after this returns.

    Each stage (rank 0 preparing the folder, every rank writing, rank 0 committing) ends in
    an agreement over the ranks instead of a bare barrier (:func:`_agree`), so a failure on
    one rank reaches every rank there: none waits for a peer that has given up.

    Raises:
        WriteError: a rank's write failed (no space, a file size limit, permission): on every
            rank the same line, naming the file, the cause and the fix (the temporary folder
            is removed; ``complete``, the run's complete checkpoints, are named).
        Exception: another error of this rank's write, as raised (its peers raise a
            DattriDSError naming the rank and the error).
    """
    tmp, final = ckpt_dir / f"{tag}{TMP}", ckpt_dir / tag

    def failed(err: Exception) -> WriteError | None:
        """The one-line error of a failed write (None: ``err`` is another error)."""
        cause = write_failure(err, tmp)
        if cause is None:
            return None
        target = cause.filename or _newest(tmp)
        how = {errno.EFBIG: "raise the file size limit (ulimit -f)", errno.ENOSPC:
               "free space", errno.EDQUOT: "free space"}.get(cause.errno,
                                                              f"make {ckpt_dir} writable")
        return write_error(cause, target, committed=(
            f"checkpoint {tag} is not listed (trajectory.json, summary.json, latest) and its "
            f"partial files are removed; the complete checkpoints are {complete or 'none'}. "
            f"Fix: {how}, then rerun the same command with --resume latest"))

    def clean() -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    _agree(lambda: _fresh(ckpt_dir, tmp) if rank == 0 else None, failed, clean, tag)
    _agree(lambda: write(tmp), failed, clean, tag)
    _agree(lambda: _publish(tmp, final) if rank == 0 else None, failed,
           lambda: (clean(), rank == 0 and shutil.rmtree(final, ignore_errors=True)), tag)


@contextlib.contextmanager
def held_write_failures(owner: object, name: str = "save") -> Iterator[None]:
    """Inside the block, a failed write by ``owner.<name>(state, path)`` is held, not raised;
    the first is raised when the block ends.

    For a save that runs collectives after its writes (DeepSpeed's ``save_checkpoint``
    writes each rank's files, then waits at a barrier): the rank whose write failed goes on
    through those collectives with its peers, and :func:`write_checkpoint`'s agreement then
    tells every rank. Errors other than a failed write are raised at once.
    """
    write = getattr(owner, name)
    own = name in vars(owner)
    held: list[OSError] = []

    def guarded(*args, **kwargs):
        path = kwargs.get("path", args[1] if len(args) > 1 else "")
        try:
            return write(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - anything but a failed write is re-raised
            cause = write_failure(err, path)
            if cause is None:
                raise
            held.append(OSError(cause.errno, cause.strerror, str(cause.filename or path)))

    setattr(owner, name, guarded)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, write)
        else:
            delattr(owner, name)
    if held:
        raise held[0]


def _publish(tmp: Path, final: Path) -> None:
    """``tmp`` renamed to ``final`` (:func:`_commit`), then ``latest`` names it."""
    _commit(tmp, final)
    write_atomic(final.parent / "latest", final.name)


def _fresh(ckpt_dir: Path, tmp: Path) -> None:
    """``tmp`` empty, every temporary of an earlier save under ``ckpt_dir`` removed."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for old in ckpt_dir.glob(f"*{TMP}"):
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    tmp.mkdir()


def _agree(stage: Callable[[], None], failed: Callable[[Exception], WriteError | None],
           clean: Callable[[], None], tag: str) -> None:
    """Run this rank's part of a save stage, then learn every rank's outcome (collective,
    in place of a barrier): when a rank failed, every rank cleans up and raises.

    The lowest failing rank's line is raised everywhere: as a WriteError for a failed write
    (``failed`` gives its line), else that rank re-raises its own error and the others
    raise a DattriDSError naming it.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    me = dist.get_rank() if world > 1 else 0
    mine: Exception | None = None
    outcome = None  # (rank, line, whether a write failed, its errno)
    try:
        stage()
    except Exception as err:  # noqa: BLE001 - every rank learns of it below
        mine, wrote = err, failed(err)
        outcome = (me, str(wrote), True, wrote.errno) if wrote is not None else (
            me, f"{type(err).__name__}: {' '.join(str(err).split())}", False, None)
    first = next((o for o in all_gather_object(outcome, world=world) if o is not None), None)
    if first is None:
        return
    clean()
    rank, line, was_write, code = first
    if was_write:
        out = WriteError(line)
        out.errno = code
        raise out from None
    if rank == me:
        raise mine
    raise DattriDSError(f"saving checkpoint {tag} failed on rank {rank}: {line}")


def _newest(folder: Path) -> Path:
    """The file written last under ``folder`` (the one a failed write left partial)."""
    found = [p for p in folder.rglob("*") if p.is_file()]
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.stat().st_size)) if found \
        else folder


def _commit(tmp: Path, final: Path) -> None:
    """fsync every file and folder of ``tmp``, then rename it to ``final`` (an earlier
    ``final``, e.g. of a run started over with --force, moved aside and removed)."""
    for p in sorted(tmp.rglob("*"), key=lambda p: -len(p.parts)) + [tmp]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    aside = final.with_name(final.name + ".old" + TMP)
    if final.exists():
        final.rename(aside)
    tmp.rename(final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(aside, ignore_errors=True)
