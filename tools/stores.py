"""Where a tool finds the stores and factors of each checkpoint, and what a store records of
the model it was collected from."""

from __future__ import annotations

from pathlib import Path

from dattri_ds.errors import ConfigError, StoreMismatchError
from dattri_ds.store import weights_hash
from dattri_ds.store.attach import manifest, model_layers
from dattri_ds.store.format import store_files
from dattri_ds.tools.sources.base import Source
from dattri_ds.tools.sources.flags import source_flags

__all__ = ["store_paths", "store_of", "store_origin", "factors_path", "check_factors",
           "check_data", "data_flags"]


def store_paths(root: Path) -> dict[str, Path]:
    """Checkpoint tag -> store path under ``root`` (or ``root`` itself when it is a store,
    tagged by the checkpoint its manifest records, else by its folder name).

    A directory holding a manifest or any shard file is a store, so a store whose
    ``info.json`` was deleted is found (and refused when it is attached), never skipped.

    Raises:
        ConfigError: ``root`` holds no store.
        StoreCorruptError: ``root`` is a store with a damaged manifest (named).
    """
    if store_files(root):
        found = manifest(root)
        return {(found[0].checkpoint if found else None) or root.name: root}
    stores = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and store_files(p)} \
        if root.is_dir() else {}
    if not stores:
        raise ConfigError(f"'{root}' holds no gradient store: run tools/collect.py --out {root}")
    return stores


def store_of(root: Path, tag: str, flag: str = "--store") -> Path:
    """The store of checkpoint ``tag``: ``root`` itself when it is a store (its manifest then
    says which checkpoint it holds), else ``root/<tag>``.

    Raises:
        ConfigError: neither is a store (the expected path named).
    """
    if store_files(root):
        return root
    if store_files(root / tag):
        return root / tag
    raise ConfigError(f"{flag} {root}: no gradient store for checkpoint '{tag}' (expected "
                      f"'{root}' or '{root / tag}' to hold one); collect it with "
                      f"tools/collect.py --checkpoints {tag} --out {root}")


def store_origin(source: Source, tag: str, model) -> dict:
    """Where a store of checkpoint ``tag`` comes from (``StoreRequest.origin``): the model
    family at that tag, the run id, the tag and a hash of the model's weights."""
    return {"fingerprint": f"{source.fingerprint()}@{tag}", "run_id": source.run_id,
            "checkpoint": tag, "weights_hash": weights_hash(model)}


def factors_path(factors: str | None, tag: str) -> Path | None:
    """``--factors``: a file, or a folder of ``<tag>.pt`` (``fit --checkpoint all``)."""
    path = Path(factors) if factors else None
    return path / f"{tag}.pt" if path is not None and path.is_dir() else path


def check_factors(factors, path, model, args) -> None:
    """Refuse curvature factors fitted on a model of other layer shapes before any work
    (the fix names the tool's source flags, ``args``).

    Raises:
        ConfigError: one line naming the factors file, the first differing layer with both
            shapes, and the fix (fit on this model, or pass the model they were fitted on).
    """
    have, source = model_layers(model), source_flags(args)
    diff = [(n, tuple(lf.shape), tuple(have[n][1])) for n, lf in factors.layers.items()
            if n in have and tuple(have[n][1]) != tuple(lf.shape)]
    if not diff and not any(n in have for n in factors.layers):
        diff = [(next(iter(factors.layers)), "a layer", "absent")]
    if diff:
        name, theirs, ours = diff[0]
        raise ConfigError(
            f"--factors {path} were fitted on another model: layer '{name}' is {theirs} there "
            f"and {ours} in {source} ({len(diff)} layer(s) differ). Fix: fit factors on this "
            f"model (tools/fit.py {source} --out <file or dir>), or pass the model the factors "
            f"were fitted on")


def data_flags(record: dict) -> str:
    """The flags that read the data of a ``data`` record (a fix repeats them)."""
    paths = " ".join(record.get("data_path") or [])
    if record.get("packing") == "truncated":
        return f"--data {paths} --seq-len {record.get('seq_len')}"
    return (f"--data-path {paths} --seq-len {record.get('seq_len')} --packing "
            f"{record.get('packing')}")


def _describe(record: dict) -> str:
    return (f"fingerprint {record.get('fingerprint')} ({' '.join(record.get('data_path') or [])}, "
            f"seq_len {record.get('seq_len')}, packing {record.get('packing')})")


def check_data(stores: dict[str, Path], data, consumer: str, fix: str) -> None:
    """Refuse stores computed on other data than ``data`` (a ``ToolData``: its ``record()``
    is read only when a store records data to compare it with), before anything is read or
    written; a store that records no data (written by the library without one, or before
    stores recorded it) is not compared.

    Raises:
        StoreMismatchError: one line naming the store, both data records and the fix: the
            flags that read the store's data, or ``fix``.
    """
    for path in stores.values():
        found = manifest(path)
        stored = found[0].data if found else None
        if stored is None:
            continue
        record = data.record()
        if stored.get("fingerprint") != record["fingerprint"]:
            raise StoreMismatchError(
                f"Gradient store '{path}' was computed on other data than {consumer} reads: "
                f"stored {_describe(stored)}, requested {_describe(record)}. Fix: pass "
                f"{data_flags(stored)} (the store's data), or {fix}")
