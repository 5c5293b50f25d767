"""The document table of a prepared corpus: one row per document, memory-mapped.

A folder (``PREFIX.docs/``) of NumPy files, row ``i`` = document ``i`` of ``PREFIX.bin``:

* ``tokens.npy``: int64 ``[N + 1]``, document ``i``'s tokens are ``[tokens[i], tokens[i+1])``
  of the concatenated token stream (its length is the ``.idx`` sequence length);
* ``id``, ``source``, ``title``: variable-length UTF-8 strings, each as ``<field>.offsets.npy``
  (int64 ``[N + 1]``) into one blob ``<field>.bytes``;
* ``id_hash.npy`` / ``text_hash.npy``: uint64 ``[N]``, the first 8 bytes (little-endian) of
  the BLAKE2b digest of the id / text (UTF-8), to find a document by id (``id_order.npy``:
  the rows sorted by ``id_hash``) and to find the same text in another corpus.

Prepare's workers write one part per chunk (:func:`write_part`, an ``.npz``); the parts are
concatenated once (:func:`merge_parts`), streamed, never held whole. :class:`DocumentTable`
reads the folder with ``mmap_mode="r"``: opening it reads nothing.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dattri_ds.errors import InputFileError

__all__ = ["STRING_FIELDS", "DocumentTable", "write_part", "merge_parts", "hash64"]

#: The string columns of the table.
STRING_FIELDS = ("id", "source", "title")
_FIX = "rerun dattri-ds prepare (the table is damaged or incomplete)"


def hash64(data: bytes) -> int:
    """The table's 64-bit hash of a string's UTF-8 bytes (BLAKE2b, first 8 bytes)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _string_column(arr) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets [n + 1] int64 from 0, blob uint8)`` of a pyarrow string array, copied from
    its buffers (no Python string per row)."""
    import pyarrow as pa

    arr = arr.cast(pa.large_string()) if not pa.types.is_large_string(arr.type) else arr
    bufs = arr.buffers()
    off = np.frombuffer(bufs[1], dtype=np.int64)[arr.offset: arr.offset + len(arr) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else \
        np.zeros(0, np.uint8)
    return off - off[0], data[off[0]:off[-1]].copy()


def write_part(path: str | os.PathLike, batch, lengths: Sequence[int]) -> None:
    """Write one chunk's rows (a ``DOC_SCHEMA`` record batch and its documents' token
    counts) to ``path`` (an ``.npz``; the caller makes it atomic)."""
    arrays: dict[str, np.ndarray] = {"lengths": np.asarray(lengths, dtype=np.int64)}
    for field in (*STRING_FIELDS, "text"):
        off, blob = _string_column(batch.column(field))
        if field != "text":
            arrays[f"{field}_offsets"], arrays[f"{field}_bytes"] = off, blob
        key = {"id": "id_hash", "text": "text_hash"}.get(field)
        if key:
            raw = blob.tobytes()
            arrays[key] = np.fromiter((hash64(raw[a:b]) for a, b in zip(off[:-1], off[1:])),
                                      dtype=np.uint64, count=len(off) - 1)
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def merge_parts(parts: Sequence[Path], n_docs: int, out: Path) -> None:
    """Concatenate the parts (in order) into the table folder ``out`` (created), streaming
    one part at a time; ``id_order.npy`` is sorted last. Every file is fsynced."""
    from numpy.lib.format import open_memmap

    out.mkdir(parents=True, exist_ok=True)
    tokens = open_memmap(out / "tokens.npy", mode="w+", dtype=np.int64, shape=(n_docs + 1,))
    hashes = {k: open_memmap(out / f"{k}.npy", mode="w+", dtype=np.uint64, shape=(n_docs,))
              for k in ("id_hash", "text_hash")}
    offsets = {f: open_memmap(out / f"{f}.offsets.npy", mode="w+", dtype=np.int64,
                              shape=(n_docs + 1,)) for f in STRING_FIELDS}
    blobs = {f: open(out / f"{f}.bytes", "wb") for f in STRING_FIELDS}
    row, base = 0, {f: 0 for f in ("tokens", *STRING_FIELDS)}
    tokens[0] = 0
    for f in STRING_FIELDS:
        offsets[f][0] = 0
    try:
        for part in parts:
            with np.load(part) as z:
                n = len(z["lengths"])
                tokens[row + 1: row + n + 1] = base["tokens"] + np.cumsum(z["lengths"])
                base["tokens"] = int(tokens[row + n])
                for k, arr in hashes.items():
                    arr[row: row + n] = z[k]
                for f in STRING_FIELDS:
                    offsets[f][row + 1: row + n + 1] = base[f] + z[f"{f}_offsets"][1:]
                    base[f] += int(z[f"{f}_offsets"][-1])
                    blobs[f].write(z[f"{f}_bytes"].tobytes())
            row += n
    finally:
        for fh in blobs.values():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
    if row != n_docs:
        raise InputFileError(f"document table parts hold {row} documents, expected {n_docs}. "
                             f"Fix: {_FIX}")
    order = np.argsort(hashes["id_hash"], kind="stable")
    np.save(out / "id_order.npy", order)
    for arr in (tokens, *hashes.values(), *offsets.values()):
        arr.flush()
    for f in out.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


class DocumentTable:
    """A document table folder, memory-mapped (nothing is read until asked).

    Args:
        folder: the ``PREFIX.docs`` folder.

    Raises:
        InputFileError: a missing or damaged file (named).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        from dattri_ds.io.files import check_dir

        self.folder = check_dir(folder, "document table folder", _FIX)
        self.tokens = self._npy("tokens.npy")
        self.id_hash = self._npy("id_hash.npy")
        self.text_hash = self._npy("text_hash.npy")
        self.id_order = self._npy("id_order.npy")
        self._off = {f: self._npy(f"{f}.offsets.npy") for f in STRING_FIELDS}
        self._blob = {f: self._bytes(f"{f}.bytes", int(self._off[f][-1])) for f in STRING_FIELDS}
        n = len(self.tokens) - 1
        if any(len(a) != n for a in (self.id_hash, self.text_hash, self.id_order)) or \
                any(len(o) != n + 1 for o in self._off.values()):
            raise InputFileError(f"document table '{self.folder}' has columns of different "
                                 f"lengths. Fix: {_FIX}")

    def _npy(self, name: str) -> np.ndarray:
        p = self.folder / name
        try:
            return np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise InputFileError(f"document table file '{p}' is missing or damaged "
                                 f"({' '.join(str(e).split())[:80]}). Fix: {_FIX}") from None

    def _bytes(self, name: str, size: int) -> np.ndarray:
        p = self.folder / name
        if not p.is_file() or p.stat().st_size != size:
            have = p.stat().st_size if p.is_file() else "no file"
            raise InputFileError(f"document table file '{p}' should hold {size} bytes "
                                 f"({have}). Fix: {_FIX}")
        return np.memmap(p, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.tokens) - 1

    def string(self, field: str, i: int) -> str:
        """Document ``i``'s ``field`` (one of ``STRING_FIELDS``)."""
        off = self._off[field]
        return bytes(self._blob[field][int(off[i]):int(off[i + 1])]).decode("utf-8")

    def id(self, i: int) -> str:
        return self.string("id", i)

    def ids(self, rows: Sequence[int]) -> list[str]:
        return [self.string("id", int(i)) for i in rows]

    def find(self, doc_id: str) -> int | None:
        """The row of document ``doc_id``, or None (a binary search of ``id_order``)."""
        h = np.uint64(hash64(doc_id.encode("utf-8")))
        order, hashes = self.id_order, self.id_hash
        lo, hi = 0, len(order)
        while lo < hi:  # the first position whose hash is >= h
            mid = (lo + hi) // 2
            if hashes[order[mid]] < h:
                lo = mid + 1
            else:
                hi = mid
        while lo < len(order) and hashes[order[lo]] == h:
            if self.id(int(order[lo])) == doc_id:
                return int(order[lo])
            lo += 1
        return None

    def duplicate_ids(self, limit: int = 3) -> list[tuple[str, int, int]]:
        """Up to ``limit`` ids held by two rows: ``(id, first row, second row)`` (reads the
        hash column once)."""
        hashes = np.asarray(self.id_hash)[np.asarray(self.id_order)]
        same = np.nonzero(hashes[1:] == hashes[:-1])[0]
        out = []
        for j in same:
            a, b = sorted((int(self.id_order[j]), int(self.id_order[j + 1])))
            if self.id(a) == self.id(b):
                out.append((self.id(a), a, b))
                if len(out) >= limit:
                    break
        return out
