"""The one door for every file dattri-ds reads: each failure names the file, the line and the fix.

Every reader checks the path first (:func:`check_file` / :func:`check_dir`), then the
content, and raises :class:`~dattri_ds.errors.InputFileError` (a ConfigError: exit code 2)
with a one-line message ``<what> '<path>'[:line]: <what is wrong>; expected <...>. Fix: <...>``.
What each reader checks (text and JSON lines, JSON, ``.npy``, torch files, Hugging Face
folders): docs/input_files.md.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dattri_ds.errors import DattriDSError, InputFileError

__all__ = ["MAX_LINE_ENV", "max_line_bytes", "check_file", "check_dir", "iter_lines",
           "iter_json_lines", "first_json_line", "read_json", "read_text", "load_array",
           "load_torch", "load_safetensors", "model_dir", "HF_WEIGHTS", "check_torch_file",
           "check_safetensors", "check_checkpoint", "read_by"]

#: Environment variable capping the bytes of one text line (and of one JSON file).
MAX_LINE_ENV = "DATTRI_DS_MAX_LINE_BYTES"
_DEFAULT_MAX_LINE = 256 << 20
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
         (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))
_UTF8_BOM = b"\xef\xbb\xbf"
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")


def max_line_bytes() -> int:
    """The longest text line (and JSON file) read, in bytes: ``$DATTRI_DS_MAX_LINE_BYTES``,
    default 256 MiB."""
    raw = os.environ.get(MAX_LINE_ENV, "")
    try:
        value = int(raw) if raw else _DEFAULT_MAX_LINE
    except ValueError:
        value = -1
    if value < 1:
        raise InputFileError(f"{MAX_LINE_ENV}={raw!r} is not allowed: expected a positive "
                             f"number of bytes. Fix: unset it or set e.g. {_DEFAULT_MAX_LINE}")
    return value


def _fail(what: str, path: Path, problem: str, fix: str) -> InputFileError:
    return InputFileError(f"{what} '{path}' {problem}. Fix: {fix}")


def _check_path(path: str | os.PathLike, what: str, fix: str, want_dir: bool) -> Path:
    p = Path(path)
    kind = "folder" if want_dir else "file"
    try:
        st = p.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _fail(what, p, "is a symlink loop (it resolves to itself)", fix) from None
        if p.is_symlink():
            raise _fail(what, p, f"is a dangling symlink (to '{os.readlink(p)}', which does "
                        f"not exist)", fix) from None
        if e.errno == errno.EACCES:
            raise _fail(what, p, "cannot be read (permission denied)", fix) from None
        if e.errno == errno.ENOTDIR:
            raise _fail(what, p, "does not exist (a parent of it is a file, not a folder)",
                        fix) from None
        raise _fail(what, p, f"does not exist (expected a {kind})", fix) from None
    if want_dir and not stat.S_ISDIR(st.st_mode):
        raise _fail(what, p, "is a file, not a folder", fix)
    if not want_dir and stat.S_ISDIR(st.st_mode):
        raise _fail(what, p, "is a folder, not a file", fix)
    if not want_dir and not stat.S_ISREG(st.st_mode):
        raise _fail(what, p, "is not a regular file (a device, socket or pipe)", fix)
    if not os.access(p, os.R_OK | (os.X_OK if want_dir else 0)):
        raise _fail(what, p, "cannot be read (permission denied)", fix)
    return p


def check_file(path: str | os.PathLike, what: str = "file",
               fix: str = "pass an existing, readable file") -> Path:
    """``path`` as a Path if it is a readable regular file (symlinks followed).

    Raises:
        InputFileError: missing, a dangling symlink, a symlink loop, a folder, not a regular
            file, or not readable; the message names ``what`` and ``path`` and says ``fix``.
    """
    return _check_path(path, what, fix, want_dir=False)


def check_dir(path: str | os.PathLike, what: str = "folder",
              fix: str = "pass an existing folder") -> Path:
    """``path`` as a Path if it is a readable folder (the checks of :func:`check_file`)."""
    return _check_path(path, what, fix, want_dir=True)


def _open(p: Path, what: str, fix: str):
    try:
        return open(p, "rb")
    except OSError as e:
        raise _fail(what, p, f"cannot be opened ({e.strerror})", fix) from None


def _refuse_utf16_32(raw: bytes, p: Path, what: str) -> None:
    for bom, enc in _BOMS:
        if raw.startswith(bom):
            raise InputFileError(f"{what} '{p}' is {enc} encoded; expected UTF-8. Fix: save it "
                                 f"as UTF-8")


def _decode(raw: bytes, p: Path, lineno: int, offset: int, what: str, fix: str) -> str:
    if b"\x00" in raw:
        at = offset + raw.index(b"\x00")
        raise InputFileError(f"{what} {p}:{lineno}: a NUL byte at byte offset {at}: this is "
                             f"a binary file, not UTF-8 text. Fix: {fix}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(
            f"{what} {p}:{lineno}: byte 0x{raw[e.start]:02x} at byte offset "
            f"{offset + e.start} is not UTF-8 (the file is in another encoding, e.g. latin-1, "
            f"or binary). Fix: save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def iter_lines(path: str | os.PathLike, what: str = "text file",
               fix: str = "pass a UTF-8 text file") -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file, 1-based, newlines kept; a UTF-8 BOM is
    stripped.

    Raises:
        InputFileError: a path problem (:func:`check_file`), UTF-16/32 or binary content, a
            byte that is not UTF-8 (line and byte offset named), or a line longer than
            :func:`max_line_bytes` (refused after reading at most that many bytes).
    """
    p = check_file(path, what, fix)
    cap = max_line_bytes()
    with _open(p, what, fix) as fh:
        offset = 0
        lineno = 0
        while True:
            raw = fh.readline(cap + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > cap and not (len(raw) == cap + 1 and raw.endswith(b"\n")):
                raise InputFileError(
                    f"{what} {p}:{lineno}: the line is longer than {cap} bytes (the line cap); "
                    f"expected one record per line. Fix: split the record, or raise "
                    f"{MAX_LINE_ENV} if the line is meant to be that long")
            if lineno == 1:
                _refuse_utf16_32(raw, p, what)
                if raw.startswith(_UTF8_BOM):
                    raw, offset = raw[len(_UTF8_BOM):], len(_UTF8_BOM)
            yield lineno, _decode(raw, p, lineno, offset, what, fix)
            offset += len(raw)


def _looks_like(text: str, last: bool) -> str:
    """A hint for a line that is not JSON: CSV, truncated, or plain text."""
    s = text.strip()
    if last and not text.endswith("\n") and s.startswith(("{", "[")):
        return " (the last line is cut off: the file looks truncated)"
    if not s.startswith(("{", "[")) and ("," in s or "\t" in s):
        return " (it looks like CSV/TSV: dattri-ds reads JSON lines, one object per line)"
    return ""


def iter_json_lines(path: str | os.PathLike, what: str = "jsonl file",
                    expected: str = "one JSON object per line",
                    fix: str = "one JSON object per line (see data/README.md)"
                    ) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line of a JSON-lines file.

    Raises:
        InputFileError: any :func:`iter_lines` failure, or a line that is not JSON (its
            line and column named; CSV and truncated files are said to be so).
    """
    p = Path(path)
    lines = iter_lines(p, what, fix)
    nxt = next(lines, None)
    while nxt is not None:
        lineno, text = nxt
        nxt = next(lines, None)
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputFileError(
                f"{what} {p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"
                f"{_looks_like(text, nxt is None)}; expected {expected}. Fix: {fix}") from None
        yield lineno, value


def first_json_line(path: str | os.PathLike, what: str = "jsonl file",
                    expected: str = "one JSON object per line",
                    fix: str = "one JSON object per line (see data/README.md)") -> Any:
    """The first non-blank line's value (None for a file without one); errors as
    :func:`iter_json_lines`."""
    for _, value in iter_json_lines(path, what, expected, fix):
        return value
    return None


def _no_duplicates(what: str, path: Path, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise InputFileError(f"{path}: key '{k}' appears twice in one object (JSON keeps "
                                 f"only the last). Fix: keep one '{k}'")
        out[k] = v
    return out


def read_json(path: str | os.PathLike, what: str = "JSON file", *, flag: str | None = None,
              fix: str | None = None) -> Any:
    """A UTF-8 JSON file's value (a UTF-8 BOM is stripped).

    Args:
        path: the file.
        what: what the file is, for messages (``"attribution summary"``).
        flag: the flag or key that supplies the file (named in the fix when it is missing).
        fix: what to do instead (default: from ``flag``).

    Raises:
        InputFileError: a path problem, a file over :func:`max_line_bytes`, UTF-16/32 or
            non-UTF-8 bytes (line named), invalid JSON (``path:line:col``; truncation
            recognised), or a key repeated in one object.
    """
    fix = fix or (f"pass an existing JSON file to {flag}" if flag else "pass a UTF-8 JSON file")
    p = check_file(path, what, fix)
    cap = max_line_bytes()
    with _open(p, what, fix) as fh:
        raw = fh.read(cap + 1)
    if len(raw) > cap:
        raise _fail(what, p, f"is larger than {cap} bytes ({MAX_LINE_ENV})",
                    f"raise {MAX_LINE_ENV} if it is meant to be that large")
    _refuse_utf16_32(raw, p, what)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise InputFileError(f"{p}:{line}: byte 0x{raw[e.start]:02x} at byte offset {e.start} "
                             f"is not UTF-8; JSON files must be UTF-8. Fix: save it as UTF-8"
                             ) from None
    if not text.strip():
        raise InputFileError(f"{what} {p}:1:1: the file is empty; expected a JSON value. "
                             f"Fix: {fix}")
    try:
        return json.loads(text, object_pairs_hook=functools.partial(_no_duplicates, what, p))
    except json.JSONDecodeError as e:
        cut = " (the file ends early: it looks truncated)" if e.pos >= len(text.rstrip()) \
            else " (it runs to the end of the file: truncated?)" if e.msg.startswith(
                "Unterminated") else ""
        raise InputFileError(
            f"{what} {p}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}{cut}. Fix: correct the "
            f"syntax there (JSON has no comments or trailing commas, strings use double "
            f"quotes)") from None


def load_array(path: str | os.PathLike, what: str = "array file",
               fix: str = "pass a .npy file written by dattri-ds (numpy.save)"):
    """A NumPy ``.npy`` array, never unpickled (``allow_pickle=False``).

    Raises:
        InputFileError: a path problem, no ``.npy`` magic, pickled (object) content, or a
            truncated or damaged file.
    """
    import numpy as np

    p = check_file(path, what, fix)
    with _open(p, what, fix) as fh:
        if fh.read(6) != b"\x93NUMPY":
            raise _fail(what, p, "is not a NumPy .npy file (empty, or it lacks the .npy magic "
                        "bytes)", fix)
        _npy_header(fh, p, what, fix)
    try:
        return np.load(p, allow_pickle=False)
    except ValueError as e:
        if "pickle" in str(e) or "Object arrays" in str(e):
            raise _fail(what, p, "holds pickled Python objects (a numpy object array); "
                        "dattri-ds reads only numeric arrays from .npy files", fix) from None
        raise _fail(what, p, f"is truncated or damaged ({e})", fix) from None
    except (OSError, EOFError) as e:
        raise _fail(what, p, f"is truncated or damaged ({e or 'no data'})", fix) from None


def _npy_header(fh, p: Path, what: str, fix: str) -> None:
    """Refuse object dtypes and a declared size the file does not hold, before any array is
    allocated (a damaged header must not ask numpy for terabytes)."""
    import numpy as np
    from numpy.lib import format as npy

    fh.seek(0)
    try:
        version = npy.read_magic(fh)
        read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, _, dtype = read(fh)
    except (ValueError, OSError, EOFError, SyntaxError) as e:
        raise _fail(what, p, f"has a damaged .npy header ({' '.join(str(e).split())[:80]})",
                    fix) from None
    if dtype.hasobject:
        raise _fail(what, p, "holds pickled Python objects (a numpy object array); dattri-ds "
                    "reads only numeric arrays from .npy files", fix)
    need = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    have = p.stat().st_size - fh.tell()
    if need > have:
        raise _fail(what, p, f"is truncated: its header declares {list(shape)} {dtype} "
                    f"({need} bytes) but {have} bytes follow", fix)


def check_torch_file(path: str | os.PathLike, what: str = "torch file",
                     fix: str = "pass a file written by dattri-ds") -> Path:
    """``path`` if it is a complete ``torch.save`` archive: its zip directory, which torch
    writes last, is present and every entry lies inside the file (read without loading).

    Raises:
        InputFileError: a path problem, an empty, cut or damaged file.
    """
    import zipfile

    p = check_file(path, what, fix)
    size = p.stat().st_size
    if size == 0:
        raise _fail(what, p, "is empty", fix)
    try:
        with zipfile.ZipFile(p) as z:
            end = max((i.header_offset + i.compress_size for i in z.infolist()), default=0)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        raise _fail(what, p, f"is cut off or damaged ({size} bytes, not a complete "
                    f"torch.save archive: its write did not finish)", fix) from None
    if end > size:
        raise _fail(what, p, f"is cut off ({size} bytes, its entries need {end})", fix)
    return p


def load_torch(path: str | os.PathLike, what: str = "torch file", *,
               fix: str = "pass a file written by dattri-ds", map_location: Any = "cpu",
               trusted: str | None = None, mmap: bool = False) -> Any:
    """A ``torch.save`` file: tensors and plain containers only (``weights_only=True``).

    A zip archive (what torch writes since 1.6) is checked whole first
    (:func:`check_torch_file`), so a cut file is named as cut, not by torch's reader.

    Args:
        trusted: the manifest that marks this file as written by us or our training run (e.g.
            ``"DeepSpeed checkpoint tag folder"``); only then are pickled objects loaded.
        mmap: map the tensors' storage from the file instead of reading it.

    Raises:
        InputFileError: a path problem, an empty, truncated or damaged file, or (untrusted)
            pickled objects other than tensors.
    """
    import pickle

    import torch

    p = check_file(path, what, fix)
    if p.stat().st_size == 0:
        raise _fail(what, p, "is empty", fix)
    with _open(p, what, fix) as fh:
        zipped = fh.read(4) == b"PK\x03\x04"
    if zipped:
        check_torch_file(p, what, fix)
    try:
        return torch.load(p, map_location=map_location, weights_only=trusted is None,
                          mmap=mmap)
    except pickle.UnpicklingError:
        raise _fail(what, p, "holds pickled Python objects that are not tensors (refused: "
                    "only files dattri-ds wrote are read)", fix) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError) as e:
        first = " ".join(str(e).split())[:80] or "no data"
        raise _fail(what, p, f"is truncated or damaged (not a readable torch.save archive: "
                    f"{first})", fix) from None


#: Bytes per element of the safetensors dtypes.
_ST_BYTES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
             "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
             "F8_E5M2": 1}


def check_safetensors(path: str | os.PathLike, what: str = "weights file",
                      fix: str = "pass a folder written by model.save_pretrained(path)"
                      ) -> Path:
    """``path`` if it is a whole ``.safetensors`` file, read without loading a tensor: the
    8-byte header length, a JSON header, every tensor's ``data_offsets`` matching its dtype
    and shape, and the data running to the end of the file (what safetensors reports as
    "file not fully covered" when the file is cut).

    Raises:
        InputFileError: a path problem, a damaged header, or data cut off or inconsistent.
    """
    import math

    p = check_file(path, what, fix)
    size = p.stat().st_size
    with _open(p, what, fix) as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = None
        if 0 < n <= size - 8:
            try:
                header = json.loads(fh.read(n))
            except (ValueError, UnicodeDecodeError):
                header = None
    if not isinstance(header, dict):
        raise _fail(what, p, "is not a safetensors file (truncated or damaged header)", fix)
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = (int(x) for x in t["data_offsets"])
            need = math.prod(int(d) for d in t["shape"]) * _ST_BYTES.get(t["dtype"], 0)
        except (TypeError, KeyError, ValueError):
            raise _fail(what, p, f"has a damaged header (tensor '{name}' lacks dtype, shape "
                        f"or data_offsets)", fix) from None
        if not 0 <= lo <= hi or (t["dtype"] in _ST_BYTES and hi - lo != need):
            raise _fail(what, p, f"has a damaged header (tensor '{name}': data_offsets "
                        f"{[lo, hi]} do not hold its {t['dtype']} {t['shape']})", fix)
        end = max(end, hi)
    have = size - 8 - n
    if end != have:
        state = "cut off" if end > have else "longer than its header says"
        raise _fail(what, p, f"is {state}: its header declares {end} bytes of tensor data, "
                    f"the file holds {have}", fix)
    return p


def load_safetensors(path: str | os.PathLike, what: str = "weights file",
                     fix: str = "pass a folder written by model.save_pretrained(path)"):
    """The tensors of a ``.safetensors`` file, checked whole first (:func:`check_safetensors`).

    Raises:
        InputFileError: a path problem, or a truncated or damaged file.
    """
    from safetensors.torch import load_file

    p = check_safetensors(path, what, fix)
    try:
        return load_file(str(p))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
        first = " ".join(str(e).split())[:80]
        raise _fail(what, p, f"is truncated or damaged ({first})", fix) from None


#: The check of each weight and state file of a checkpoint folder, by suffix.
_CHECKPOINT_FILES = {".pt": check_torch_file, ".bin": check_torch_file,
                     ".safetensors": check_safetensors}


def check_checkpoint(folder: str | os.PathLike, what: str = "checkpoint",
                     fix: str = "resume from another checkpoint",
                     only: tuple[str, ...] | None = None) -> Path:
    """``folder`` if every weight and state file directly in it (``*.pt``, ``*.bin``,
    ``*.safetensors``: DeepSpeed's ``mp_rank_*`` and ``*_optim_states.pt``, a
    ``save_pretrained`` folder's weights, the loop's and the optimizer's states) is whole,
    read without loading a tensor, so that a cut file is named before anything is built.

    Args:
        only: glob patterns: check only the files matching one (default: every such file).

    Raises:
        InputFileError: the folder is missing, or a file in it is empty, cut or damaged.
    """
    p = check_dir(folder, f"{what} folder", fix)
    for f in sorted(p.iterdir()):
        check = _CHECKPOINT_FILES.get(f.suffix)
        if check is None or (only is not None and not any(f.match(g) for g in only)):
            continue
        if f.is_file() or f.is_symlink():  # a dangling link is named by the check
            check(f, f"{what} file", fix)
    return p


#: What third-party readers raise on a whole file they do not understand.
_READER_ERRORS = (AssertionError, KeyError, ValueError, IndexError, TypeError, AttributeError,
                  RuntimeError, EOFError, OSError)


@contextlib.contextmanager
def read_by(reader: str, path: str | os.PathLike, what: str, fix: str) -> Iterator[None]:
    """Errors that ``reader`` (a third-party loader: DeepSpeed's ``zero_to_fp32``,
    transformers) raises in the block, on files checked whole before, become one line
    naming ``path``, the reader and ``fix``; dattri-ds errors pass through.

    Raises:
        InputFileError: the reader failed.
    """
    try:
        yield
    except DattriDSError:
        raise
    except _READER_ERRORS as e:
        first = " ".join(str(e).split())[:120] or "no detail"
        raise _fail(what, Path(path), f"cannot be read by {reader} ({first})", fix) from None


def read_text(path: str | os.PathLike, what: str = "text file",
              fix: str = "pass a UTF-8 text file") -> str:
    """A small UTF-8 text file (e.g. DeepSpeed's ``latest``), read through
    :func:`iter_lines`."""
    return "".join(text for _, text in iter_lines(path, what, fix))


def model_dir(path: str | os.PathLike, what: str = "--model",
              fix: str = "pass a folder written by model.save_pretrained(path)", *,
              weights: bool = True) -> Path:
    """A Hugging Face model folder, checked before transformers is called.

    ``config.json`` must be a UTF-8 JSON object without BOM (transformers cannot read one)
    whose ``model_type`` the installed transformers knows (``CONFIG_MAPPING``); with
    ``weights``, one of :data:`HF_WEIGHTS` must be present and whole (``_check_weights``).

    Raises:
        InputFileError: any of these checks, naming the folder or file.
    """
    p = check_dir(path, f"{what} folder", fix)
    cfg_path = p / "config.json"
    if not cfg_path.exists() and not cfg_path.is_symlink():
        have = sorted(q.name for q in p.iterdir())[:8]
        raise _fail(f"{what} folder", p, f"is not a Hugging Face model folder: it has no "
                    f"config.json (it holds {have})", fix)
    cfg = read_json(cfg_path, f"{what} model config", fix=fix)
    with _open(cfg_path, what, fix) as fh:
        if fh.read(len(_UTF8_BOM)) == _UTF8_BOM:
            raise _fail(f"{what} model config", cfg_path, "starts with a UTF-8 BOM, which "
                        "transformers cannot read", "save it as UTF-8 without a BOM")
    if not isinstance(cfg, dict):
        raise _fail(f"{what} model config", cfg_path, f"is a JSON {type(cfg).__name__}, "
                    f"expected an object", fix)
    from transformers import CONFIG_MAPPING, __version__

    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
        near = difflib.get_close_matches(str(mt), list(CONFIG_MAPPING.keys()), n=3)
        raise _fail(f"{what} model config", cfg_path, f"has model_type {mt!r}, which the "
                    f"installed transformers {__version__} does not know"
                    f"{f' (close: {near})' if near else ''}",
                    "set model_type to a known architecture (e.g. 'gpt2', 'llama'), or "
                    "upgrade transformers")
    if weights:
        found = [w for w in HF_WEIGHTS if (p / w).exists()]
        if not found:
            raise _fail(f"{what} folder", p, f"is not a Hugging Face model folder: it holds "
                        f"no weights (one of {list(HF_WEIGHTS)}) next to its config.json", fix)
        _check_weights(p, found[0], f"{what} weights", fix)
    return p


def _check_weights(folder: Path, name: str, what: str, fix: str) -> None:
    """The weights file ``name`` of a model folder (each shard of an index) is whole."""
    if name == "pytorch_model.bin":
        check_torch_file(folder / name, what, fix)
        return
    shards = [name]
    if name.endswith(".index.json"):
        index = read_json(folder / name, f"{what} index", fix=fix)
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise _fail(f"{what} index", folder / name, "has no weight_map of tensor names to "
                        "shard files", fix)
        shards = sorted(set(wmap.values()))
    for shard in shards:
        check_safetensors(folder / shard, what, fix)
