"""Corpus files as a stream of Arrow record batches: every format a data team writes, read by
pyarrow (``datasets`` names the files of a ``save_to_disk`` folder), never loaded whole.

An input is a file, a folder of shards, a ``datasets`` ``save_to_disk`` folder or a quoted
glob. Formats, by file name (``FORMATS``): JSON lines (``.jsonl``, ``.json``, ``.ndjson``,
also ``.gz`` / ``.zst`` compressed: pyarrow's own codecs), Parquet (``.parquet``) and Arrow
IPC (``.arrow``, ``.feather``, ``.ipc``: the file and the stream format). A folder's shards
are its files of these formats (hidden files and others are skipped), in sorted order.

Each row becomes one document ``(id, source, title, text)`` (``DOC_SCHEMA``), the columns
named by a :class:`FieldMap`. ``text`` must be a string in every row; an integer ``id`` is
read as its decimal string; a row without an ``id`` column gets the stable id
``<file name>:<row>`` (the file's path relative to its input folder, or its base name for a
file given directly; the row counted from 0 in that file); a missing ``source`` / ``title``
is ``""``. Every shard must carry the same mapped columns with the same types. Any damaged or
mismatched input is one :class:`~dattri_ds.errors.InputFileError` line naming the file and
the fix.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dattri_ds.errors import InputFileError
from dattri_ds.io.files import MAX_LINE_ENV, check_dir, check_file, max_line_bytes
from dattri_ds.registry import Registry

__all__ = ["FieldMap", "InputFile", "Format", "FORMATS", "DOC_FIELDS", "doc_schema", "format_of",
           "check_shards",
           "resolve_inputs", "iter_batches", "hash_file", "describe_inputs"]

#: The columns of every batch :func:`iter_batches` yields, in this order, all strings.
DOC_FIELDS = ("id", "source", "title", "text")
_READ_FIX = "re-create or re-download the file (it is damaged or cut off)"
#: JSON-lines block size (pyarrow reads ahead some 30 blocks: this bounds the memory), grown
#: 4x (up to the line cap) for a file with a longer record.
_JSON_BLOCK = 1 << 20
_HASH_BLOCK = 1 << 20


def doc_schema():
    """``pa.schema`` of ``DOC_FIELDS`` (all ``string``)."""
    import pyarrow as pa

    return pa.schema([(f, pa.string()) for f in DOC_FIELDS])


@dataclass(frozen=True)
class FieldMap:
    """Which input column holds each document field."""

    text: str = "text"
    """Column of the document text (required, a string in every row)."""

    id: str = "id"
    """Column of the document id (string or integer); when no shard has it, ids are
    ``<file name>:<row>``."""

    source: str = "source"
    """Column of the domain label (optional: ``""`` when absent)."""

    title: str = "title"
    """Column of the title (optional: ``""`` when absent)."""

    def column(self, field: str) -> str:
        return getattr(self, field)


@dataclass(frozen=True)
class InputFile:
    """One file of the corpus.

    Attributes:
        path: where it is.
        name: its name in ids and in the manifest (relative to its input folder).
        format: a key of ``FORMATS``.
        size: bytes on disk.
    """

    path: Path
    name: str
    format: str
    size: int


# ---- formats -----------------------------------------------------------------------------

class Format:
    """How one file format is read: its columns, then its record batches.

    Subclasses register with ``class X(Format, name="x", suffixes=(".x",))``.
    """

    name: str
    suffixes: tuple[str, ...] = ()

    def __init_subclass__(cls, name: str | None = None, suffixes: tuple[str, ...] = (),
                          **kw) -> None:
        super().__init_subclass__(**kw)
        cls.suffixes = suffixes
        FORMATS.register_class(cls, name, instance=True)

    def columns(self, f: InputFile) -> dict[str, object]:
        """Top-level column name -> pyarrow type, read from the file's head or footer."""
        raise NotImplementedError

    def batches(self, f: InputFile, columns: dict[str, object]) -> Iterator[object]:
        """Record batches of the given columns (name -> type from :meth:`columns`)."""
        raise NotImplementedError


FORMATS: Registry[Format] = Registry("corpus file format", hint="register one with "
                                     "class X(Format, name='x', suffixes=('.x',))")


def _damaged(f: InputFile, err: Exception, what: str = "is damaged or cut off") -> InputFileError:
    first = " ".join(str(err).split())[:160]
    if "too much memory" in first:  # zstd --long: a window over the decoder's 128 MiB
        return InputFileError(f"corpus file '{f.path}' was compressed with a zstd window over "
                              f"128 MiB (zstd --long; pyarrow: {first}). Fix: decompress it "
                              f"(zstd -d --long=31) or recompress it without --long")
    return InputFileError(f"corpus file '{f.path}' {what} (pyarrow: {first}). Fix: {_READ_FIX}")


class _JsonLines(Format, name="jsonl", suffixes=(".jsonl", ".json", ".ndjson")):
    """One JSON object per line; :attr:`codec` names pyarrow's decompressor."""

    codec: str | None = None

    def _open(self, f: InputFile):
        import pyarrow as pa

        raw = pa.OSFile(str(f.path))
        return pa.CompressedInputStream(raw, self.codec) if self.codec else raw

    def _first_line(self, f: InputFile) -> bytes:
        """The first non-blank line (b"" for a file without one), read in 64 KiB blocks."""
        cap, buf = max_line_bytes(), b""
        with self._open(f) as stream:
            while True:
                block = stream.read(1 << 16)
                buf = (buf + block).lstrip()
                end = buf.find(b"\n")
                if end >= 0 or not block:
                    return buf[:end] if end >= 0 else buf
                if len(buf) > cap:
                    raise InputFileError(f"corpus file '{f.path}': its first record is longer "
                                         f"than {cap} bytes. Fix: one JSON object per line, "
                                         f"or raise DATTRI_DS_MAX_LINE_BYTES")

    def columns(self, f: InputFile) -> dict[str, object]:
        try:
            line = self._first_line(f)
        except self._errors() as e:
            raise _damaged(f, e) from None
        if not line:
            return {}
        try:
            row = json.loads(line.decode("utf-8-sig"))
        except (ValueError, UnicodeDecodeError) as e:
            raise InputFileError(f"corpus file '{f.path}': its first line is not a UTF-8 JSON "
                                 f"object ({' '.join(str(e).split())[:80]}). Fix: write one "
                                 f"JSON object per line") from None
        if not isinstance(row, dict):
            raise InputFileError(f"corpus file '{f.path}': its first line is a JSON "
                                 f"{type(row).__name__}, not an object. Fix: write one JSON "
                                 f"object per line")
        return {k: _json_type(v) for k, v in row.items()}

    def _errors(self) -> tuple[type[BaseException], ...]:
        """What reading raises for a damaged or cut file."""
        import pyarrow as pa

        return (OSError, pa.ArrowException)

    def _blocks(self, f: InputFile, parse: Any, block: int) -> Iterator[tuple[Any, int]]:
        """``(record batch, rows before it)`` of one pass; the reader is released before its
        stream closes (pyarrow's read-ahead thread may be reading a Python stream)."""
        import pyarrow.json as pj

        with self._open(f) as stream:
            reader = pj.open_json(stream, parse_options=parse, read_options=pj.ReadOptions(
                block_size=block, use_threads=False))
            try:
                seen = 0
                for batch in reader:
                    yield batch, seen
                    seen += batch.num_rows
            finally:
                del reader

    def batches(self, f: InputFile, columns: dict[str, object]) -> Iterator[object]:
        import pyarrow as pa
        import pyarrow.json as pj

        parse = pj.ParseOptions(explicit_schema=pa.schema(list(columns.items())),
                                unexpected_field_behavior="ignore")
        block, done = _JSON_BLOCK, 0
        while True:
            try:
                for batch, seen in self._blocks(f, parse, block):
                    if seen + batch.num_rows > done:
                        yield batch.slice(max(done - seen, 0))
                        done = seen + batch.num_rows
                return
            except pa.ArrowInvalid as e:
                if "straddl" in str(e) and block < max_line_bytes():
                    block = min(block * 4, max_line_bytes())  # a record longer than a block
                    continue
                raise _json_error(f, e, done) from None
            except self._errors() as e:
                raise _damaged(f, e) from None


class _JsonLinesGzip(_JsonLines, name="jsonl.gz", suffixes=(".jsonl.gz", ".json.gz",
                                                            ".ndjson.gz")):
    codec = "gzip"


class _JsonLinesZstd(_JsonLines, name="jsonl.zst", suffixes=(".jsonl.zst", ".json.zst",
                                                             ".ndjson.zst")):
    codec = "zstd"


def _json_type(value: object):
    import pyarrow as pa

    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64()
    if isinstance(value, float):
        return pa.float64()
    if isinstance(value, str):
        return pa.string()
    return pa.null() if value is None else pa.struct([]) if isinstance(value, dict) \
        else pa.list_(pa.null())


def _json_error(f: InputFile, err: Exception, done: int) -> InputFileError:
    msg = " ".join(str(err).split())
    if "changed from" in msg or "Failed to convert" in msg:
        return InputFileError(
            f"corpus file '{f.path}': a mapped field changes type after row {done} "
            f"(pyarrow: {msg[:160]}). Fix: give the field one type in every row (text: a "
            f"string; id: always a string or always an integer)")
    if "straddl" in msg:
        return InputFileError(f"corpus file '{f.path}': a record after row {done} is longer "
                              f"than the line cap. Fix: split it, or raise "
                              f"DATTRI_DS_MAX_LINE_BYTES")
    return InputFileError(f"corpus file '{f.path}': a line after row {done} is not a JSON "
                          f"object (pyarrow: {msg[:160]}). Fix: write one JSON object per "
                          f"line (the file may be cut off)")


class _Parquet(Format, name="parquet", suffixes=(".parquet", ".pq")):
    def columns(self, f: InputFile) -> dict[str, object]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(str(f.path))
        except (OSError, pa.ArrowException) as e:
            raise _damaged(f, e) from None
        return {n: schema.field(n).type for n in schema.names}

    def batches(self, f: InputFile, columns: dict[str, object]) -> Iterator[object]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            with pq.ParquetFile(str(f.path)) as pf:
                yield from pf.iter_batches(batch_size=1 << 14, columns=list(columns))
        except (OSError, pa.ArrowException) as e:
            raise _damaged(f, e) from None


class _Arrow(Format, name="arrow", suffixes=(".arrow", ".feather", ".ipc", ".arrows")):
    """Arrow IPC, the file format (``ARROW1`` magic) or the stream format (``datasets``'
    ``save_to_disk`` shards)."""

    @staticmethod
    def _reader(f: InputFile):
        import pyarrow as pa

        with open(f.path, "rb") as fh:
            is_file = fh.read(6) == b"ARROW1"
        source = pa.OSFile(str(f.path))
        return pa.ipc.open_file(source) if is_file else pa.ipc.open_stream(source)

    def columns(self, f: InputFile) -> dict[str, object]:
        import pyarrow as pa

        try:
            schema = self._reader(f).schema
        except (OSError, pa.ArrowException) as e:
            raise _damaged(f, e, "is not a readable Arrow IPC file") from None
        return {n: schema.field(n).type for n in schema.names}

    def batches(self, f: InputFile, columns: dict[str, object]) -> Iterator[object]:
        import pyarrow as pa

        try:
            reader = self._reader(f)
            parts = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
                if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader
            for batch in parts:
                yield batch.select(list(columns))
        except (OSError, pa.ArrowException) as e:
            raise _damaged(f, e) from None


# ---- resolving inputs -------------------------------------------------------------------

def format_of(path: Path) -> str | None:
    """The ``FORMATS`` key of a file name (longest matching suffix), or None."""
    name = path.name.lower()
    best = max(((s, fmt) for fmt in FORMATS.values() for s in fmt.suffixes
                if name.endswith(s)), default=None, key=lambda t: len(t[0]))
    return best[1].name if best else None


def _file(path: Path, name: str, fix: str) -> InputFile:
    fmt = format_of(path)
    if fmt is None:
        known = sorted(s for f in FORMATS.values() for s in f.suffixes)
        raise InputFileError(f"corpus file '{path}' has no known format suffix (known: "
                             f"{known}). Fix: {fix}")
    return InputFile(path, name, fmt, path.stat().st_size)


def _saved_dataset(folder: Path) -> list[InputFile]:
    """The Arrow shards of a ``datasets`` ``save_to_disk`` folder, in order."""
    if (folder / "dataset_dict.json").exists():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise InputFileError(f"corpus folder '{folder}' is a datasets DatasetDict (splits "
                             f"{splits}). Fix: pass one split's folder, e.g. "
                             f"{folder / (splits[0] if splits else 'train')}")
    import datasets

    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # noqa: BLE001 - datasets raises FileNotFoundError/ValueError/...
        raise InputFileError(f"corpus folder '{folder}' is not a readable datasets "
                             f"save_to_disk folder ({' '.join(str(e).split())[:120]}). Fix: "
                             f"save it again with Dataset.save_to_disk") from None
    paths = [Path(c["filename"]) for c in ds.cache_files]
    return [InputFile(p, p.relative_to(folder).as_posix(), "arrow", p.stat().st_size)
            for p in paths]


def _shards(folder: Path) -> list[InputFile]:
    if (folder / "state.json").exists() and (folder / "dataset_info.json").exists() or \
            (folder / "dataset_dict.json").exists():
        return _saved_dataset(folder)
    found = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts) \
                and format_of(p) is not None:
            found.append(InputFile(p, rel.as_posix(), format_of(p), p.stat().st_size))
    if not found:
        raise InputFileError(f"corpus folder '{folder}' holds no file of a known format. Fix: "
                             f"put .jsonl[.gz|.zst], .parquet or .arrow shards in it")
    return found


def _glob(pattern: str) -> list[InputFile]:
    matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not matches:
        raise InputFileError(f"corpus glob '{pattern}' matches no file. Fix: check the "
                             f"pattern (quote it so the shell does not expand it)")
    root = Path(os.path.commonpath([str(p.parent) for p in matches]))
    return [_file(p, p.relative_to(root).as_posix(), f"pass files of a known format to "
                  f"'{pattern}'") for p in matches]


def resolve_inputs(inputs: Sequence[str | os.PathLike]) -> list[InputFile]:
    """The corpus files named by ``inputs`` (files, folders, quoted globs), in order.

    Raises:
        InputFileError: a missing path, a glob without match, an unknown format, a folder
            without shards, or a file named twice.
    """
    fix = "pass .jsonl[.gz|.zst], .parquet or .arrow files, a folder of them or a glob"
    out: list[InputFile] = []
    for item in inputs:
        text = str(item)
        if glob.has_magic(text) and not Path(text).exists():
            out += _glob(text)
            continue
        p = Path(text)
        if p.is_dir():
            out += _shards(check_dir(p, "corpus folder", fix))
        else:
            out.append(_file(check_file(p, "corpus file", fix), p.name, fix))
    seen: dict[Path, str] = {}
    for f in out:
        key = f.path.resolve()
        if key in seen:
            raise InputFileError(f"corpus file '{f.path}' is named twice by the inputs. Fix: "
                                 f"name each file once")
        seen[key] = f.name
    names = [f.name for f in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise InputFileError(f"two corpus files are both named '{dup}' (ids and the manifest "
                             f"name files by it). Fix: pass their common folder instead")
    return out


# ---- schema check and normalized batches ---------------------------------------------------

def _is_string(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _plan(f: InputFile, fields: FieldMap) -> dict[str, object] | None:
    """The mapped columns this file has (input name -> type), checked; None for a JSON-lines
    file without a record (an empty shard)."""
    import pyarrow as pa

    cols = FORMATS.lookup(f.format).columns(f)
    if not cols and f.format.startswith("jsonl"):
        return None
    if fields.text not in cols:
        raise InputFileError(f"corpus file '{f.path}' has no text field '{fields.text}' (its "
                             f"fields: {sorted(cols)[:12]}). Fix: name the text column with "
                             f"--text-field")
    plan = {}
    for field in DOC_FIELDS:
        col = fields.column(field)
        if col not in cols or col in plan:
            continue
        t = cols[col]
        ok = _is_string(t) or (field == "id" and pa.types.is_integer(t)) or \
            (field in ("source", "title") and pa.types.is_null(t))
        if not ok:
            kind = "a string or an integer" if field == "id" else "a string"
            raise InputFileError(f"corpus file '{f.path}': field '{col}' ({field}) is {t}, "
                                 f"not {kind}. Fix: map --{field}-field to a column of that "
                                 f"type")
        plan[col] = pa.string() if pa.types.is_null(t) else t
    return plan


def _kinds(plan: dict[str, object]) -> dict[str, str]:
    return {k: "string" if _is_string(t) else "integer" for k, t in sorted(plan.items())}


def check_shards(files: Sequence[InputFile], fields: FieldMap
                 ) -> list[dict[str, object] | None]:
    """Each file's mapped columns (None: an empty JSON-lines shard); every other shard must
    have the same ones, of the same types.

    Raises:
        InputFileError: no file, only empty files, a file without the text field, a wrong
            type, or two shards whose mapped columns differ (both named).
    """
    if not files:
        raise InputFileError("the corpus names no file. Fix: pass --input")
    plans = [_plan(f, fields) for f in files]
    full = [(f, p) for f, p in zip(files, plans) if p is not None]
    if not full:
        raise InputFileError(f"the corpus ({files[0].path}{' ...' if len(files) > 1 else ''}) "
                             f"holds no record: every file is empty. Fix: pass files with at "
                             f"least one JSON object")
    first, want = full[0][0], _kinds(full[0][1])
    for f, plan in full[1:]:
        if _kinds(plan) != want:
            raise InputFileError(f"corpus shards differ: '{first.path}' has fields {want} "
                                 f"but '{f.path}' has {_kinds(plan)}. Fix: give every shard "
                                 f"the same mapped fields and types, or prepare them "
                                 f"separately and blend the prefixes")
    return plans


def _normalize(batch, f: InputFile, fields: FieldMap, row0: int):
    """``batch`` as ``DOC_SCHEMA`` columns, each value checked."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n, cols = batch.num_rows, {}
    for field in DOC_FIELDS:
        name = fields.column(field)
        idx = batch.schema.get_field_index(name)
        if idx < 0:
            cols[field] = pa.array([f"{f.name}:{row0 + i}" for i in range(n)], pa.string()) \
                if field == "id" else pa.array([""] * n, pa.string())
            continue
        col = batch.column(idx)
        if col.null_count and field in ("id", "text"):
            row = row0 + pc.index(pc.is_null(col), True).as_py()
            raise InputFileError(f"corpus file '{f.path}' row {row}: field '{name}' ({field}) "
                                 f"is missing or null. Fix: give every row a {field}, or drop "
                                 f"the row")
        if not _is_string(col.type) and not (field == "id" and pa.types.is_integer(col.type)) \
                and not pa.types.is_null(col.type):
            raise InputFileError(f"corpus file '{f.path}' rows {row0}..{row0 + n - 1}: field "
                                 f"'{name}' ({field}) is {col.type}, not a string. Fix: map "
                                 f"--{field}-field to a string column")
        if col.null_count:
            col = pc.fill_null(col.cast(pa.string()), "")
        cols[field] = _checked_text(col.cast(pa.string()), f, name, row0)
    return pa.RecordBatch.from_arrays([cols[k] for k in DOC_FIELDS], schema=doc_schema())


def _checked_text(col, f: InputFile, name: str, row0: int):
    """``col`` if every value is UTF-8 (pyarrow's JSON reader does not check) and no longer
    than the longest line read (``files.max_line_bytes``).

    Raises:
        InputFileError: naming the file, the row, the field and the fix.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        col.validate(full=True)
    except pa.ArrowInvalid:
        raise InputFileError(f"corpus file '{f.path}' rows {row0}..{row0 + len(col) - 1}: field "
                             f"'{name}' is not valid UTF-8. Fix: re-encode the file as UTF-8 "
                             f"(e.g. iconv -f latin1 -t utf-8)") from None
    cap = max_line_bytes()
    size = pc.binary_length(col)
    if len(col) and pc.max(size).as_py() > cap:
        i = pc.index(pc.greater(size, cap), True).as_py()
        raise InputFileError(f"corpus file '{f.path}' row {row0 + i}: field '{name}' is "
                             f"{size[i].as_py()} bytes, over the longest text read "
                             f"({MAX_LINE_ENV}={cap}). Fix: split the document, or raise "
                             f"{MAX_LINE_ENV}")
    return col


def iter_batches(files: Sequence[InputFile], fields: FieldMap = FieldMap(), *,
                 skip: int = 0, limit: int | None = None) -> Iterator[object]:
    """Record batches of ``DOC_SCHEMA`` over every file in order, the first ``skip`` rows
    left out (a resumed prepare), none from row ``limit`` on (counted from the first row,
    skipped ones included; None: every row; reading stops there); memory: one batch.

    Raises:
        InputFileError: see the module docstring.
    """
    plans = check_shards(files, fields)
    left = limit  # rows still to read, skipped ones included
    for f, plan in zip(files, plans):
        if plan is None:
            continue
        row = 0
        for batch in FORMATS.lookup(f.format).batches(f, plan):
            if left is not None:
                if left <= 0:
                    return
                batch = batch.slice(0, left) if batch.num_rows > left else batch
                left -= batch.num_rows
            n = batch.num_rows
            if skip >= n:
                skip -= n
                row += n
                continue
            if skip:
                batch, row, skip = batch.slice(skip), row + skip, 0
            yield _normalize(batch, f, fields, row)
            row += batch.num_rows


def hash_file(path: str | os.PathLike) -> str:
    """The BLAKE2b-128 hex digest of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        while block := fh.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def describe_inputs(files: Sequence[InputFile], whole: bool = True
                    ) -> list[dict[str, object]]:
    """``{"name", "path", "format", "size", "blake2b"}`` per file: the data's fingerprint;
    ``whole=False`` (only the first rows are read) hashes nothing: ``blake2b`` is None and
    ``mtime_ns`` tells a changed file."""
    return [{"name": f.name, "path": str(f.path.resolve()), "format": f.format, "size": f.size,
             **({"blake2b": hash_file(f.path)} if whole else
                {"blake2b": None, "mtime_ns": f.path.stat().st_mtime_ns})} for f in files]
