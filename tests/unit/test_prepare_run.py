"""``dattri-ds prepare`` end to end against a slow reference, and its crash safety.

Invariants: the prepared ``.bin``/``.idx`` hold, in corpus order, one sequence per document
equal to ``AutoTokenizer(folder)(text)["input_ids"]`` + EOS (the slow reference: one text at
a time), the document table holds each document's id, source, title and token offsets; the
result does not depend on the number of workers; a ``kill -9`` mid-run, then a rerun, gives
the same bytes as one uninterrupted run (0 documents lost or repeated); nothing is read as
complete before the manifest; a Megatron-LM prefix written by megatron-core's own builder is
read as it is.
"""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _corpora import documents, hf_folder, spm_file, write_jsonl  # noqa: E402
from _deps import require  # noqa: E402

require("megatron.core", "megatron")
require("transformers", "hf")
from dattri_ds.data.prepare import PrepareConfig, prepare  # noqa: E402
from dattri_ds.data.prepared import MANIFEST_KEYS, PreparedPaths, open_prepared  # noqa: E402
from dattri_ds.errors import InputFileError, OutputError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _files(prefix: Path) -> list[Path]:
    paths = PreparedPaths.of(prefix)
    return [paths.bin, paths.idx, *sorted(paths.docs.iterdir())]


def _same_output(a: Path, b: Path) -> None:
    for fa, fb in zip(_files(a), _files(b), strict=True):
        assert fa.name.replace(a.name, "") == fb.name.replace(b.name, "")
        assert filecmp.cmp(fa, fb, shallow=False), fa


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    rows = documents(500, seed=4)
    write_jsonl(root / "in" / "a.jsonl", rows[:200])
    write_jsonl(root / "in" / "b.jsonl", rows[200:])
    hf = hf_folder(root / "hf", [r["text"] for r in rows])
    return root, rows, hf


def test_prepare_matches_the_slow_reference(setup):
    from transformers import AutoTokenizer

    root, rows, hf = setup
    cfg = PrepareConfig(input=(str(root / "in"),), output_prefix=str(root / "out" / "c"),
                        tokenizer=str(hf), workers=2, chunk_docs=64)
    m = prepare(cfg)
    assert set(MANIFEST_KEYS) <= set(m) and m["documents"] == 500 and m["dtype"] == "uint16"
    ref_tok = AutoTokenizer.from_pretrained(str(hf))
    want = [ref_tok(r["text"])["input_ids"] + [ref_tok.eos_token_id] for r in rows]
    c = open_prepared(root / "out" / "c")
    assert len(c) == 500 and c.n_tokens == m["tokens"] == sum(map(len, want))
    assert list(c.dataset.document_indices) == list(range(501))  # one sequence per document
    for i in (0, 1, 199, 200, 377, 499):
        assert c.tokens(i).tolist() == want[i]
        assert c.document(i) == {"id": rows[i]["id"], "source": rows[i]["source"],
                                 "title": rows[i]["title"], "tokens": len(want[i])}
    assert [c.tokens(i).tolist() for i in range(500)] == want
    assert np.array_equal(c.table.tokens, np.cumsum([0] + [len(w) for w in want]))
    assert c.table.ids(range(500)) == [r["id"] for r in rows]
    assert c.table.find("doc-321") == 321 and c.table.find("nope") is None
    assert m["inputs"][0]["name"] == "a.jsonl" and m["ids"] == "field 'id'"
    one = prepare(PrepareConfig(input=cfg.input, output_prefix=str(root / "one" / "c"),
                                tokenizer=str(hf), workers=1, chunk_docs=500))
    _same_output(root / "out" / "c", root / "one" / "c")  # workers and chunks do not matter
    assert one["fingerprint"] == m["fingerprint"]


def test_rerun_does_nothing_and_another_request_is_refused(setup):
    root, rows, hf = setup
    cfg = PrepareConfig(input=(str(root / "in" / "a.jsonl"),),
                        output_prefix=str(root / "re" / "c"), tokenizer=str(hf), workers=1)
    first = prepare(cfg)
    stamp = os.stat(root / "re" / "c.bin").st_mtime_ns
    assert prepare(cfg) == first and os.stat(root / "re" / "c.bin").st_mtime_ns == stamp
    other = PrepareConfig(**{**cfg.__dict__, "input": (str(root / "in" / "b.jsonl"),)})
    with pytest.raises(OutputError, match="--overwrite"):
        prepare(other)
    assert open_prepared(root / "re" / "c").manifest == first  # untouched
    second = prepare(PrepareConfig(**{**other.__dict__, "overwrite": True}))
    assert second["documents"] == 300 and second["fingerprint"] != first["fingerprint"]
    # the same bytes elsewhere are the same corpus: the fingerprint ignores paths
    write_jsonl(root / "moved" / "a.jsonl", rows[:200])
    moved = prepare(PrepareConfig(**{**cfg.__dict__, "input": (str(root / "moved"),),
                                     "output_prefix": str(root / "moved" / "c")}))
    assert moved["fingerprint"] == first["fingerprint"]


def test_duplicate_ids_are_refused(tmp_path, setup):
    _, _, hf = setup
    write_jsonl(tmp_path / "d.jsonl", [{"id": "x", "text": "a"}, {"id": "y", "text": "b"},
                                       {"id": "x", "text": "c"}])
    with pytest.raises(InputFileError, match=r"repeats document ids: 'x' \(documents 0 and 2\)"):
        prepare(PrepareConfig(input=(str(tmp_path / "d.jsonl"),), tokenizer=str(hf),
                              output_prefix=str(tmp_path / "o"), workers=1))


_CHILD = """
import sys
from dattri_ds.data.prepare import PrepareConfig, prepare
prepare(PrepareConfig(input=(sys.argv[1],), output_prefix=sys.argv[2], tokenizer=sys.argv[3],
                      workers=2, chunk_docs=1000))
"""


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def test_kill_9_mid_run_resumes_without_loss(tmp_path):
    """A real prepare process (2 workers) is killed with SIGKILL once chunks are committed;
    its workers die with it, the prefix reads as unfinished, and a rerun resumes from the
    committed chunks to the bytes of an uninterrupted run."""
    rows = documents(40000, seed=5, max_words=40)
    corpus = write_jsonl(tmp_path / "big.jsonl", rows)
    model = spm_file(tmp_path / "t.model", [r["text"] for r in rows[:2000]])
    prefix = tmp_path / "killed" / "c"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "child.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(corpus), str(prefix), str(model)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    progress = PreparedPaths.of(prefix).work / "progress.json"
    deadline = time.time() + 120
    committed = 0
    while time.time() < deadline and proc.poll() is None:
        try:
            committed = len(json.loads(progress.read_text())["parts"])
        except (OSError, ValueError, KeyError):
            committed = 0
        if committed >= 3:
            break
        time.sleep(0.05)
    workers = _children(proc.pid)
    assert proc.poll() is None, f"prepare ended before the kill: " \
        f"{(tmp_path / 'child.log').read_text()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    assert workers and not any(Path(f"/proc/{w}").exists() and
                               "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]
                               for w in workers)  # PR_SET_PDEATHSIG: no orphan keeps writing
    assert 3 <= committed < 40
    with pytest.raises(InputFileError, match="rerun"):
        open_prepared(prefix)
    kept = json.loads(progress.read_text())["parts"]
    resumed = {}
    m = prepare(PrepareConfig(input=(str(corpus),), output_prefix=str(prefix),
                              tokenizer=str(model), workers=2, chunk_docs=1000),
                progress=lambda p: resumed.setdefault("first", p.chunks))
    assert resumed["first"] == len(kept) + 1  # resumed after the committed chunks
    assert m["documents"] == 40000 and not PreparedPaths.of(prefix).work.exists()
    fresh = prepare(PrepareConfig(input=(str(corpus),), output_prefix=str(tmp_path / "f" / "c"),
                                  tokenizer=str(model), workers=1, chunk_docs=40000))
    assert fresh["fingerprint"] == m["fingerprint"] and fresh["tokens"] == m["tokens"]
    _same_output(prefix, tmp_path / "f" / "c")
    c = open_prepared(prefix)
    assert c.table.ids(range(len(c))) == [r["id"] for r in rows]


def test_a_megatron_prefix_is_read_as_it_is(tmp_path):
    """A prefix written by megatron-core's IndexedDatasetBuilder (no manifest, no table):
    ids from its document index; a document of two sequences names each; an .idx without
    its .bin, a cut .bin and an empty prefix are one line each."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from dattri_ds.data.packed import PackedDataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, int(n)).astype(np.int32) for n in rng.integers(1, 90, 40)]
    b = IndexedDatasetBuilder(str(tmp_path / "mega.bin"), dtype=np.uint16)
    for d in docs:
        b.add_document(torch.from_numpy(d), [len(d)])
    b.add_item(torch.arange(5))
    b.add_item(torch.arange(7))
    b.end_document()
    b.finalize(str(tmp_path / "mega.idx"))
    c = open_prepared(tmp_path / "mega")
    assert c.manifest is None and c.table is None and len(c) == 42
    assert [c.tokens(i).tolist() for i in range(40)] == [d.tolist() for d in docs]
    assert c.doc_id(3) == "mega:doc-3" and c.doc_id(41) == "mega:doc-40/seq-1"
    assert c.fingerprint.startswith("megatron-")
    ds = PackedDataset(str(tmp_path / "mega"), 64)
    flat = np.concatenate([c.tokens(sp.document, sp.start, sp.end)
                           for i in range(len(ds)) for sp in ds.spans(i)])
    assert len(flat) == c.n_tokens and ds.doc_ids(0)[0].startswith("mega:doc-")
    os.rename(tmp_path / "mega.bin", tmp_path / "gone.bin")
    with pytest.raises(InputFileError, match=r"has no data file .*mega\.bin"):
        open_prepared(tmp_path / "mega")
    with open(tmp_path / "gone.bin", "rb") as src, open(tmp_path / "mega.bin", "wb") as dst:
        dst.write(src.read()[:100])
    with pytest.raises(InputFileError, match="shorter than its .idx"):
        open_prepared(tmp_path / "mega")
    with pytest.raises(InputFileError, match="no prepared corpus"):
        open_prepared(tmp_path / "nothing")
