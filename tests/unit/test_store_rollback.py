"""store.shard.rollback_to_step: an elastic resume drops the rows captured from a step on.

Invariant: after ``rollback_to_step(root, s)`` a reader sees exactly the rows of steps < s,
with their bytes (the commit cut inside keeps its first rows, its digests recomputed, so a
verifying reader accepts it); a writer reopening the shard appends right after them; a
sealed store is unsealed; a shard whose rows are not in step order is refused untouched.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds.store import GradientStore, GradientStoreWriter, StoreConfig, StoreCorruptError
from dattri_ds.store import seal_store
from dattri_ds.store.shard import rollback_to_step

from test_store import FINGERPRINT, PROJ, make_batch
from dattri_ds.store import StoreSpec


def _write(root, steps_ids, rank=0, world=2, flush=3):
    spec = StoreSpec.from_batch(make_batch(["x"]), projection=PROJ, fingerprint=FINGERPRINT)
    with GradientStoreWriter(StoreConfig(path=str(root), flush_every=flush), spec, rank=rank,
                             world=world) as w:
        for step, ids in steps_ids:
            w.append(make_batch(ids, step=step))
    return spec


def test_rollback_keeps_the_rows_before_the_step(tmp_path):
    """Shard 0: steps 0,1,2 in commits of 3 rows (the cut falls inside one); shard 1: only
    step 0 (untouched). After rolling back to step 2 the store reads exactly the rows of
    steps 0 and 1, verified eagerly, equal to before; a reopened writer appends after them."""
    spec = _write(tmp_path, [(0, ["a", "b"]), (1, ["c", "d"]), (2, ["e", "f"])])
    _write(tmp_path, [(0, ["g"])], rank=1)
    seal_store(tmp_path)
    with GradientStore.open(tmp_path) as s:
        before = {i: s.read([s.index_of(i)]) for i in s.ids}
    assert rollback_to_step(tmp_path, 2) == {0: 2}
    with pytest.raises(StoreCorruptError, match="incomplete"):
        GradientStore.open(tmp_path, require_complete=True)
    with GradientStore.open(tmp_path, verify="eager") as s:
        assert sorted(s.ids) == ["a", "b", "c", "d", "g"]
        assert all(torch.equal(s.read([s.index_of(i)]), before[i]) for i in s.ids)
    assert rollback_to_step(tmp_path, 2) == {}
    with GradientStoreWriter(StoreConfig(path=str(tmp_path)), spec, rank=0, world=1) as w:
        assert w.committed_rows == 4 and not w.has("e")
        w.append(make_batch(["e2"], step=2))
    with GradientStore.open(tmp_path, verify="eager") as s:
        assert sorted(s.ids) == ["a", "b", "c", "d", "e2", "g"]


def test_rollback_refuses_rows_out_of_step_order(tmp_path):
    """A shard with a step-0 row after a step-2 row (not one run's capture) is refused and
    left as it was."""
    _write(tmp_path, [(2, ["a"]), (0, ["b"])], world=1)
    with pytest.raises(StoreCorruptError, match="not written by one training run"):
        rollback_to_step(tmp_path, 1)
    with GradientStore.open(tmp_path) as s:
        assert sorted(s.ids) == ["a", "b"]
