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

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from dattri_ds.io.outputs import write_atomic, write_error, write_failure

__all__ = ["TMP", "write_checkpoint"]

#: Suffix of a checkpoint folder being written (``checkpoints/<tag>.tmp``).
TMP = ".tmp"


def write_checkpoint(ckpt_dir: Path, tag: str, rank: int, write: Callable[[Path], None],
                     complete: list[str]) -> None:
    """Write checkpoint ``tag`` all or nothing (collective): every rank calls
    ``write(folder)`` on ``checkpoints/<tag>.tmp`` (temporaries of earlier saves removed
    first); then rank 0 fsyncs it, renames it to ``checkpoints/<tag>`` and points
    ``checkpoints/latest`` at it. The caller lists the tag (trajectory.json, summary.json)
    only after this returns.

    Raises:
        WriteError: this rank's write failed (no space, a file size limit, permission): one
            line naming the file, the cause and the fix (the temporary folder is removed;
            ``complete``, the run's complete checkpoints, are named).
    """
    tmp = ckpt_dir / f"{tag}{TMP}"
    try:
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            for old in ckpt_dir.glob(f"*{TMP}"):
                if old.is_dir():
                    shutil.rmtree(old)
                else:
                    old.unlink()
            tmp.mkdir()
        _barrier()
        write(tmp)
    except Exception as err:  # noqa: BLE001 - anything but a failed write is re-raised
        cause = write_failure(err, tmp)
        if cause is None:
            raise
        target = cause.filename or _newest(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        fix = {errno.EFBIG: "raise the file size limit (ulimit -f)", errno.ENOSPC:
               "free space", errno.EDQUOT: "free space"}.get(cause.errno, f"make {ckpt_dir} "
                                                                           f"writable")
        raise write_error(cause, target, committed=(
            f"checkpoint {tag} is not listed (trajectory.json, summary.json, latest) and its "
            f"partial files are removed; the complete checkpoints are {complete or 'none'}. "
            f"Fix: {fix}, then rerun the same command with --resume latest")) from None
    _barrier()
    if rank == 0:
        _commit(tmp, ckpt_dir / tag)
        write_atomic(ckpt_dir / "latest", tag)
    _barrier()


def _barrier() -> None:
    """Every rank reached this point (nothing to wait for without a process group)."""
    if dist.is_initialized():
        dist.barrier()


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
