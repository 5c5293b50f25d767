"""Corpus reading (dattri_ds.data.read) against a slow reference: every format gives the
documents ``json.loads`` gives line by line, and each damaged or mismatched input is one
InputFileError line naming the file and the fix.

Invariant: for any supported input, ``iter_batches`` yields, in file order, one row per
record with ``id`` (the mapped field as a string, else ``<file>:<row>``), ``source``,
``title`` (``""`` when absent) and ``text``, streaming (a JSON-lines file larger than a
block comes in several batches; a record longer than a block is still read).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _corpora import documents, write_jsonl  # noqa: E402
from _deps import require  # noqa: E402

pa = require("pyarrow", "hf")
from dattri_ds.data import read  # noqa: E402
from dattri_ds.data.read import FieldMap, iter_batches, resolve_inputs  # noqa: E402
from dattri_ds.errors import InputFileError  # noqa: E402


def _rows(inputs, fields=FieldMap()) -> list[dict]:
    out = []
    for batch in iter_batches(resolve_inputs(inputs), fields):
        out += batch.to_pylist()
    return out


def _reference(path: Path) -> list[dict]:
    """The slow reference: one json.loads per non-blank line."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            rows.append({k: str(r.get(k, "")) for k in read.DOC_FIELDS})
    return rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("read")
    rows = documents(300, seed=1)
    return write_jsonl(root / "c.jsonl", rows), rows


def _table(rows):
    return pa.Table.from_pylist(rows)


def test_every_format_reads_the_same_documents(corpus, tmp_path):
    """jsonl, .gz, .zst, parquet, Arrow file and stream, save_to_disk, a folder of shards
    and a quoted glob all give the reference rows, in order."""
    import pyarrow.parquet as pq

    path, rows = corpus
    ref = _reference(path)
    data = path.read_bytes()
    (tmp_path / "g.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "z.jsonl.zst").write_bytes(_zstd(data))
    pq.write_table(_table(rows), tmp_path / "p.parquet", row_group_size=64)
    with pa.ipc.new_file(str(tmp_path / "f.arrow"), _table(rows).schema) as w:
        for b in _table(rows).to_batches(max_chunksize=50):
            w.write_batch(b)
    with pa.ipc.new_stream(str(tmp_path / "s.arrow"), _table(rows).schema) as w:
        w.write_table(_table(rows))
    datasets = require("datasets", "hf")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    shards = tmp_path / "shards"
    write_jsonl(shards / "a" / "part-0.jsonl", rows[:100])
    write_jsonl(shards / "part-1.jsonl", rows[100:])
    (shards / "README.md").write_text("not a shard")
    for inp in ("g.jsonl.gz", "z.jsonl.zst", "p.parquet", "f.arrow", "s.arrow", "saved"):
        assert _rows([tmp_path / inp]) == ref, inp
    assert _rows([shards]) == ref  # sorted by relative path: a/part-0 before part-1
    assert _rows([str(shards / "**" / "*.jsonl")]) == ref
    assert _rows([path]) == ref


def _zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


def test_zstd_frames_cut_files_and_long_windows(corpus, tmp_path):
    """A .zst of several frames reads whole; a cut one and one whose frame declares a window
    over 128 MiB (zstd --long: the header's window byte patched to 2**30) are one line."""
    path, _ = corpus
    data = path.read_bytes()
    half = data.index(b"\n", len(data) // 2) + 1
    two = _zstd(data[:half]) + _zstd(data[half:])
    (tmp_path / "two.jsonl.zst").write_bytes(two)
    assert _rows([tmp_path / "two.jsonl.zst"]) == _reference(path)
    (tmp_path / "cut.jsonl.zst").write_bytes(two[: len(two) * 3 // 4])
    _one_line(tmp_path, [tmp_path / "cut.jsonl.zst"], "cut.jsonl.zst", "cut off")
    one = bytearray(_zstd(data))
    assert not one[4] & 0x20  # no single-segment flag: byte 5 is the window descriptor
    one[5] = 20 << 3  # window log 10 + 20
    (tmp_path / "long.jsonl.zst").write_bytes(bytes(one))
    _one_line(tmp_path, [tmp_path / "long.jsonl.zst"], "long.jsonl.zst", "--long")


def test_field_mapping_stable_and_integer_ids(tmp_path):
    """Mapped columns, integer ids as strings, and ``<file>:<row>`` ids when there is none."""
    write_jsonl(tmp_path / "m.jsonl", [{"key": 7, "body": "a b", "lang": "en"},
                                       {"key": 12, "body": "c", "lang": "de"}])
    got = _rows([tmp_path / "m.jsonl"], FieldMap(text="body", id="key", source="lang"))
    assert got == [{"id": "7", "source": "en", "title": "", "text": "a b"},
                   {"id": "12", "source": "de", "title": "", "text": "c"}]
    write_jsonl(tmp_path / "sh" / "x.jsonl", [{"text": "one"}, {"text": "two"}])
    write_jsonl(tmp_path / "sh" / "y.jsonl", [{"text": "three"}])
    assert [r["id"] for r in _rows([tmp_path / "sh"])] == ["x.jsonl:0", "x.jsonl:1",
                                                            "y.jsonl:0"]


def test_streaming_in_blocks_and_long_records(tmp_path, monkeypatch):
    """A file larger than the JSON block comes in several batches; a record longer than the
    block is read after the block grows (no row lost or repeated)."""
    monkeypatch.setattr(read, "_JSON_BLOCK", 4096)
    rows = documents(400, seed=2)
    rows[123]["text"] = "long " * 3000
    path = write_jsonl(tmp_path / "big.jsonl", rows)
    batches = list(iter_batches(resolve_inputs([path])))
    assert len(batches) > 5
    assert [r for b in batches for r in b.to_pylist()] == _reference(path)
    skipped = [r for b in iter_batches(resolve_inputs([path]), skip=150) for r in b.to_pylist()]
    assert skipped == _reference(path)[150:]


def _one_line(tmp_path, inputs, *needles, fields=FieldMap()):
    with pytest.raises(InputFileError) as e:
        _rows(inputs, fields)
    msg = str(e.value)
    assert "\n" not in msg and "Fix:" in msg, msg
    for n in needles:
        assert str(n) in msg, msg
    return msg


def test_damaged_and_mismatched_inputs_are_one_line(corpus, tmp_path):
    """No text field; shards that differ; a cut .gz and parquet; an empty corpus; a text that
    is not a string (first row or later); a null text; a DatasetDict folder; a glob without
    match; a file without a known suffix."""
    import pyarrow.parquet as pq

    path, rows = corpus
    write_jsonl(tmp_path / "notext.jsonl", [{"id": "a", "body": "x"}])
    _one_line(tmp_path, [tmp_path / "notext.jsonl"], "notext.jsonl", "--text-field")
    sh = tmp_path / "differ"
    write_jsonl(sh / "a.jsonl", [{"id": "a", "text": "x"}])
    write_jsonl(sh / "b.jsonl", [{"text": "y"}])
    _one_line(tmp_path, [sh], "a.jsonl", "b.jsonl", "differ")
    write_jsonl(sh / "b.jsonl", [{"id": 3, "text": "y"}])
    _one_line(tmp_path, [sh], "b.jsonl", "differ")
    gz = gzip.compress(path.read_bytes())
    (tmp_path / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    _one_line(tmp_path, [tmp_path / "cut.jsonl.gz"], "cut.jsonl.gz", "cut off")
    pq.write_table(_table(rows), tmp_path / "p.parquet")
    raw = (tmp_path / "p.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(raw[: len(raw) // 2])
    _one_line(tmp_path, [tmp_path / "cut.parquet"], "cut.parquet", "cut off")
    (tmp_path / "empty.jsonl").write_text("\n")
    _one_line(tmp_path, [tmp_path / "empty.jsonl"], "empty.jsonl", "holds no record")
    (sh / "b.jsonl").write_text("")  # an empty shard beside full ones is read as no rows
    assert [r["id"] for r in _rows([sh])] == ["a"]
    write_jsonl(tmp_path / "num.jsonl", [{"id": "a", "text": 5}])
    _one_line(tmp_path, [tmp_path / "num.jsonl"], "num.jsonl", "not a string")
    write_jsonl(tmp_path / "later.jsonl", [{"id": "a", "text": "x"}, {"id": "b", "text": 5}])
    _one_line(tmp_path, [tmp_path / "later.jsonl"], "later.jsonl", "changes type")
    write_jsonl(tmp_path / "null.jsonl", [{"id": "a", "text": "x"}, {"id": "b", "text": None}])
    _one_line(tmp_path, [tmp_path / "null.jsonl"], "null.jsonl", "row 1")
    pq.write_table(pa.table({"id": ["a"], "text": [3]}), tmp_path / "int.parquet")
    _one_line(tmp_path, [tmp_path / "int.parquet"], "int.parquet", "not a string")
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (tmp_path / "dd" / "train").mkdir()
    _one_line(tmp_path, [tmp_path / "dd"], "DatasetDict", "train")
    _one_line(tmp_path, [str(tmp_path / "nothing-*.jsonl")], "matches no file")
    (tmp_path / "data.csv").write_text("a,b\n")
    _one_line(tmp_path, [tmp_path / "data.csv"], "data.csv", "known format")


def test_hash_file_streams_blocks(tmp_path):
    """The content hash is BLAKE2b-128 of the bytes (read in blocks: a file larger than one
    block hashes as the whole)."""
    import hashlib

    data = bytes(range(256)) * 9000  # > 1 MiB
    (tmp_path / "f").write_bytes(data)
    assert read.hash_file(tmp_path / "f") == hashlib.blake2b(data, digest_size=16).hexdigest()
