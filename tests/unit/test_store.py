"""Gradient store: round trip, shard merging, resume, crash recovery, corruption, mismatch.

Invariant of the module: whatever happens to a writer (resume, torn write, SIGKILL, async
thread), a reader sees every committed example exactly once, with the bytes that were
appended, or refuses the store with an error naming the damaged file or the mismatched
setting.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dattri_ds.layers import get_kind
from dattri_ds.errors import CaptureError, ConfigError, StoreMismatchError
from dattri_ds.gradient import Dense, Factorized, GradBatch, LayerGrad
from dattri_ds.ops.inner import cross_gram
from dattri_ds.ops.projection import ProjectionConfig, stable_seed
from dattri_ds.store import (
    DuplicateSampleError, GradientStore, GradientStoreWriter, StoreCallback, StoreConfig,
    StoreCorruptError, StoreSpec,
)
from dattri_ds.store import shard as shard_module

PROJ = ProjectionConfig(kind="kronecker", dim=16, seed=3)
FINGERPRINT = "tiny-model@step100"
#: (name, kind, canonical shape, stored width, projected or kept exactly)
LAYERS = [("enc.fc1", "linear", (8, 5), 16, "proj"),
          ("enc.fc2", "linear", (6, 9), 12, "proj"),
          ("head", "linear", (2, 4), 8, "identity")]
WIDTH = sum(w for _, _, _, w, _ in LAYERS)


def ids_range(a: int, b: int) -> list[str]:
    return [f"ex{i}" for i in range(a, b)]


def vec(sample_id: str, layer: str, width: int) -> torch.Tensor:
    """The deterministic projected vector of one example and layer."""
    gen = torch.Generator().manual_seed(stable_seed(sample_id, layer))
    return torch.randn(width, generator=gen)


def make_batch(ids: list[str], step: int = 0, proj: ProjectionConfig = PROJ) -> GradBatch:
    layers = {}
    for name, kind, shape, width, how in LAYERS:
        tag = proj.tag if how == "proj" else f"identity:{proj.tag}"
        vals = torch.stack([vec(s, name, width) for s in ids])
        layers[name] = LayerGrad(name=name, kind=get_kind(kind), data=Dense(vals), shape=shape,
                                 space=tag)
    counts = torch.tensor([len(s) for s in ids])
    return GradBatch(step=step, sample_ids=tuple(ids), layers=layers, token_counts=counts)


def expected_rows(ids: list[str] | tuple[str, ...]) -> torch.Tensor:
    return torch.cat([torch.stack([vec(s, n, w) for s in ids]) for n, _, _, w, _ in LAYERS], 1)


def make_spec(proj: ProjectionConfig = PROJ, fingerprint: str = FINGERPRINT) -> StoreSpec:
    return StoreSpec.from_batch(make_batch(["probe"], proj=proj), projection=proj,
                                fingerprint=fingerprint)


def write(path: Path, id_batches: list[list[str]], rank: int = 0, world: int = 1,
          **cfg) -> GradientStoreWriter:
    w = GradientStoreWriter(StoreConfig(path=str(path), **cfg), make_spec(), rank=rank,
                            world=world)
    for step, ids in enumerate(id_batches):
        w.append(make_batch(ids, step=step))
    w.close()
    return w


def shard_file(path: Path, suffix: str, rank: int = 0) -> Path:
    return path / f"shard-{rank:05d}{suffix}"


def assert_store_equals(store: GradientStore, ids: list[str]) -> None:
    assert store.ids == tuple(ids)
    torch.testing.assert_close(store.read(slice(None)), expected_rows(ids), rtol=0, atol=0)


def test_round_trip(tmp_path):
    """Written ids, vectors, steps and token counts come back bit-exact, in order, and the
    rebuilt GradBatch gives the same cross_gram as the original batch."""
    batches = [ids_range(0, 3), ids_range(3, 7), ids_range(7, 8)]
    write(tmp_path, batches, flush_every=2)
    store = GradientStore.open(tmp_path, expect=make_spec(), dtype="float32")
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["format_version"] == 2 and info["dtype"] == "float32"
    assert info["spec"]["projection"] == PROJ.tag and info["spec"]["fingerprint"] == FINGERPRINT
    assert [(d["name"], d["width"]) for d in info["spec"]["layers"]] == [(n, w) for n, _, _, w, _
                                                                          in LAYERS]
    ids = ids_range(0, 8)
    assert_store_equals(store, ids)
    assert len(store) == 8 and store.layers == tuple(n for n, *_ in LAYERS)
    assert store.steps.tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    assert store.token_counts.tolist() == [len(s) for s in ids]
    view = store.layer_view(store.read([5, 2]))
    torch.testing.assert_close(view["enc.fc2"], torch.stack([vec("ex5", "enc.fc2", 12),
                                                             vec("ex2", "enc.fc2", 12)]))
    query = make_batch(["q0", "q1"])
    rebuilt = store.to_gradbatch(slice(None))
    assert rebuilt.sample_ids == tuple(ids)
    torch.testing.assert_close(cross_gram(rebuilt, query), cross_gram(make_batch(ids), query))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_round_trip(tmp_path, dtype):
    """Half-precision stores return exactly the values cast to that dtype (bf16 raw bits)."""
    write(tmp_path, [ids_range(0, 5)], dtype=dtype)
    store = GradientStore.open(tmp_path, dtype=dtype)
    tdtype = getattr(torch, dtype)
    got = store.read(slice(None), dtype=None)
    assert got.dtype == tdtype
    torch.testing.assert_close(got, expected_rows(ids_range(0, 5)).to(tdtype), rtol=0, atol=0)


def test_two_shards_merge_like_one_shard(tmp_path):
    """Ranks 0/1 of world 2 read back as the same examples and vectors as a one-shard store,
    in the documented order: shard 0's rows, then shard 1's, each in append order."""
    all_ids = ids_range(0, 12)
    r0 = [all_ids[i:i + 2] for i in range(0, 12, 4)]
    r1 = [all_ids[i + 2:i + 4] for i in range(0, 12, 4)]
    write(tmp_path / "two", r1, rank=1, world=2)   # rank 1 first: order must not depend on it
    write(tmp_path / "two", r0, rank=0, world=2)
    write(tmp_path / "one", [all_ids])
    two, one = GradientStore.open(tmp_path / "two"), GradientStore.open(tmp_path / "one")
    order = [i for b in r0 for i in b] + [i for b in r1 for i in b]
    assert_store_equals(two, order)
    assert sorted(two.ids) == sorted(one.ids)
    perm = [two.index_of(s) for s in one.ids]
    torch.testing.assert_close(two.read(perm), one.read(slice(None)), rtol=0, atol=0)


def test_resume_skips_existing_ids(tmp_path):
    """A reopened writer reports stored ids and silently skips them (and repeats inside a
    batch), also ids stored by another rank's shard, so every id is stored once."""
    write(tmp_path, [ids_range(0, 6)])
    w = GradientStoreWriter(StoreConfig(path=str(tmp_path)), make_spec())
    assert w.has("ex3") and not w.has("ex6") and all(map(w.has, ids_range(0, 6)))
    assert w.append(make_batch(ids_range(4, 9) + ["ex8"], step=1)) == 3
    assert w.append(make_batch(ids_range(0, 9), step=2)) == 0
    w.close()
    w1 = GradientStoreWriter(StoreConfig(path=str(tmp_path)), make_spec(), rank=1, world=2)
    assert w1.append(make_batch(ids_range(7, 11))) == 2
    w1.close()
    store = GradientStore.open(tmp_path)
    assert_store_equals(store, ids_range(0, 11))


def test_one_writer_per_shard(tmp_path):
    """A second live writer of the same shard is refused (it would truncate the first's
    uncommitted tail); once the first closes, the shard can be reopened."""
    cfg = StoreConfig(path=str(tmp_path))
    w = GradientStoreWriter(cfg, make_spec(), rank=0, world=2)
    with pytest.raises(ConfigError, match="already open by another writer"):
        GradientStoreWriter(cfg, make_spec(), rank=0, world=2)
    GradientStoreWriter(cfg, make_spec(), rank=1, world=2).close()
    w.close()
    GradientStoreWriter(cfg, make_spec(), rank=0, world=2).close()


def test_torn_write_is_truncated_on_reopen(tmp_path):
    """Bytes appended after the last index commit (a crash between write and commit) are
    ignored by readers and cut by the next writer, which then stores those examples once."""
    write(tmp_path, [ids_range(0, 4)])
    committed = {s: shard_file(tmp_path, s).stat().st_size for s in (".data", ".ids", ".meta")}
    torn = expected_rows(ids_range(4, 6)).numpy().astype("<f4")
    with open(shard_file(tmp_path, ".data"), "ab") as f:
        f.write(torn.tobytes() + b"\x01\x02")
    with open(shard_file(tmp_path, ".ids"), "ab") as f:
        f.write(b"ex4\nex5\nex")
    with open(shard_file(tmp_path, ".meta"), "ab") as f:
        f.write(np.zeros((2, 2), "<i8").tobytes())
    assert_store_equals(GradientStore.open(tmp_path, verify="eager"), ids_range(0, 4))
    w = GradientStoreWriter(StoreConfig(path=str(tmp_path)), make_spec())
    assert {s: shard_file(tmp_path, s).stat().st_size for s in committed} == committed
    assert not w.has("ex4")
    assert w.append(make_batch(ids_range(2, 7))) == 3
    w.close()
    assert_store_equals(GradientStore.open(tmp_path, verify="eager"), ids_range(0, 7))


@pytest.mark.parametrize("suffix", [".data", ".ids", ".meta"])
def test_truncated_shard_is_named(tmp_path, suffix):
    """A shard file shorter than its index commits is refused, naming that file."""
    write(tmp_path, [ids_range(0, 5)])
    path = shard_file(tmp_path, suffix)
    os.truncate(path, path.stat().st_size - 3)
    with pytest.raises(StoreCorruptError, match=str(path)):
        GradientStore.open(tmp_path)
    with pytest.raises(StoreCorruptError, match=str(path)):
        GradientStoreWriter(StoreConfig(path=str(tmp_path)), make_spec())


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_data_byte_fails_checksum(tmp_path):
    """A flipped byte in the rows fails the commit's checksum, on first read (lazy) or at open
    (eager), with the data file named; untouched commits stay readable."""
    write(tmp_path, [ids_range(0, 3), ids_range(3, 6)], flush_every=3)
    path = shard_file(tmp_path, ".data")
    _flip_byte(path, 4 * WIDTH * 4 + 7)  # row 4: second commit
    store = GradientStore.open(tmp_path)
    torch.testing.assert_close(store.read(slice(0, 3)), expected_rows(ids_range(0, 3)))
    with pytest.raises(StoreCorruptError, match=f"{path}.*commit #1"):
        store.read([5])
    with pytest.raises(StoreCorruptError, match=str(path)):
        GradientStore.open(tmp_path, verify="eager")


def test_flipped_ids_byte_fails_checksum(tmp_path):
    """Ids are always checksummed at open: a damaged ids file is refused, named."""
    write(tmp_path, [ids_range(0, 3)])
    path = shard_file(tmp_path, ".ids")
    _flip_byte(path, 1)
    with pytest.raises(StoreCorruptError, match=str(path)):
        GradientStore.open(tmp_path, verify="off")


def test_mismatched_projection_is_refused(tmp_path):
    """Opening a store with another projection tag (writer or reader) raises
    StoreMismatchError showing the stored and requested tags and the setting to change."""
    write(tmp_path, [ids_range(0, 2)])
    other = ProjectionConfig(kind="kronecker", dim=8, seed=3)
    for opener in (lambda: GradientStoreWriter(StoreConfig(path=str(tmp_path)),
                                               make_spec(proj=other)),
                   lambda: GradientStore.open(tmp_path, expect=make_spec(proj=other))):
        with pytest.raises(StoreMismatchError) as err:
            opener()
        msg = str(err.value)
        assert PROJ.tag in msg and other.tag in msg and "capture.projection" in msg
    w = GradientStoreWriter(StoreConfig(path=str(tmp_path)), make_spec())
    with pytest.raises(StoreMismatchError, match=f"'{PROJ.tag}'.*'{other.tag}'"):
        w.append(make_batch(["z"], proj=other))
    w.close()


def test_mismatched_fingerprint_dtype_layers_are_refused(tmp_path):
    """Fingerprint, dtype and layer-set differences are each listed with both sides and fix."""
    write(tmp_path, [ids_range(0, 2)])
    with pytest.raises(StoreMismatchError, match="fingerprint.*'other-model'.*store.path"):
        GradientStore.open(tmp_path, expect=make_spec(fingerprint="other-model"))
    with pytest.raises(StoreMismatchError, match="dtype: stored 'float32', requested 'float16'"):
        GradientStoreWriter(StoreConfig(path=str(tmp_path), dtype="float16"), make_spec())
    spec = make_spec()
    fewer = StoreSpec(layers=spec.layers[:2], projection=spec.projection, seed=spec.seed,
                      fingerprint=spec.fingerprint)
    with pytest.raises(StoreMismatchError, match="stored but not requested \\['head'\\]"):
        GradientStore.open(tmp_path, expect=fewer)
    w = GradientStoreWriter(StoreConfig(path=str(tmp_path)), spec)
    batch = make_batch(["z"])
    short = GradBatch(0, batch.sample_ids, {k: v for k, v in batch.layers.items() if k != "head"})
    with pytest.raises(StoreMismatchError, match="head"):
        w.append(short)
    w.close()


def test_append_requires_projected_dense(tmp_path):
    """Unprojected or factorized layers are refused with a pointer to capture.projection."""
    w = GradientStoreWriter(StoreConfig(path=str(tmp_path)), make_spec())
    batch = make_batch(["a", "b"])
    fac = LayerGrad(name="enc.fc1", kind=get_kind("linear"), shape=(8, 5),
                    data=Factorized(torch.randn(2, 3, 5), torch.randn(2, 3, 8)))
    raw = LayerGrad(name="enc.fc1", kind=get_kind("linear"), shape=(8, 5),
                    data=Dense(torch.randn(2, 40)))
    for lg in (fac, raw):
        bad = GradBatch(0, batch.sample_ids, {**batch.layers, "enc.fc1": lg})
        with pytest.raises(ConfigError, match="capture.projection"):
            w.append(bad)
    w.close()


def test_float16_overflow_is_an_error(tmp_path):
    """Values beyond the float16 range never become silent infs in a float16 store."""
    w = GradientStoreWriter(StoreConfig(path=str(tmp_path), dtype="float16"), make_spec())
    batch = make_batch(["a"])
    big = batch.layers["head"].replace(data=Dense(torch.full((1, 8), 1e6)))
    with pytest.raises(CaptureError, match="bfloat16"):
        w.append(GradBatch(0, batch.sample_ids, {**batch.layers, "head": big}))
    w.close()


def test_async_writer_equals_sync_writer(tmp_path):
    """The background writer produces byte-identical shard files to the synchronous one."""
    batches = [ids_range(i, i + 3) for i in range(0, 30, 3)]
    write(tmp_path / "sync", batches, flush_every=4)
    w = write(tmp_path / "async", batches, flush_every=4, async_write=True, max_queue=2)
    assert w.committed_rows == 30
    for suffix in (".data", ".ids", ".meta", ".index.json"):
        a = shard_file(tmp_path / "sync", suffix).read_bytes()
        assert a == shard_file(tmp_path / "async", suffix).read_bytes(), suffix
    assert_store_equals(GradientStore.open(tmp_path / "async"), ids_range(0, 30))


def test_async_writer_reraises_thread_errors(tmp_path, monkeypatch):
    """An error in the background thread is raised by the next call, and close still
    releases the files."""
    def boom(self, *args):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(shard_module.ShardAppender, "commit", boom)
    w = GradientStoreWriter(StoreConfig(path=str(tmp_path), flush_every=1, async_write=True),
                            make_spec())
    w.append(make_batch(["a"]))  # returns at once; the commit fails in the thread
    with pytest.raises(OSError, match="disk full"):
        w.flush()
    with pytest.raises(OSError, match="disk full"):
        w.append(make_batch(["b"]))
    with pytest.raises(OSError, match="disk full"):
        w.close()
    with pytest.raises(CaptureError, match="closed"):
        w.append(make_batch(["c"]))


def test_streaming_blocks_equal_one_shot(tmp_path):
    """iter_blocks(1) and iter_batches stream exactly the rows of one read, in order."""
    write(tmp_path / "a", [ids_range(0, 3)], rank=0, world=2)
    write(tmp_path / "a", [ids_range(3, 7)], rank=1, world=2)
    store = GradientStore.open(tmp_path / "a")
    blocks = list(store.iter_blocks(1))
    assert len(blocks) == 7 and all(v.shape == (1, WIDTH) for _, v in blocks)
    assert tuple(i for ids, _ in blocks for i in ids) == store.ids
    torch.testing.assert_close(torch.cat([v for _, v in blocks]), store.read(slice(None)),
                               rtol=0, atol=0)
    grams = torch.cat([cross_gram(b, make_batch(["q"])) for b in store.iter_batches(3)])
    torch.testing.assert_close(grams, cross_gram(store.to_gradbatch(slice(None)),
                                                 make_batch(["q"])))


def test_cross_shard_duplicates_raise_or_keep_first(tmp_path):
    """An id stored by two ranks is an error naming both shards by default; with
    duplicates='first' the rank-0 copy is kept, independent of write order."""
    write(tmp_path, [["a", "b"]], rank=1, world=2)
    # rank 0 opened before rank 1 committed 'b' in a real race; emulate by hiding shard 1
    os.rename(shard_file(tmp_path, ".index.json", 1), tmp_path / "hidden")
    write(tmp_path, [["b", "c"]], rank=0, world=2)
    os.rename(tmp_path / "hidden", shard_file(tmp_path, ".index.json", 1))
    with pytest.raises(DuplicateSampleError, match="'b'.*shard-00000.ids.*shard-00001.ids"):
        GradientStore.open(tmp_path)
    store = GradientStore.open(tmp_path, duplicates="first")
    assert store.ids == ("b", "c", "a")
    torch.testing.assert_close(store.read(slice(None)), expected_rows(["b", "c", "a"]))


def test_store_callback_writes_and_closes(tmp_path):
    """StoreCallback opens the writer from the first batch's layers and commits on close."""
    cb = StoreCallback(StoreConfig(path=str(tmp_path)), projection=PROJ, fingerprint=FINGERPRINT)
    assert not cb.has("ex0")
    cb.on_batch(make_batch(ids_range(0, 3)))
    cb.on_batch(make_batch(ids_range(3, 5), step=1))
    cb.on_step_end(1)
    cb.on_close()
    assert cb.has("ex4")
    assert_store_equals(GradientStore.open(tmp_path, expect=make_spec()), ids_range(0, 5))


_KILL_SCRIPT = """
import sys, time
sys.path.insert(0, {here!r})
from test_store import make_batch, make_spec, ids_range
from dattri_ds.store import GradientStoreWriter, StoreConfig
path, n, bs, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
w = GradientStoreWriter(StoreConfig(path=path, flush_every=bs), make_spec())
for step, start in enumerate(range(0, n, bs)):
    w.append(make_batch(ids_range(start, start + bs), step=step))
    time.sleep(pause)
w.close()
"""


def test_sigkill_midway_then_resume(tmp_path):
    """A writer process SIGKILLed mid-run leaves a store that a second run completes: every
    id exactly once with the right vector."""
    script = tmp_path / "writer.py"
    script.write_text(_KILL_SCRIPT.format(here=str(Path(__file__).parent)))
    store_dir, n, bs = tmp_path / "store", 400, 4
    cmd = [sys.executable, str(script), str(store_dir), str(n), str(bs)]
    proc = subprocess.Popen(cmd + ["0.05"])  # slow enough to be killed midway on a loaded machine
    index = shard_file(store_dir, ".index.json")
    deadline = time.monotonic() + 120
    while not (index.exists() and len(GradientStore.open(store_dir, verify="off")) >= 40):
        assert proc.poll() is None and time.monotonic() < deadline, "writer ended too early"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed = GradientStore.open(store_dir, verify="eager")
    assert 40 <= len(killed) < n and killed.ids == tuple(ids_range(0, len(killed)))
    subprocess.run(cmd + ["0"], check=True, timeout=120)
    final = GradientStore.open(store_dir, verify="eager")
    assert_store_equals(final, ids_range(0, n))


def test_attach_compares_every_requested_field_in_one_line(tmp_path):
    """``attach`` refuses a request that differs from the manifest with one line listing
    every differing field, both values and its fix, before opening any shard; fields the
    request leaves out are not compared; ``resume`` on an empty folder is None. Breaks if a
    consumer's request is compared partially, or a store is opened before the comparison."""
    from dattri_ds.store import StoreRequest, attach, seal_store

    write(tmp_path, [ids_range(0, 4)])
    seal_store(tmp_path)
    ok = StoreRequest(consumer="t", projection=PROJ, dtype="float32",
                      layers={n: (k, s) for n, k, s, _, _ in LAYERS},
                      whitening=(None, None), origin={"fingerprint": FINGERPRINT})
    with attach(tmp_path, ok, mode="score") as store:
        assert len(store) == 4
    assert attach(tmp_path / "new", ok, mode="resume") is None
    with attach(tmp_path, StoreRequest(consumer="t", projection={"dim": 16}), mode="read"):
        pass  # only the named projection field is compared
    bad = StoreRequest(consumer="collect", projection={"dim": 32, "seed": 3}, dtype="float16",
                       layers={"enc.fc1": ("linear", (8, 6))}, whitening=("ekfac", None),
                       origin={"fingerprint": "other@step1"},
                       fixes={"projection.dim": "--projection-dim {stored}",
                              "layers": "the model of the store"},
                       otherwise="--out <new>")
    with pytest.raises(StoreMismatchError) as err:
        attach(tmp_path, bad, mode="resume")
    text = str(err.value)
    assert "\n" not in text and text.endswith("; or --out <new>")
    for part in ("fingerprint: stored 'tiny-model@step100', requested 'other@step1'",
                 "projection.dim: stored 16, requested 32 (fix: --projection-dim 16)",
                 "dtype: stored 'float32', requested 'float16'",
                 "whitened: stored None, requested 'ekfac'",
                 "layers: stored 3 layers including ['enc.fc2', 'head'], requested 1 layers "
                 "(fix: the model of the store)",
                 "layers['enc.fc1']: stored linear (8, 5), requested linear (8, 6); "):
        assert part in text, (part, text)
    assert text.count("the model of the store") == 1  # a shared fix is said once
    assert "seed" not in text  # equal fields are not listed


def test_data_record_is_kept_and_compared(tmp_path):
    """A store written with a data record keeps it in its manifest; a writer with another
    record's fingerprint or tokenizer, and an ``attach`` request naming one, are refused
    with both values and the stored data path; a store without a record, or a request
    without one, is not compared. Breaks if rows of other examples could be appended."""
    import dataclasses

    from dattri_ds.store import StoreRequest, attach, seal_store

    data = {"fingerprint": "f1", "tokenizer": "spm-1", "data_path": ["/d/corpus"],
            "seq_len": 8, "packing": "windows", "seed": 1234}
    spec = dataclasses.replace(make_spec(), data=data)
    with GradientStoreWriter(StoreConfig(path=str(tmp_path / "s")), spec) as w:
        w.append(make_batch(ids_range(0, 2)))
    seal_store(tmp_path / "s")
    with GradientStore.open(tmp_path / "s") as store:
        assert store.spec.data == data
    other = dataclasses.replace(spec, data={**data, "fingerprint": "f2", "tokenizer": "hf-2"})
    with pytest.raises(StoreMismatchError) as err:
        GradientStoreWriter(StoreConfig(path=str(tmp_path / "s")), other)
    text = str(err.value)
    assert "fingerprint 'f1' stored, 'f2' requested" in text and "'/d/corpus'" in text, text
    assert "tokenizer 'spm-1' stored, 'hf-2' requested" in text
    GradientStoreWriter(StoreConfig(path=str(tmp_path / "s")), make_spec()).close()
    with pytest.raises(StoreMismatchError, match=r"data.fingerprint: stored 'f1', requested "
                                                 r"'f2' \(fix: .*--data-path \['/d/corpus'\]"):
        attach(tmp_path / "s", StoreRequest(consumer="collect", data=other.data), mode="read")
    with attach(tmp_path / "s", StoreRequest(consumer="collect", data=data), mode="read"):
        pass
    write(tmp_path / "plain", [ids_range(0, 2)])
    with attach(tmp_path / "plain", StoreRequest(consumer="c", data=data), mode="read"):
        pass
