"""Stores that follow the cluster: a rank killed mid-collect on one "node" of two loses
nothing the other committed, and a rerun on another number of ranks completes the store.

Layout: ``dattri-ds collect`` as two torchrun agents (``--nnodes 2 --nproc_per_node 1``,
c10d rendezvous on this host); global rank 1 SIGKILLs itself right after its second commit
(``--flush-every 2``, so it had committed 4 rows and was computing more), rank 0 on the
other node loses its peer mid-collect. The store is then finished by ``collect`` on 3
processes of one node (N = 3 ranks appending to a store written by M = 2).

Invariants: every row committed before the kill is still there, bit for bit, at the head of
its shard (committed rows are never rewritten); the finished store holds every example
exactly once (0 rows lost, 0 duplicated: ``GradientStore.open`` refuses duplicates) with the
rows of an uninterrupted collect on 2 ranks; ``fit --store`` and ``attribute`` read the
mixed store (shards of 2 and 3 writers): the same factors, and the same scores example by
example, as from the uninterrupted store.
Breaks when a restarted collect recomputes stored examples into another shard (duplicates),
skips ones that were never committed (lost), or truncates a shard it does not own.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _deps import require

from _dist import run
from test_multinode import ROOT, TINY, _ok, _tool, _train, nodes, train_argv

pytestmark = pytest.mark.dist

#: collect, with global rank 1 killed (SIGKILL) right after its second commit.
KILLER = """
import os, signal, sys
from dattri_ds.store import shard

_commit, _done = shard.ShardAppender.commit, []
def commit(self, *a, **k):
    _commit(self, *a, **k)
    _done.append(1)
    if os.environ["RANK"] == "1" and len(_done) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
shard.ShardAppender.commit = commit
from dattri_ds.cli.exits import run
from dattri_ds.tools.collect import main
sys.exit(run(main))
"""


def _committed(store: Path) -> dict[int, tuple[list[str], np.ndarray]]:
    """Every shard's committed ids and raw data bytes, read from its index (no reader)."""
    from dattri_ds.store.format import ShardIndex, list_shards, read_committed_ids, row_bytes
    from dattri_ds.store.spec import load_manifest

    spec, dtype = load_manifest(store)
    nbytes = row_bytes(spec.width, dtype)
    out = {}
    for paths in list_shards(store):
        index = ShardIndex.load(paths.index, paths.rank)
        ids, _ = read_committed_ids(paths, index)
        out[paths.rank] = (ids, np.fromfile(paths.data, dtype=np.uint8)[:index.rows * nbytes])
    return out


def test_kill9_one_node_mid_collect_loses_nothing_committed(tmp_path):
    """Kill -9 of rank 1 mid-collect on 2 nodes, then finish on 3 ranks: the invariants of
    the module docstring (rows committed before the kill kept bit for bit; the store equals
    an uninterrupted one, each example once; attribute reads the mix to the same scores)."""
    require("deepspeed", "deepspeed")
    run_dir = tmp_path / "run"
    run(_train, 1, timeout=300, argv=train_argv(tmp_path, run_dir, 2))
    collect = ["--run-dir", str(run_dir), "--data", TINY, "--max-docs", "24", "--projection-dim",
               "32", "--batch-size", "2", "--flush-every", "2", "--checkpoints", "step2"]
    run(_tool, 2, timeout=300, name="collect", argv=[*collect, "--out", str(tmp_path / "ref")])

    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    out = tmp_path / "grads"
    done = nodes(str(killer), [*collect, "--out", str(out)])
    assert any(d.returncode != 0 for d in done)  # a rank died: the launch failed
    assert (out / "step2" / "info.json").exists(), [d.stdout[-2000:] for d in done]
    before = _committed(out / "step2")
    assert len(before[1][0]) == 4  # rank 1 committed twice (2 rows each) before the kill
    from dattri_ds.store import GradientStore

    with pytest.raises(Exception, match="incomplete"):  # never read as a finished store
        GradientStore.open(out / "step2", require_complete=True)

    added = run(_tool, 3, timeout=300, name="collect", argv=[*collect, "--out", str(out)])
    after = _committed(out / "step2")
    for rank, (ids, data) in before.items():  # committed rows: still there, bit for bit
        assert after[rank][0][:len(ids)] == ids
        assert np.array_equal(after[rank][1][:data.size], data)
    with GradientStore.open(tmp_path / "ref" / "step2", require_complete=True) as ref, \
            GradientStore.open(out / "step2", require_complete=True) as got:
        assert len(got) == len(set(got.ids)) == len(ref) == 24  # none lost, none twice
        assert set(got.ids) == set(ref.ids)
        assert sum(a["step2"] for a in added) == 24 - sum(len(i) for i, _ in before.values())
        assert torch.allclose(got.read([got.index_of(i) for i in ref.ids]),
                              ref.read(slice(None)), rtol=1e-5, atol=1e-7)

    factors = []
    for name, store in (("ref", tmp_path / "ref"), ("mix", out)):  # fit --store reads the mix
        _tool(0, 1, "fit", ["--run-dir", str(run_dir), "--data", TINY, "--max-docs", "8",
                            "--checkpoint", "step2", "--store", str(store), "--out",
                            str(tmp_path / f"f-{name}.pt")])
        factors.append(torch.load(tmp_path / f"f-{name}.pt", weights_only=False))
    from test_multinode import _same_nested
    _same_nested(*factors)

    scores = {}
    for name, store in (("ref", tmp_path / "ref"), ("mix", out)):
        dest = tmp_path / f"attr-{name}"
        _tool(0, 1, "attribute", ["--run-dir", str(run_dir), "--store", str(store), "--queries",
                                  str(ROOT / "data/tiny/target.jsonl"), "--query-max-docs",
                                  "2", "--truncate", "--method", "graddot", "--out", str(dest)])
        ids = json.loads((dest / "train_ids.json").read_text())
        s = np.load(dest / "scores.npy")
        scores[name] = {i: s[k] for k, i in enumerate(ids)}
    assert scores["ref"].keys() == scores["mix"].keys()
    for i, row in scores["ref"].items():
        np.testing.assert_allclose(scores["mix"][i], row, rtol=1e-4, atol=1e-6)
