"""Damaged gradient stores never answer wrong: every damage raises the right named error or
reads back exactly the undamaged store.

Invariant: for each generated case (truncation at several offsets of every file, bit flips,
deleted and swapped files across shards and checkpoints, edited manifests and indexes, stores
of other runs/checkpoints, empty stores), reading the store either raises the expected
error class -- StoreCorruptError for damage, StoreMismatchError for a valid store of another
configuration/run/checkpoint -- with the damaged file (or store) named in the message, or
returns ids, rows, steps and token counts equal to the undamaged store's. A resumed writer
over damaged files raises instead of keeping them. Zero silent wrong or partial results.

One small store (two checkpoints x two shards, several commits each) is built per module and
copied per case.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dattri_ds.layers import get_kind
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.errors import ConfigError, StoreCorruptError, StoreMismatchError
from dattri_ds.gradient import Dense, GradBatch, LayerGrad
from dattri_ds.ops.projection import ProjectionConfig, stable_seed
from dattri_ds.store import GradientStore, GradientStoreWriter, StoreConfig, StoreSpec, seal_store
from dattri_ds.store.format import json_checksum

PROJ = ProjectionConfig(kind="kronecker", dim=16, seed=3)
LAYERS = [("enc.fc1", "linear", (8, 5), 16), ("head", "linear", (2, 4), 8)]
TAGS = ("step2", "step4")
RUN = "run:aaaa"
WORLD, PER_SHARD, FLUSH = 2, 10, 4
SHARD_FILES = ("data", "ids", "meta", "index.json")
FILES = ("info.json",) + tuple(f"shard-{r:05d}.{s}" for r in range(WORLD) for s in SHARD_FILES)


def _origin(tag: str, run: str = RUN) -> dict[str, str]:
    return {"fingerprint": f"model@{tag}", "run_id": run, "checkpoint": tag,
            "weights_hash": f"blake2b:{tag}"}


def _batch(ids: list[str], tag: str, step: int) -> GradBatch:
    layers = {}
    for name, kind, shape, width in LAYERS:
        vals = torch.stack([torch.randn(width, generator=torch.Generator().manual_seed(
            stable_seed(s, name, tag))) for s in ids])
        layers[name] = LayerGrad(name=name, kind=get_kind(kind), data=Dense(vals), shape=shape,
                                 space=PROJ.tag)
    return GradBatch(step=step, sample_ids=tuple(ids), layers=layers,
                     token_counts=torch.tensor([len(s) for s in ids]))


def build_store(path: Path, tag: str, run: str = RUN, seal: bool = True, rows: int = PER_SHARD
                ) -> None:
    """Two shards of ``rows`` examples, committed every FLUSH rows; sealed when asked."""
    probe = _batch(["probe"], tag, 0)
    spec = StoreSpec.from_batch(probe, projection=PROJ, capture=CaptureConfig(),
                                **_origin(tag, run))
    for rank in range(WORLD):
        w = GradientStoreWriter(StoreConfig(path=str(path), flush_every=FLUSH), spec,
                                rank=rank, world=WORLD)
        ids = [f"doc{rank * rows + i}" for i in range(rows)]
        for step, start in enumerate(range(0, rows, 3)):
            w.append(_batch(ids[start:start + 3], tag, step))
        w.close()
    if seal:
        seal_store(path)


def read_all(root: Path, tag: str) -> tuple:
    """What a scorer sees: every block, the steps and token counts (data checked lazily)."""
    with GradientStore.open(root / tag, require_complete=True, origin=_origin(tag)) as s:
        blocks = [(ids, rows.clone()) for ids, rows in s.iter_blocks(3)]
        ids = tuple(i for b, _ in blocks for i in b)
        rows = torch.cat([r for _, r in blocks]) if blocks else torch.zeros(0)
        return ids, rows, s.steps.tolist(), s.token_counts.tolist()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict[str, tuple]]:
    root = tmp_path_factory.mktemp("pristine")
    for tag in TAGS:
        build_store(root / tag, tag)
    return root, {tag: read_all(root, tag) for tag in TAGS}


# ---- damage generators ------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    damage: Callable[[Path], None]
    error: type[Exception] | None  # None: any named error, or the undamaged result
    names: tuple[str, ...]  # one of these must appear in the error message

    def __repr__(self) -> str:
        return self.name


def _truncate(rel: str, frac: float) -> Callable[[Path], None]:
    def f(root: Path) -> None:
        p = root / TAGS[1] / rel
        n = p.stat().st_size
        with open(p, "r+b") as fh:
            fh.truncate(min(int(n * frac), n - 1))
    return f


def _flip(rel: str, frac: float, bit: int) -> Callable[[Path], None]:
    def f(root: Path) -> None:
        p = root / TAGS[1] / rel
        buf = bytearray(p.read_bytes())
        buf[min(int(len(buf) * frac), len(buf) - 1)] ^= 1 << bit
        p.write_bytes(bytes(buf))
    return f


def _delete(*rels: str) -> Callable[[Path], None]:
    def f(root: Path) -> None:
        for rel in rels:
            (root / TAGS[1] / rel).unlink()
    return f


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def _swap_shards(suffix: str) -> Callable[[Path], None]:
    return lambda root: _swap(root / TAGS[1] / f"shard-00000.{suffix}",
                              root / TAGS[1] / f"shard-00001.{suffix}")


def _swap_checkpoints(rel: str) -> Callable[[Path], None]:
    return lambda root: _swap(root / TAGS[0] / rel, root / TAGS[1] / rel)


def _edit_json(rel: str, edit: Callable[[dict], None], rechecksum: bool = False
               ) -> Callable[[Path], None]:
    def f(root: Path) -> None:
        p = root / TAGS[1] / rel
        d = json.loads(p.read_text())
        edit(d)
        if rechecksum:  # a consistent rewrite: a valid manifest with other values
            d["checksum"] = json_checksum(d)
        p.write_text(json.dumps(d, indent=1))
    return f


def _set(*path_and_value):
    *keys, value = path_and_value

    def edit(d: dict) -> None:
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value(d[keys[-1]]) if callable(value) else value
    return edit


def _replace_store(run: str = RUN, tag: str | None = None, seal: bool = True,
                   rows: int = PER_SHARD) -> Callable[[Path], None]:
    def f(root: Path) -> None:
        shutil.rmtree(root / TAGS[1])
        build_store(root / TAGS[1], tag or TAGS[1], run=run, seal=seal, rows=rows)
    return f


def _empty_with_manifest(root: Path) -> None:
    shutil.rmtree(root / TAGS[1])
    spec = StoreSpec.from_batch(_batch(["probe"], TAGS[1], 0), projection=PROJ,
                                capture=CaptureConfig(), **_origin(TAGS[1]))
    GradientStoreWriter(StoreConfig(path=str(root / TAGS[1])), spec).close()


def _sealed_empty(root: Path) -> None:
    _empty_with_manifest(root)
    seal_store(root / TAGS[1])


def _cases() -> list[Case]:
    C, M = StoreCorruptError, StoreMismatchError
    out = []
    for rel in FILES:
        for frac in (0.0, 0.01, 0.5, 0.999):
            out.append(Case(f"truncate {rel} at {frac:.0%}", _truncate(rel, frac), C, (rel,)))
        for frac, bit in ((0.0, 0), (0.3, 3), (0.6, 6), (0.999, 1)):
            out.append(Case(f"flip bit {bit} of {rel} at {frac:.0%}", _flip(rel, frac, bit),
                            C, (rel,)))
        out.append(Case(f"delete {rel}", _delete(rel), C, (rel,)))
    out.append(Case("delete every file of shard 1",
                    _delete(*(f"shard-00001.{s}" for s in SHARD_FILES)), C,
                    ("shard-00001.index.json",)))
    out.append(Case("delete every shard file",
                    _delete(*(f for f in FILES if f.startswith("shard"))), C, ("shard-0000",)))
    out.append(Case("delete the lock files (harmless)",
                    _delete("shard-00000.lock", "shard-00001.lock"), None, ()))
    for s in SHARD_FILES:
        out.append(Case(f"swap shard-00000.{s} <-> shard-00001.{s}", _swap_shards(s), C,
                        (f"shard-0000",)))
    for rel in ("shard-00000.data", "shard-00001.meta", "shard-00000.index.json"):
        err = M if rel.endswith("index.json") else C
        out.append(Case(f"swap {rel} across checkpoints", _swap_checkpoints(rel),
                        None if rel.endswith(".meta") else err, (rel,)))
    out.append(Case("swap info.json across checkpoints", _swap_checkpoints("info.json"), M,
                    ("checkpoint",)))
    out.append(Case("swap the whole stores of two checkpoints", lambda r: _swap(
        r / TAGS[0], r / TAGS[1]), M, ("checkpoint",)))
    manifest_edits = {
        "format_version": _set("format_version", 3), "dtype": _set("dtype", "float16"),
        "spec.projection": _set("spec", "projection", "dense:gaussian:k16:s3"),
        "spec.seed": _set("spec", "seed", 4), "spec.fingerprint": _set("spec", "fingerprint", "x"),
        "projection_config.dim": _set("spec", "projection_config", "dim", 32),
        "semantics.label_shift": _set("spec", "semantics", "label_shift", 0),
        "semantics.loss_reduction": _set("spec", "semantics", "loss_reduction", "sum"),
        "semantics.per_example_loss": _set("spec", "semantics", "per_example_loss", "mean"),
        "semantics.ignore_index": _set("spec", "semantics", "ignore_index", 0),
        "run_id": _set("spec", "run_id", "run:other"),
        "checkpoint": _set("spec", "checkpoint", TAGS[0]),
        "weights_hash": _set("spec", "weights_hash", "blake2b:00"),
        "layers[0].width": _set("spec", "layers", 0, "width", 15),
        "layers[0].name": _set("spec", "layers", 0, "name", "enc.fc9"),
        "layers[1].shape": _set("spec", "layers", 1, "shape", [4, 2]),
        "complete.rows[0]": _set("complete", "rows", "0", lambda n: n - 1),
        "complete=null": _set("complete", None),
        "checksum": _set("checksum", "blake2b:00"),
    }
    for field, edit in manifest_edits.items():
        out.append(Case(f"edit info.json {field}", _edit_json("info.json", edit), C,
                        ("info.json",)))
    # Rewritten consistently (checksum recomputed): a valid manifest of another store.
    resealed = {"run_id": (M, ("run_id",)), "checkpoint": (M, ("checkpoint",)),
                "weights_hash": (M, ("weights_hash",)),
                "semantics.label_shift": (M, ("shard-0000",)),
                "layers[0].width": (M, ("shard-0000",)),
                "complete.rows[0]": (C, ("shard-00000.index.json",)),
                "complete=null": (C, ("incomplete",))}
    for field, (err, names) in resealed.items():
        out.append(Case(f"rewrite info.json {field} with a valid checksum",
                        _edit_json("info.json", manifest_edits[field], rechecksum=True), err,
                        names))
    index_edits = {"rank": _set("rank", 1), "world": _set("world", 1),
                   "rows": _set("rows", 9), "ids_bytes": _set("ids_bytes", 3),
                   "spec_digest": _set("spec_digest", "0" * 32),
                   "chunk digest": _set("chunks", 0, 2, "crc32:00000000")}
    for field, edit in index_edits.items():
        out.append(Case(f"edit shard-00000.index.json {field}",
                        _edit_json("shard-00000.index.json", edit), C,
                        ("shard-00000.index.json",)))
    out += [
        Case("store of another run", _replace_store(run="run:bbbb"), M, ("run_id",)),
        Case("store of another checkpoint", _replace_store(tag=TAGS[0]), M, ("checkpoint",)),
        Case("unsealed store (interrupted collection)", _replace_store(seal=False), C,
             ("incomplete",)),
        Case("store with fewer rows, sealed", _replace_store(rows=PER_SHARD - 1), None, ()),
        Case("manifest only, no shard", _empty_with_manifest, C, ("incomplete",)),
        Case("sealed store without any shard", _sealed_empty, C, ("no committed shard",)),
        Case("empty directory", lambda r: (shutil.rmtree(r / TAGS[1]),
                                           (r / TAGS[1]).mkdir()), ConfigError, ("No gradient",)),
    ]
    return out


CASES = _cases()


def test_enough_cases():
    """The suite covers at least 50 distinct damages (issue 13)."""
    assert len(CASES) >= 50 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_damaged_store_never_answers_wrong(case, pristine, tmp_path):
    """The damaged checkpoint either raises the expected named error or reads back exactly
    the undamaged store; the other checkpoint keeps reading back exactly."""
    src, good = pristine
    root = tmp_path / "grads"
    shutil.copytree(src, root)
    case.damage(root)
    try:
        got = read_all(root, TAGS[1])
    except (StoreCorruptError, StoreMismatchError, ConfigError) as e:
        if case.error is not None:
            assert type(e) is case.error, f"{case.name}: {type(e).__name__}: {e}"
        assert any(n in str(e) for n in case.names) or not case.names, \
            f"{case.name}: the error names none of {case.names}: {e}"
    else:
        if case.name == "store with fewer rows, sealed":  # a valid, other store: no damage
            assert len(got[0]) == WORLD * (PER_SHARD - 1)
            return
        assert case.error is None, f"{case.name}: expected {case.error.__name__}, read it"
        _assert_same(got, good[TAGS[1]])


def _assert_same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0] and got[2:] == want[2:]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


RESUME = [c for c in CASES if c.name.startswith(("flip", "truncate")) and "shard" in c.name]


@pytest.mark.parametrize("case", RESUME, ids=[c.name for c in RESUME])
def test_resume_refuses_damaged_rows(case, pristine, tmp_path):
    """A writer resuming over a damaged shard file (its own or another rank's) raises naming
    the file, instead of treating the damaged examples as stored."""
    src, _ = pristine
    root = tmp_path / "grads"
    shutil.copytree(src, root)
    case.damage(root)
    spec = StoreSpec.from_batch(_batch(["probe"], TAGS[1], 0), projection=PROJ,
                                capture=CaptureConfig(), **_origin(TAGS[1]))
    for rank in range(WORLD):
        with pytest.raises(StoreCorruptError, match="|".join(case.names).replace(".", r"\.")):
            GradientStoreWriter(StoreConfig(path=str(root / TAGS[1])), spec, rank=rank,
                                world=WORLD).close()


def test_rank_that_stored_nothing_is_not_missing(tmp_path):
    """A sealed store whose rank 1 (of 2) stored nothing (fewer examples than ranks, or all
    its examples dropped) opens with rank 0's rows: the completion record lists the shards
    that exist. Without the record, the indexes' world=2 makes the absent shard an error."""
    spec = StoreSpec.from_batch(_batch(["probe"], TAGS[0], 0), projection=PROJ,
                                capture=CaptureConfig(), **_origin(TAGS[0]))
    w = GradientStoreWriter(StoreConfig(path=str(tmp_path)), spec, rank=0, world=2)
    w.append(_batch(["doc0", "doc1"], TAGS[0], 0))
    w.close()
    with pytest.raises(StoreCorruptError, match=r"shard-00001\.index\.json' is missing"):
        GradientStore.open(tmp_path)
    assert seal_store(tmp_path) == {0: 2}
    with GradientStore.open(tmp_path, require_complete=True, origin=_origin(TAGS[0])) as s:
        assert s.ids == ("doc0", "doc1")
