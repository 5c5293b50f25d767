"""What each tool output was made from: recorded once next to it, read back by one function.

Every tool writes its resolved arguments next to its output as ``<tool>_config.json``
(:func:`write_config`); a training run records its inputs in
``resolved_dattri_ds_config.json`` (``Source.training_record``). :func:`training_data` is
the one place that answers "which documents were the training data": the flag when given,
else the first record that names them, in this order:

1. the attribution's own record (``attribute_config.json``: its ``--train-data``, else the
   store it read);
2. the store's collect record (``collect_config.json`` in the store folder or its parent:
   collect's ``--data``, ``--max-docs``, ``--seq-len``);
3. the source's own record (a launch/train.py run's ``train.train_data`` and ``max_docs``).

A recorded file is found from the current folder or the project's and recorded as an
absolute path (found from any folder later); a flag's value is used as given.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dattri_ds.errors import ConfigError
from dattri_ds.io.files import read_json

if TYPE_CHECKING:
    from dattri_ds.tools.sources.base import Source

__all__ = ["write_config", "recorded_config", "DataOrigin", "training_data", "as_files",
           "positive_int"]

#: The project folder: a recorded relative data path is also looked up from here.
PROJECT = Path(__file__).resolve().parents[1]


def write_config(out: Path, name: str, args) -> None:
    """Write the resolved arguments of a tool next to its output (``<name>_config.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}_config.json").write_text(json.dumps(vars(args), indent=2, default=str) + "\n")


def recorded_config(folder: str | os.PathLike, name: str) -> dict:
    """The resolved arguments ``write_config(folder, name, ...)`` recorded there (``{}`` when
    nothing was), e.g. the ``--data`` collect read a store's rows from."""
    rec = Path(folder) / f"{name}_config.json"
    if not rec.is_file():
        return {}
    got = read_json(rec, f"{name} record", fix=f"remove or repair {rec}")
    return got if isinstance(got, dict) else {}


def as_files(value) -> list[str] | None:
    """A recorded data value as a list of files: one string, or a non-empty list of
    strings; None for anything else (nothing recorded)."""
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(f, str) for f in value):
        return list(value)
    return None


def positive_int(value) -> int | None:
    """``value`` when it is a positive integer (a recorded cap or length), else None."""
    return value if type(value) is int and value > 0 else None


@dataclass(frozen=True)
class DataOrigin:
    """Training documents and where they were named: by a flag, or in a record.

    Attributes:
        files: the jsonl files, in order.
        max_docs: documents to read (None: every one).
        seq_len: the sequence length a record says they were read at (None: unknown).
        where: the flag that gave them, or who recorded them ("the run's training data").
        record: the record file and the key holding them there (None: given by the flag).
    """

    files: tuple[str, ...]
    max_docs: int | None = None
    seq_len: int | None = None
    where: str = ""
    record: tuple[Path, str] | None = None

    @property
    def data(self) -> str | list[str]:
        """One file as a string, several as a list (as the tools record ``--data``)."""
        return self.files[0] if len(self.files) == 1 else list(self.files)

    def describe(self, n: int) -> str:
        """``FILE (N documents, the run's training data)`` for a tool's first line."""
        files = ", ".join(self.files)
        return f"{files} ({n} documents)" if self.record is None else \
            f"{files} ({n} documents, {self.where})"


def training_data(flag: str, given: str | list[str] | None = None, *,
                  max_docs: int | None = None, source: Source | None = None,
                  store: str | os.PathLike | None = None,
                  attribution: str | os.PathLike | None = None) -> DataOrigin:
    """The training documents a tool reads: ``given`` (the value of ``flag``), else the
    first record naming them (module docstring: the order). ``max_docs`` (a flag's) wins
    over a recorded cap; ``seq_len`` is the store's collect record's when there is one.

    Raises:
        ConfigError: no ``given`` and no record names them (``flag`` and every place looked
            in named), or a recorded file is found neither from the current folder nor the
            project's (the record and ``flag`` named).
    """
    if given:
        files = (given,) if isinstance(given, str) else tuple(given)
        rec = _store_record(store) if store is not None else None
        return DataOrigin(files, max_docs, rec.seq_len if rec else None, flag)
    looked: list[str] = []
    found = None
    if attribution is not None:
        found, recorded_store = _attribution_record(Path(attribution))
        store = store if store is not None else recorded_store
        looked.append(f"{Path(attribution) / 'attribute_config.json'} (attribute's "
                      f"--train-data)")
    if found is None and store is not None:
        found = _store_record(store)
        looked.append(f"collect_config.json next to the store {store} (collect's --data)")
    if found is None and source is not None:
        found = source.training_record()
        looked.append(f"{source.root} (only a launch/train.py run records its training data, "
                      f"in resolved_dattri_ds_config.json)")
    if found is None:
        raise ConfigError(f"{flag} is needed: no record names the training data "
                          f"({'; '.join(looked)}). Fix: pass {flag} the jsonl of the training "
                          f"documents (or token ids)")
    return replace(found, files=tuple(_find(f, found, flag) for f in found.files),
                   max_docs=max_docs if max_docs is not None else found.max_docs)


def _attribution_record(att: Path) -> tuple[DataOrigin | None, str | None]:
    """Attribute's recorded ``--train-data`` (None when it had none) and its ``--store``."""
    rec = recorded_config(att, "attribute")
    files = as_files(rec.get("train_data"))
    store = rec.get("store") if isinstance(rec.get("store"), str) else None
    found = DataOrigin(tuple(files), where="attribute's --train-data", record=(
        att / "attribute_config.json", "train_data")) if files else None
    return found, store


def _store_record(store: str | os.PathLike) -> DataOrigin | None:
    """Collect's recorded ``--data`` of a store: in the store folder, else its parent (the
    folder of per-checkpoint stores collect wrote)."""
    for folder in (Path(store), Path(store).parent):
        rec = recorded_config(folder, "collect")
        files = as_files(rec.get("data"))
        if files:
            return DataOrigin(tuple(files), positive_int(rec.get("max_docs")),
                              positive_int(rec.get("seq_len")), "collect's --data",
                              (folder / "collect_config.json", "data"))
    return None


def _find(f: str, rec: DataOrigin, flag: str) -> str:
    """A recorded file found from the current folder or the project's, made absolute."""
    path = next((p for p in (Path(f), PROJECT / f) if p.is_file()), None)
    if path is None:
        path_, key = rec.record or ("", "")
        raise ConfigError(f"{rec.where[0].upper()}{rec.where[1:]} '{f}' ({path_}: {key}) "
                          f"is not found from {Path.cwd()} nor {PROJECT}. Fix: pass {flag} "
                          f"the jsonl of those documents")
    return str(path.resolve())
