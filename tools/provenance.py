"""What each tool output was made from: recorded once next to it, read back by one function.

Every tool writes its resolved arguments next to its output as ``<tool>_config.json``
(:func:`write_config`); a training run records its inputs in
``resolved_dattri_ds_config.json`` (``Source.training_record``). :func:`training_data` is
the one place that answers "which documents were the training data": the flag when given,
else the first record that names them, in this order:

1. the attribution's own record (``attribute_config.json``: its ``--train-data`` or
   ``--data-path``, else the store it read);
2. the store's collect record (``collect_config.json`` in the store folder or its parent:
   collect's ``--data`` or ``--data-path``, ``--max-docs``, ``--seq-len``, ``--packing``),
   else the ``data`` record in the store's manifest (a store written during training);
3. the source's own record (a launch/train.py run's ``train.data_path`` or
   ``train.train_data``, and ``max_docs``).

The data is jsonl files (``--data``) or prepared data (``--data-path``: prefixes of
``dattri-ds prepare``, the blend form ``W1 A W2 B`` included). A recorded file or prefix is
found from the current folder or the project's and recorded as an absolute path (found from
any folder later); a flag's value is used as given.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dattri_ds.data.packed import blend_weight
from dattri_ds.data.prepared import PreparedPaths
from dattri_ds.errors import ConfigError
from dattri_ds.io.files import read_json
from dattri_ds.store.attach import manifest
from dattri_ds.store.format import INFO_NAME, store_files

if TYPE_CHECKING:
    from dattri_ds.tools.sources.base import Source

__all__ = ["write_config", "recorded_config", "DataOrigin", "training_data", "recorded_origin",
           "recorded_data", "as_files", "positive_int", "JSONL", "PREPARED", "TRUNCATED"]

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


#: ``DataOrigin.kind`` of jsonl documents (or token ids) and of prepared data.
JSONL, PREPARED = "jsonl", "prepared"
#: The packing a data record names for jsonl rows: one example per document, its first
#: ``seq_len`` tokens.
TRUNCATED = "truncated"


@dataclass(frozen=True)
class DataOrigin:
    """Training data and where it was named: by a flag, or in a record.

    Attributes:
        files: the jsonl files, in order; for prepared data its data path (prefixes, the
            blend form with its weights).
        max_docs: documents (prepared data: examples) to read (None: every one).
        seq_len: the sequence length a record says they were read at (None: unknown).
        where: the flag that gave them, or who recorded them ("the run's training data").
        record: the record file and the key holding them there (None: given by the flag).
        kind: ``jsonl`` or ``prepared`` (``tools.datasets.open_data`` reads each).
        packing: prepared data's packing as given or recorded (None: the default).
    """

    files: tuple[str, ...]
    max_docs: int | None = None
    seq_len: int | None = None
    where: str = ""
    record: tuple[Path, str] | None = None
    kind: str = JSONL
    packing: str | None = None

    @property
    def data(self) -> str | list[str]:
        """One file as a string, several as a list (as the tools record ``--data``)."""
        return self.files[0] if len(self.files) == 1 else list(self.files)

    @property
    def flag(self) -> str:
        """The flag that names data of this kind."""
        return "--data-path" if self.kind == PREPARED else "--data"

    def describe(self, n: int) -> str:
        """``FILE (N documents, the run's training data)`` for a tool's first line."""
        files = " ".join(self.files)
        unit = "examples" if self.kind == PREPARED else "documents"
        return f"{files} ({n} {unit})" if self.record is None else \
            f"{files} ({n} {unit}, {self.where})"


def training_data(flag: str, given: str | list[str] | None = None, *,
                  data_path: list[str] | None = None, packing: str | None = None,
                  max_docs: int | None = None, source: Source | None = None,
                  store: str | os.PathLike | None = None,
                  attribution: str | os.PathLike | None = None) -> DataOrigin:
    """The training data a tool reads: ``given`` (the value of ``flag``: jsonl) or
    ``data_path`` (``--data-path``: prepared), else the first record naming them (module
    docstring: the order). ``max_docs`` and ``packing`` (flags) win over recorded ones;
    ``seq_len`` is the store's record's when there is one.

    Raises:
        ConfigError: both ``given`` and ``data_path``; none and no record names the data
            (``flag`` and every place looked in named); a recorded file is found neither
            from the current folder nor the project's (the record and ``flag`` named).
    """
    if given and data_path:
        raise ConfigError(f"Give one of {flag} (jsonl) and --data-path (prepared data), not "
                          f"both")
    if given or data_path:
        rec = _store_record(store) if store is not None else None
        files = tuple(data_path) if data_path else (given,) if isinstance(given, str) \
            else tuple(given)
        return DataOrigin(files, max_docs, rec.seq_len if rec else None,
                          "--data-path" if data_path else flag,
                          kind=PREPARED if data_path else JSONL,
                          packing=packing or (rec.packing if rec else None))
    looked: list[str] = []
    found = None
    if attribution is not None:
        found, recorded_store = _attribution_record(Path(attribution))
        store = store if store is not None else recorded_store
        looked.append(f"{Path(attribution) / 'attribute_config.json'} (attribute's "
                      f"--train-data)")
    if found is None and store is not None:
        found = _store_record(store)
        looked.append(f"collect_config.json next to the store {store} (collect's --data), "
                      f"the store's data record")
    if found is None and source is not None:
        found = source.training_record()
        looked.append(f"{source.root} (only a launch/train.py run records its training data, "
                      f"in resolved_dattri_ds_config.json)")
    if found is None:
        raise ConfigError(f"{flag} is needed: no record names the training data "
                          f"({'; '.join(looked)}). Fix: pass {flag} the jsonl of the training "
                          f"documents (or token ids), or --data-path the prepared data")
    return replace(found, files=tuple(_find(f, found, flag) for f in found.files),
                   max_docs=max_docs if max_docs is not None else found.max_docs,
                   packing=packing or found.packing)


def recorded_data(origin: DataOrigin) -> tuple[str | list[str] | None, list[str] | None]:
    """``(--data, --data-path)`` as a tool records what it read (the other one None)."""
    return (None, list(origin.files)) if origin.kind == PREPARED else (origin.data, None)


def recorded_origin(rec: dict, record: Path, where: str, *, jsonl_key: str = "data",
                    path_key: str = "data_path", prefix: str = "") -> DataOrigin | None:
    """The data a tool or run record names: ``path_key`` (prepared data) or ``jsonl_key``
    (jsonl files), with its ``max_docs``, ``seq_len`` and ``packing``; None when it names
    neither. ``prefix`` is how the keys are shown (``train.``)."""
    prepared, files = as_files(rec.get(path_key)), as_files(rec.get(jsonl_key))
    if not (prepared or files):
        return None
    packing = rec.get("packing") if isinstance(rec.get("packing"), str) else None
    return DataOrigin(tuple(prepared or files), positive_int(rec.get("max_docs")),
                      positive_int(rec.get("seq_len")), where,
                      (record, prefix + (path_key if prepared else jsonl_key)),
                      PREPARED if prepared else JSONL, packing)


def _attribution_record(att: Path) -> tuple[DataOrigin | None, str | None]:
    """Attribute's recorded ``--train-data`` / ``--data-path`` (None when it had none) and
    its ``--store``."""
    rec = recorded_config(att, "attribute")
    store = rec.get("store") if isinstance(rec.get("store"), str) else None
    found = recorded_origin(rec, att / "attribute_config.json", "attribute's --train-data",
                            jsonl_key="train_data")
    return (replace(found, max_docs=None) if found else None), store


def _store_record(store: str | os.PathLike) -> DataOrigin | None:
    """Collect's recorded ``--data`` / ``--data-path`` of a store: in the store folder, else
    its parent (the folder of per-checkpoint stores collect wrote); else the data record of
    the store's manifest (a store written during training)."""
    for folder in (Path(store), Path(store).parent):
        found = recorded_origin(recorded_config(folder, "collect"),
                                folder / "collect_config.json", "collect's --data")
        if found is not None:
            return found
    return _manifest_record(Path(store))


def _manifest_record(root: Path) -> DataOrigin | None:
    """The ``data`` record of the store at ``root`` (or of the first store below it)."""
    folders = [root] + (sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir()
                        else [])
    for folder in folders:
        found = manifest(folder) if store_files(folder) else None
        data = found[0].data if found else None
        if isinstance(data, dict) and as_files(data.get("data_path")):
            kind = JSONL if data.get("packing") == TRUNCATED else PREPARED
            return DataOrigin(tuple(data["data_path"]), None, positive_int(data.get("seq_len")),
                              "the store's data record", (folder / INFO_NAME, "spec.data"),
                              kind, None if kind == JSONL else data.get("packing"))
    return None


def _find(f: str, rec: DataOrigin, flag: str) -> str:
    """A recorded file (or prepared prefix; a blend weight is kept) found from the current
    folder or the project's, made absolute."""
    exists = (lambda p: p.is_file()) if rec.kind == JSONL else _is_prefix
    if rec.kind == PREPARED and blend_weight(f) is not None:
        return f
    path = next((p for p in (Path(f), PROJECT / f) if exists(p)), None)
    if path is None:
        path_, key = rec.record or ("", "")
        raise ConfigError(f"{rec.where[0].upper()}{rec.where[1:]} '{f}' ({path_}: {key}) "
                          f"is not found from {Path.cwd()} nor {PROJECT}. Fix: pass "
                          f"{rec.flag if rec.kind == PREPARED else flag} the "
                          f"{'prepared data' if rec.kind == PREPARED else 'jsonl'} of those "
                          f"documents")
    return str(path.resolve())


def _is_prefix(p: Path) -> bool:
    paths = PreparedPaths.of(p)
    return paths.manifest.is_file() or paths.idx.is_file()
