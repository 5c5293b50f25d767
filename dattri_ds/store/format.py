"""On-disk layout of a gradient store: manifest (``info.json``), shard files, checksums, atomic
JSON. The layout, the commit record and what the checksums detect: docs/store.md, "On-disk
layout". An edit made outside dattri-ds reads as corruption (StoreCorruptError), never as a
configuration mismatch (StoreMismatchError)."""

from __future__ import annotations

import hashlib
import json
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


import numpy as np
import torch

from dattri_ds.errors import DuplicateSampleError, StoreCorruptError, StoreMismatchError  # noqa: F401
from dattri_ds.io.outputs import write_json_atomic

__all__ = [
    "FORMAT_VERSION", "StoreCorruptError", "DuplicateSampleError", "ShardPaths", "Chunk",
    "ShardIndex", "shard_paths", "list_shards", "read_json", "save_info",
    "load_info", "to_storage", "from_storage", "numpy_dtype", "torch_dtype", "row_bytes",
    "digest", "check_sizes", "read_committed_ids", "verify_chunk", "verify_data",
    "json_checksum", "store_files",
]

#: 2: manifest with capture semantics, provenance, completion record and self-checksums.
FORMAT_VERSION = 2
INFO_NAME = "info.json"
META_COLUMNS = 2
_NUMPY = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<i2")}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ShardPaths:
    """The files of one shard (``lock`` only guards against two writers of one shard)."""

    rank: int
    data: Path
    ids: Path
    meta: Path
    index: Path
    lock: Path


def shard_paths(root: str | Path, rank: int) -> ShardPaths:
    stem = Path(root) / f"shard-{rank:05d}"
    return ShardPaths(rank, stem.with_suffix(".data"), stem.with_suffix(".ids"),
                      stem.with_suffix(".meta"), stem.with_suffix(".index.json"),
                      stem.with_suffix(".lock"))


def list_shards(root: str | Path) -> list[ShardPaths]:
    """Shards with an index, in rank order (a data file without index holds no commit)."""
    ranks = sorted(int(p.name[len("shard-"):-len(".index.json")])
                   for p in Path(root).glob("shard-*.index.json")
                   if p.name[len("shard-"):-len(".index.json")].isdigit())
    return [shard_paths(root, r) for r in ranks]


def store_files(root: str | Path) -> list[Path]:
    """Files that only a store holds (manifest, shard files): a directory with any of them
    is a store, even when some of them were deleted."""
    root = Path(root)
    found = sorted(root.glob("shard-*.data")) + sorted(root.glob("shard-*.index.json"))
    return ([root / INFO_NAME] if (root / INFO_NAME).exists() else []) + found


def json_checksum(obj: dict[str, Any]) -> str:
    """``blake2b:<hex>`` of the canonical JSON of ``obj`` without its ``checksum`` key."""
    body = {k: v for k, v in obj.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "blake2b:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _check_self(path: Path, obj: Any, what: str) -> None:
    """Raise StoreCorruptError unless ``obj`` is a dict whose checksum matches its content."""
    if not isinstance(obj, dict):
        raise StoreCorruptError(f"{what} '{path}' holds {type(obj).__name__}, not an object: "
                                f"it was damaged outside dattri-ds; {_fix_for(path)}")
    if obj.get("checksum") != json_checksum(obj):
        raise StoreCorruptError(
            f"{what} '{path}' fails its checksum (stored {obj.get('checksum')!r}, computed "
            f"{json_checksum(obj)}): it was edited or damaged outside dattri-ds after it was "
            f"written; {_fix_for(path)}")


def _fix_for(path: Path) -> str:
    """The repair advice for a damaged file (only ever the file's own shard or store)."""
    if path.name == INFO_NAME:
        return (f"restore it from a backup, or delete the store directory '{path.parent}' "
                f"and collect it again (its shards cannot be trusted without it)")
    stem = path.name.split(".")[0]
    return (f"restore it, or delete the {stem}.* files so a resumed run recomputes that "
            f"shard's examples")


def digest(buf: bytes | memoryview | np.ndarray) -> str:
    """``crc32:<8 hex>`` of a buffer (numpy arrays must be C-contiguous)."""
    return f"crc32:{zlib.crc32(memoryview(buf)) & 0xFFFFFFFF:08x}"


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise StoreCorruptError(f"Gradient store file '{path}' is missing (deleted while the "
                                f"store was in use?); {_fix_for(path)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreCorruptError(f"Gradient store file '{path}' is not valid JSON ({e}); it was "
                                f"damaged outside dattri-ds: {_fix_for(path)}") from e


def save_info(root: Path, spec_json: dict[str, Any], dtype: str, fsync: bool,
              complete: dict[str, Any] | None = None) -> None:
    """Write the manifest (with its checksum); ``complete`` is the record of ``seal``."""
    info = {"format_version": FORMAT_VERSION, "dtype": dtype, "spec": spec_json,
            "complete": complete}
    info = json.loads(json.dumps(info))  # the checksum covers what a reader will load
    info["checksum"] = json_checksum(info)
    write_json_atomic(root / INFO_NAME, info, fsync)


def load_info(root: Path) -> dict[str, Any] | None:
    """The manifest, or None when the directory holds no store yet.

    Raises:
        StoreCorruptError: the manifest is unreadable or fails its checksum, or it is
            missing while shard files are present (the file is named).
        StoreMismatchError: another format version wrote it.
    """
    path = root / INFO_NAME
    if not path.exists():
        others = [f for f in store_files(root) if f.name != INFO_NAME]
        # re-check: another rank's first writer may have created the manifest (and then its
        # shard) between the two looks; only shard files without a manifest are damage
        if others and not path.exists():
            raise StoreCorruptError(
                f"Gradient store '{root}' has shard files ({others[0].name}, ...) but its "
                f"manifest '{path}' is missing: it was deleted. Restore it, or delete the "
                f"directory and collect the store again")
        if not path.exists():
            return None
    info = read_json(path)
    version = info.get("format_version") if isinstance(info, dict) else None
    if isinstance(version, int) and version != FORMAT_VERSION and "checksum" not in info:
        raise StoreMismatchError(
            f"Gradient store '{root}' has format_version {version!r}, this dattri-ds reads "
            f"version {FORMAT_VERSION}: collect the store again with this version (or use "
            f"the dattri-ds that wrote it)")
    _check_self(path, info, "Manifest")
    if version != FORMAT_VERSION:
        raise StoreMismatchError(
            f"Gradient store '{root}' has format_version {version!r}, this dattri-ds reads "
            f"version {FORMAT_VERSION}: upgrade dattri-ds or collect the store again")
    return info


def row_bytes(width: int, dtype: str) -> int:
    return width * _NUMPY[dtype].itemsize


def to_storage(rows: torch.Tensor, dtype: str) -> np.ndarray:
    """``[n, P]`` CPU tensor already in ``dtype`` -> the C-contiguous numpy array to write."""
    rows = rows.contiguous()
    if dtype == "bfloat16":
        return rows.view(torch.int16).numpy()
    return rows.numpy().astype(_NUMPY[dtype], copy=False)


def from_storage(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """Storage array ``[n, P]`` -> tensor in ``dtype``, no copy (a read-only memory-map
    view stays read-only: torch's warning about it is silenced here)."""
    if arr.flags.writeable:
        t = torch.from_numpy(arr)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def numpy_dtype(dtype: str) -> np.dtype:
    return _NUMPY[dtype]


def torch_dtype(dtype: str) -> torch.dtype:
    return _TORCH[dtype]


@dataclass(frozen=True)
class Chunk:
    """One commit: its row and ids-byte counts and the digests of the bytes it appended to
    each file."""

    rows: int
    id_bytes: int
    data: str
    ids: str
    meta: str


@dataclass
class ShardIndex:
    """The commit record of one shard (the content of ``shard-XXXXX.index.json``)."""

    rank: int
    world: int
    spec_digest: str
    rows: int = 0
    ids_bytes: int = 0
    chunks: list[Chunk] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = {"format_version": FORMAT_VERSION, "rank": self.rank, "world": self.world,
             "spec_digest": self.spec_digest, "rows": self.rows, "ids_bytes": self.ids_bytes,
             "chunks": [[c.rows, c.id_bytes, c.data, c.ids, c.meta] for c in self.chunks]}
        d["checksum"] = json_checksum(d)
        return d

    @classmethod
    def load(cls, path: Path, rank: int | None = None) -> ShardIndex:
        """Read and check an index (``rank``: the shard number its file name gives)."""
        d = read_json(path)
        _check_self(path, d, "Shard index")
        try:
            idx = cls(rank=int(d["rank"]), world=int(d["world"]), spec_digest=d["spec_digest"],
                      rows=int(d["rows"]), ids_bytes=int(d["ids_bytes"]),
                      chunks=[Chunk(int(c[0]), int(c[1]), *c[2:5]) for c in d["chunks"]])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise StoreCorruptError(f"Shard index '{path}' is malformed ({e!r})") from e
        if (sum(c.rows for c in idx.chunks) != idx.rows
                or sum(c.id_bytes for c in idx.chunks) != idx.ids_bytes):
            raise StoreCorruptError(f"Shard index '{path}' is inconsistent: its chunks do not sum "
                                    f"to the {idx.rows} rows / {idx.ids_bytes} id bytes it commits")
        if rank is not None and idx.rank != rank:
            raise StoreCorruptError(
                f"Shard index '{path}' belongs to shard {idx.rank}, not {rank}: index files "
                f"were renamed or swapped; {_fix_for(path)}")
        return idx


def check_sizes(paths: ShardPaths, index: ShardIndex, row_nbytes: int) -> None:
    """Raise StoreCorruptError naming the first file shorter than what the index commits.

    Files may be *longer* (an uncommitted tail from a crash or a writer still running).
    """
    need = {paths.data: index.rows * row_nbytes, paths.ids: index.ids_bytes,
            paths.meta: index.rows * META_COLUMNS * 8}
    for path, n in need.items():
        size = path.stat().st_size if path.exists() else -1
        if size < n:
            have = "is missing" if size < 0 else f"has {size} bytes"
            raise StoreCorruptError(
                f"Shard file '{path}' {have} but its index '{paths.index.name}' commits "
                f"{index.rows} rows = {n} bytes: the file was truncated or deleted. Restore it, "
                f"or delete all shard-{paths.rank:05d}.* files so a resumed run recomputes them")


def read_committed_ids(paths: ShardPaths, index: ShardIndex) -> tuple[list[str], np.ndarray]:
    """Committed ids and meta ``[N, 2]`` of a shard, checked against the chunk digests.

    Raises:
        StoreCorruptError: a file is short or a checksum fails (the file is named).
    """
    with open(paths.ids, "rb") as f:
        raw_ids = f.read(index.ids_bytes)
    meta = np.fromfile(paths.meta, dtype="<i8", count=index.rows * META_COLUMNS)
    meta = meta.reshape(index.rows, META_COLUMNS)
    if len(raw_ids) != index.ids_bytes or meta.shape[0] != index.rows:
        raise StoreCorruptError(f"Shard '{paths.index}' commits more than its files hold")
    id_pos, row = 0, 0
    for i, c in enumerate(index.chunks):
        _verify(paths.ids, i, digest(raw_ids[id_pos:id_pos + c.id_bytes]), c.ids)
        _verify(paths.meta, i, digest(np.ascontiguousarray(meta[row:row + c.rows])), c.meta)
        id_pos, row = id_pos + c.id_bytes, row + c.rows
    ids = raw_ids.decode("utf-8").split("\n")[:-1] if raw_ids else []
    if len(ids) != index.rows:
        raise StoreCorruptError(f"Shard file '{paths.ids}' holds {len(ids)} ids for "
                                f"{index.rows} committed rows")
    return ids, meta


def _verify(path: Path, chunk: int, got: str, want: str) -> None:
    if got != want:
        raise StoreCorruptError(
            f"Checksum mismatch in shard file '{path}' (commit #{chunk}): stored {want}, "
            f"computed {got}. The file was modified or damaged on disk; {_fix_for(path)}")


def verify_chunk(path: Path, chunk: int, buf: np.ndarray, want: str) -> None:
    """Check one commit's data bytes (``buf`` C-contiguous) against its digest."""
    _verify(path, chunk, digest(buf), want)


def verify_data(paths: ShardPaths, index: ShardIndex, row_nbytes: int) -> None:
    """Check every committed commit of the data file against its digest (one read pass).

    Raises:
        StoreCorruptError: naming the data file and the first damaged commit.
    """
    with open(paths.data, "rb") as f:
        for i, c in enumerate(index.chunks):
            buf = f.read(c.rows * row_nbytes)
            if len(buf) != c.rows * row_nbytes:
                raise StoreCorruptError(f"Shard file '{paths.data}' ends inside commit #{i}: "
                                        f"it was truncated; {_fix_for(paths.data)}")
            _verify(paths.data, i, digest(buf), c.data)
