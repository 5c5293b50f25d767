"""The output door: every path a tool or launch writes is checked once, at start, here.

``check_dir`` / ``check_file`` run before any work and raise one
:class:`~dattri_ds.errors.OutputError` (exit 2) naming the path, the flag and the fix;
``writing`` turns an ``OSError`` raised while writing into one
:class:`~dattri_ds.errors.WriteError` (exit 1) naming the path, the bytes and what stays
committed. What is checked: docs/outputs_and_memory.md ("Output paths").
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dattri_ds.errors import DattriDSError, OutputError, WriteError

__all__ = ["check_dir", "check_file", "writing", "write_error", "reason", "human_bytes",
           "fsync_dir", "write_json_atomic"]

#: errno -> what a user reads (instead of the exception class and strerror).
_REASONS = {
    errno.ENOSPC: "the disk is full (no space left on device)",
    errno.EFBIG: "the file size limit was reached (file too large: ulimit -f, or the file "
                 "system's largest file)",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted there",
    errno.EROFS: "the file system is read-only",
    errno.ENOENT: "a folder on the way does not exist and cannot be created there",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "it is a folder, not a file",
    errno.ELOOP: "the path has a symbolic link loop",
    errno.ENAMETOOLONG: "the name is too long",
}


def reason(err: OSError) -> str:
    """Why an OS call failed, in words (no exception class)."""
    if err.errno in _REASONS:
        return _REASONS[err.errno]
    return (os.strerror(err.errno) if err.errno else str(err) or "it failed").lower()


def human_bytes(n: float) -> str:
    """``n`` bytes as ``12.3 MB`` (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def _existing_ancestor(p: Path) -> Path:
    for a in (p, *p.parents):
        try:
            if a.exists() or a.is_symlink():
                return a
        except OSError:  # e.g. a symlink loop on the way: the mkdir below names it
            return a
    return Path("/")


def _where(flag: str, p: Path) -> str:
    return f"{flag} {p}" if flag else str(p)


def check_dir(path: str | os.PathLike, *, flag: str, force: bool = False,
              overwrites: Iterable[str] = (), what: str = "an earlier result",
              fix: str | None = None,
              folders: Iterable[str] = ()) -> Path:
    """Validate (and create) the output folder ``path`` at start.

    Args:
        path: the folder the command writes into.
        flag: the flag or key that names it (``--out``, ``store.path``), for the message.
        force: overwriting is allowed.
        overwrites: names of files (or folders) in ``path`` the command replaces; one that
            exists is refused unless ``force``.
        what: what the existing files are, for the message.
        fix: the fix of an overwrite (default: pass ``--force``, or another folder).
        folders: names of subfolders the command keeps in ``path`` (not created here); one
            that exists as a file is refused.

    Returns:
        ``path`` as a Path (the folder exists and is writable).

    Raises:
        OutputError: ``path`` is a file, lies under a file, cannot be created or written, or
            holds one of ``overwrites`` without ``force``.
    """
    p = Path(path)
    where = _where(flag, p)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{where} is an existing file; a folder is expected there. Fix: "
                          f"pass a folder path to {flag or 'it'}, or move the file away")
    top = _existing_ancestor(p)
    if top != p and top.exists() and not top.is_dir():
        raise OutputError(f"{where} cannot be created: {top} is a file, not a folder. Fix: "
                          f"pass a path that is not under a file")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{where} cannot be created: {reason(e)}. Fix: pass a folder you "
                          f"can write to") from None
    _probe(p, where)
    for n in folders:
        if (p / n).exists() and not (p / n).is_dir():
            raise OutputError(f"{where}: {p / n} is an existing file where this command keeps "
                              f"a folder. Fix: move the file away, or pass another "
                              f"{flag or 'folder'}")
    overwrites = tuple(overwrites)
    for n in overwrites:
        if (p / n).is_dir() and "." in n:
            raise OutputError(f"{where}: {p / n} is a folder where this command writes a file. "
                              f"Fix: move it away, or pass another {flag or 'folder'}")
    existing = [n for n in overwrites if (p / n).exists()]
    if existing and not force:
        fix = fix or f"pass --force to replace it, or another {flag or 'folder'}"
        raise OutputError(f"{where} already holds {existing[0]} ({what}), which this command "
                          f"would overwrite. Fix: {fix}")
    return p


def check_file(path: str | os.PathLike, *, flag: str, force: bool = False) -> Path:
    """Validate the output file ``path`` at start (its folder is created and probed).

    Raises:
        OutputError: ``path`` is a folder, its parent cannot be created or written, or the
            file exists and ``force`` is False.
    """
    p = Path(path)
    where = _where(flag, p)
    if p.is_dir():
        raise OutputError(f"{where} is an existing folder; a file is expected there. Fix: "
                          f"pass a file path (e.g. {p / 'factors.pt'})")
    check_dir(p.parent, flag=f"the folder of {flag}" if flag else "", force=True)
    if p.exists() and not force:
        raise OutputError(f"{where} already exists, and this command would overwrite it. "
                          f"Fix: pass --force to replace it, or another {flag or 'file'}")
    return p


def _probe(p: Path, where: str) -> None:
    """Write and remove a small file in ``p``: the folder accepts new files."""
    try:
        fd, name = tempfile.mkstemp(prefix=".dattri_ds-write-probe-", dir=p)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise OutputError(f"{where} is not writable: {reason(e)}. Fix: pass a folder you can "
                          f"write to") from None


def write_error(err: OSError, path: str | os.PathLike, nbytes: int | None = None,
                committed: str | None = None) -> WriteError:
    """The one-line WriteError of ``err`` raised while writing ``path``."""
    target = err.filename or path
    need = f" ({human_bytes(nbytes)} to write)" if nbytes else ""
    kept = committed or ("nothing committed was lost: files written before are unchanged; "
                         "free space and rerun")
    out = WriteError(f"writing {target} failed: {reason(err)}{need}; {kept}")
    out.errno = err.errno
    return out


#: How torch.save reports a failed write (its C++ stream writer raises RuntimeError).
_TORCH_WRITE = ("PytorchStreamWriter", "inline_container")


def _why_write_failed(path: Path) -> OSError:
    """The likely OS cause of a write that failed without an errno (torch.save): a file size
    limit, a full disk, or unknown."""
    import resource
    import shutil

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return OSError(errno.EFBIG, f"file size limit {soft} bytes")
    try:
        if shutil.disk_usage(_existing_ancestor(path)).free < 1 << 20:
            return OSError(errno.ENOSPC, "no space")
    except OSError:
        pass
    return OSError(errno.EIO, "the file could not be written")


@contextlib.contextmanager
def writing(path: str | os.PathLike, *, nbytes: int | None = None,
            committed: str | None = None, new_file: bool = False) -> Iterator[None]:
    """Turn an ``OSError`` of the block (or torch.save's failed-write RuntimeError) into a
    :class:`WriteError` naming ``path``, the bytes ``nbytes`` being written and
    ``committed`` (what stays safe and how to go on). ``new_file``: ``path`` is one file the
    block writes; if it did not exist before, a partly written one is removed."""
    p = Path(path)
    existed = p.exists()
    try:
        yield
    except DattriDSError:
        raise
    except (OSError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not any(m in str(e) for m in _TORCH_WRITE):
            raise
        if new_file and not existed:
            with contextlib.suppress(OSError):
                p.unlink()
        cause = e if isinstance(e, OSError) else _why_write_failed(p)
        raise write_error(cause, path, nbytes, committed) from None


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` to ``path`` so readers see the old or the new file, never a torn one:
    a unique temporary file beside it, fsynced, then ``os.replace`` (removed on failure)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where the file system refuses
    fsync on directories)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any, fsync: bool = True) -> None:
    """Write JSON to ``path`` so readers see the old or the new file, never a mix."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)
