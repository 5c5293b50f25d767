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
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dattri_ds.errors import CREATED_FOLDERS, DattriDSError, OutputError, WriteError

__all__ = ["check_dir", "check_file", "writing", "write_error", "write_failure", "naming",
           "reason", "human_bytes", "write_atomic", "fsync_dir", "write_json_atomic"]

#: errno -> what it means here, after the system's own words (``os.strerror``).
_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EFBIG: "the file size limit was reached: ulimit -f, or the file system's largest "
                 "file",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.ENOENT: "a folder on the way does not exist and cannot be created there",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "it is a folder, not a file",
    errno.ELOOP: "the path has a symbolic link loop",
}


def reason(err: OSError) -> str:
    """Why an OS call failed, in the system's words and what they mean (no exception
    class), e.g. ``File too large (the file size limit was reached: ...)``."""
    if not err.errno:
        return str(err) or "it failed"
    said = os.strerror(err.errno)
    return f"{said} ({_REASONS[err.errno]})" if err.errno in _REASONS else said


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
    new = [a for a in (p, *p.parents) if a == top or top in a.parents][::-1][1:]
    try:
        p.mkdir(parents=True, exist_ok=True)
        CREATED_FOLDERS.extend(a for a in new if a not in CREATED_FOLDERS)
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
#: How a Rust io error (safetensors) carries the errno.
_RUST_ERRNO = re.compile(r"(?:os error|code:)\s*(\d+)")


def write_failure(err: BaseException, path: str | os.PathLike) -> OSError | None:
    """The OS error behind a failed write of ``path``: ``err`` itself, the errno inside a
    safetensors (Rust) error, or, for torch.save's errno-less RuntimeError, the likely
    cause (a file size limit, a full disk); None when ``err`` is not a failed write."""
    if isinstance(err, OSError):
        return err
    text = str(err)
    found = _RUST_ERRNO.search(text)
    if found and ("Io" in text or "os error" in text):
        no = int(found.group(1))
        return OSError(no, os.strerror(no))
    if any(m in text for m in _TORCH_WRITE):
        return _why_write_failed(Path(path))
    return None


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """A failed write in the block that does not name its file (a safetensors or torch.save
    error) becomes an ``OSError`` naming ``path``, its errno kept (:func:`write_failure`)."""
    try:
        yield
    except DattriDSError:
        raise
    except Exception as e:  # noqa: BLE001 - anything but a failed write is re-raised
        cause = write_failure(e, path)
        if cause is None or cause.filename:
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from None


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
    """Turn a failed write of the block (an ``OSError``, torch.save's RuntimeError, a
    safetensors io error: :func:`write_failure`) into a :class:`WriteError` naming ``path``,
    the bytes ``nbytes`` being written and ``committed`` (what stays safe and how to go on).
    ``new_file``: ``path`` is one file the block writes; if it did not exist before, a
    partly written one is removed."""
    p = Path(path)
    existed = p.exists()
    try:
        yield
    except DattriDSError:
        raise
    except Exception as e:  # noqa: BLE001 - anything but a failed write is re-raised
        cause = write_failure(e, p)
        if cause is None:
            raise
        if new_file and not existed:
            with contextlib.suppress(OSError):
                p.unlink()
        raise write_error(cause, path, nbytes, committed) from None


def write_atomic(path: str | os.PathLike, data: bytes | str, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` so readers see the old or the new file, never a torn one:
    a unique temporary file beside it, then ``os.replace`` (removed on failure); ``fsync``
    makes the file and the rename durable before it returns."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(p.parent)


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


def write_json_atomic(path: str | os.PathLike, obj: Any, fsync: bool = True) -> None:
    """:func:`write_atomic` of ``obj`` as indented JSON."""
    write_atomic(path, json.dumps(obj, indent=1), fsync)
