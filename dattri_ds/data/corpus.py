"""Local JSONL documents (``{"id", "source", "title", "text"}``), read offline and validated.

One document per line. Extra keys (``question``, ``answer``, ...) are ignored; a missing
required key, a non-string value, an empty text or a repeated ``id`` is an error that names
the file and line.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dattri_ds.errors import ConfigError, InputFileError
from dattri_ds.io.files import check_file, iter_json_lines

__all__ = ["Document", "FIELDS", "load_documents", "iter_jsonl", "source_counts"]

#: Keys every document must have, all strings.
FIELDS = ("id", "source", "title", "text")
_EXPECTED = f"one JSON object per line with string keys {list(FIELDS)}"
_FIX = 'write one {"id", "source", "title", "text"} object per line (see data/README.md)'


@dataclass(frozen=True)
class Document:
    """One text document and the metadata used to report attribution results.

    Attributes:
        id: unique within a loaded collection, e.g. ``shakespeare-17``.
        source: domain label (``shakespeare``, ``python_code``, ...) for precision@k by source.
        title: the work the text comes from (play, novel, module path, ...).
        text: the document text, unmodified.
    """

    id: str
    source: str
    title: str
    text: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def preview(self, chars: int = 100) -> str:
        """The first ``chars`` characters on one line (newlines shown as spaces)."""
        return " ".join(self.text[:chars].split())


def _document(row: dict, where: str) -> Document:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with keys {list(FIELDS)}, "
                          f"got {type(row).__name__}")
    missing = [k for k in FIELDS if k not in row]
    if missing:
        raise ConfigError(f"{where}: document lacks key(s) {missing}; every line needs "
                          f"{list(FIELDS)} (see data/README.md)")
    bad = [k for k in FIELDS if not isinstance(row[k], str)]
    if bad:
        raise ConfigError(f"{where}: key(s) {bad} must be strings, got "
                          f"{[type(row[k]).__name__ for k in bad]}")
    if not row["text"]:
        raise ConfigError(f"{where}: document '{row['id']}' has an empty text")
    return Document(row["id"], row["source"], row["title"], row["text"])


def iter_jsonl(path: str | os.PathLike, what: str = "document file") -> Iterator[Document]:
    """Documents of one JSONL file in file order (blank lines are skipped), read through
    :mod:`dattri_ds.io.files` (UTF-8, BOM stripped, line cap).

    Raises:
        InputFileError: the file is missing, not UTF-8, or a line is not valid JSON (file,
            line and fix named).
        ConfigError: a line is not a valid document.
    """
    for lineno, row in iter_json_lines(path, what, expected=_EXPECTED, fix=_FIX):
        yield _document(row, f"{Path(path)}:{lineno}")


def load_documents(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Document]:
    """Load documents from one or more local JSONL files (concatenated), in file order.

    Returns:
        The documents, ids unique across all files.

    Raises:
        InputFileError: a path is missing (or a folder, a dangling symlink, ...), a file
            holds no document, or a line is not UTF-8 JSON (file and line named).
        ConfigError: a malformed document, or a repeated id.
    """
    path_list = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    docs: list[Document] = []
    seen: dict[str, Path] = {}
    for p in map(Path, path_list):
        check_file(p, "document file", "pass an existing .jsonl file of documents")
        n_file = 0
        for doc in iter_jsonl(p):
            n_file += 1
            if doc.id in seen:
                raise ConfigError(f"Document id '{doc.id}' appears twice ({seen[doc.id]} and "
                                  f"{p}); ids must be unique across the loaded files")
            seen[doc.id] = p
            docs.append(doc)
        if n_file == 0:
            raise InputFileError(f"document file '{p}' holds no documents (it is empty or "
                                 f"blank); expected {_EXPECTED}. Fix: {_FIX}")
    return docs


def source_counts(docs: Iterable[Document]) -> dict[str, int]:
    """Number of documents per source, sources sorted by name."""
    return dict(sorted(Counter(d.source for d in docs).items()))
