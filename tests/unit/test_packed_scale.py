"""A corpus of 100,000 documents, prepared and opened: the data stays on disk.

Invariant: preparing 100k short documents on 2 workers gives every document (ids in order),
and opening the training dataset over it and reading a first batch raises the peak RSS of a
fresh process (Linux VmHWM, reset after the imports; indices cached) no more than over a
corpus 50x smaller, within a few MB, and its anonymous memory within 1 MB: tokens, indices
and the document table are memory-mapped (what differs is the file pages the batch maps).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _corpora import documents, spm_file, write_jsonl  # noqa: E402
from _deps import require  # noqa: E402

require("megatron.core", "megatron")
require("sentencepiece", "hf")
from dattri_ds.data.packed import PackedDataset  # noqa: E402
from dattri_ds.data.prepare import PrepareConfig, prepare  # noqa: E402
from dattri_ds.data.prepared import open_prepared  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_OPEN = """
import json, sys
import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset
from dattri_ds.data.packed import PackedDataset

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

out = []
for prefix in sys.argv[1:]:  # the first run warms the code pages up (not compared)
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS (VmHWM) := current RSS
    before = {k: status(k) for k in ("VmHWM", "RssAnon")}
    p = PackedDataset(prefix, 64)
    rows = np.random.default_rng(0).integers(0, len(p), 16)
    b = p.batch(rows)
    ids = [p.example_id(int(i)) for i in rows]
    out.append({"grow_kb": {k: status(k) - v for k, v in before.items()}, "examples": len(p)})
print(json.dumps(out))
"""


def _peaks(*prefixes: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _OPEN, *map(str, prefixes)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_100k_documents_prepared_and_opened_flat(tmp_path):
    small, large = documents(2000, seed=9, max_words=12), \
        documents(100_000, seed=10, max_words=12, id_prefix="big")
    write_jsonl(tmp_path / "small.jsonl", small)
    write_jsonl(tmp_path / "large.jsonl", large)
    model = spm_file(tmp_path / "t.model", [r["text"] for r in small])
    t0 = time.perf_counter()
    m = prepare(PrepareConfig(input=(str(tmp_path / "large.jsonl"),), tokenizer=str(model),
                              output_prefix=str(tmp_path / "large"), workers=2))
    took = time.perf_counter() - t0
    assert m["documents"] == 100_000 and took < 120, took
    c = open_prepared(tmp_path / "large")
    assert c.table.id(0) == "big-0" and c.table.id(99_999) == "big-99999"
    prepare(PrepareConfig(input=(str(tmp_path / "small.jsonl"),), tokenizer=str(model),
                          output_prefix=str(tmp_path / "small"), workers=1))
    for name in ("small", "large"):
        PackedDataset(str(tmp_path / name), 64)  # build and cache the indices
    _, b, a = _peaks(tmp_path / "small", tmp_path / "large", tmp_path / "small")
    assert b["examples"] > 40 * a["examples"]
    more = {k: b["grow_kb"][k] - a["grow_kb"][k] for k in a["grow_kb"]}
    # file pages count in RSS as they are mapped, a whole page-cache folio at a time (up to
    # ~640 KB per fault here): the 50x corpus's batch maps ~3.5 MB more of its files
    assert more["RssAnon"] < 1024 and more["VmHWM"] < 6 * 1024, (a, b)
