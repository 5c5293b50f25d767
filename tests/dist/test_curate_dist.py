"""Offline curation over 2 gloo ranks selects what 1 rank selects.

Invariant: each rank scores its contiguous slice of the pool store's rows (gradient
cosines, content prior with pool-wide n-gram counts all-reduced, MinHash signatures) and
the per-row columns are all-gathered, so the scores, the subset and the written files are
those of one process, on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _dist import run  # noqa: E402

pytestmark = pytest.mark.dist


def _select(rank, world, store, pool_file, q_rows, tc, out, method):
    import torch.distributed as dist

    from dattri_ds.curate import CurateConfig, Pool, curate
    from dattri_ds.store import GradientStore
    from test_curate import tokenize

    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    s = GradientStore.open(store, require_complete=True)
    pool = Pool.build(s.ids, s.token_counts, [pool_file])
    cfg = CurateConfig(method=method, fraction=0.25, block_rows=3, max_per_cluster=1,
                       max_source_share=0.5)
    r = curate(cfg, {"step1": s}, pool, targets={"step1": q_rows}, weights={"step1": 1e-3},
               tokenize=tokenize, target_counts=tc, out=out, rank=rank, world=world)
    s.close()
    return {"scores": r.scores, "chosen": r.chosen}


@pytest.mark.parametrize("method", ["combined", "trajectory"])
def test_two_ranks_equal_one_rank(tmp_path, method):
    """Scores and subset of 2 ranks equal 1 rank's on both ranks; rank 0 writes the same
    subset.jsonl."""
    import json

    import test_curate as tc
    from dattri_ds.curate.pool import ngram_counts
    from dattri_ds.curate.targets import target_rows
    from dattri_ds.store import GradientStore

    model = tc.tiny_gpt2()
    docs = tc._docs(23)  # odd: the ranks' slices differ in size
    pool_file = tmp_path / "pool.jsonl"
    pool_file.write_text("".join(json.dumps(d) + "\n" for d in docs))
    store = tc._write_store(tmp_path / "store", tc._grads(model, docs, tc.PROJ))
    with GradientStore.open(store) as s:
        q_rows = target_rows(tc._grads(model, tc._docs(3, seed=7), tc.PROJ), s.spec)
    ids, mask = tc.tokenize([d["text"] for d in tc._docs(3, seed=7)])
    counts = ngram_counts(ids, mask).sum(0)
    kw = dict(store=str(store), pool_file=str(pool_file), q_rows=q_rows, tc=counts,
              method=method)
    one = run(_select, 1, out=str(tmp_path / "one"), **kw)[0]
    two = run(_select, 2, out=str(tmp_path / "two"), **kw)
    for got in two:
        np.testing.assert_allclose(got["scores"], one["scores"], rtol=1e-12, atol=1e-12)
        assert got["chosen"].tolist() == one["chosen"].tolist()
    a, b = ([json.loads(x) for x in (tmp_path / d / "subset.jsonl").read_text().splitlines()]
            for d in ("one", "two"))
    assert [x["sample_id"] for x in a] == [x["sample_id"] for x in b]
    np.testing.assert_allclose([x["score"] for x in a], [x["score"] for x in b], rtol=1e-12)
