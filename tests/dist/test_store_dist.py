"""A store written by 2 ZeRO-3 ranks holds exactly the ids and vectors a 1-rank store holds.

Invariant: sharding the writing over data-parallel ranks changes the layout on disk, never
the content: the merged reader sees the same examples with the same projected vectors.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import CaptureConfig, GradientCapture, ProjectionConfig
from dattri_ds.store import GradientStore, StoreCallback, StoreConfig
from reference import tiny_gpt2

from _dist import run
from test_zero import ds_config, global_examples

pytestmark = pytest.mark.dist
PROJ = ProjectionConfig(dim=48, seed=3)


def _write(rank, world, path, gas):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_gpt2(seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(3, gas))
    data = global_examples(8)
    per_rank = 8 // world
    mine = data[rank * per_rank:(rank + 1) * per_rank]
    cb = StoreCallback(StoreConfig(path=path, flush_every=3), projection=PROJ,
                       fingerprint="tiny-gpt2", rank=rank, world=world)
    with GradientCapture.for_engine(engine, CaptureConfig(projection=PROJ), callbacks=[cb]):
        for mb in range(per_rank // 2):
            ids = mine[2 * mb:2 * mb + 2]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()  # a boundary only after the last micro-batch: all see step-0 weights
    return True


def test_two_rank_store_equals_one_rank_store(need_deepspeed, tmp_path):
    """Same ids and vectors whether 1 rank (accumulation 4) or 2 ranks (accumulation 2) wrote
    the store: in both runs every example is captured before the first optimizer step."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run(_write, 1, path=one, gas=4)
    run(_write, 2, path=two, gas=2)
    with GradientStore.open(one) as a, GradientStore.open(two) as b:
        assert len(a) == len(b) == 8
        assert set(a.ids) == set(b.ids)
        va = a.read(slice(None))
        vb = b.read([b.index_of(i) for i in a.ids])
        assert torch.allclose(va, vb, rtol=1e-5, atol=1e-6), (va - vb).abs().max()
        assert len(list(b.layers)) == len(list(a.layers))


def test_scores_from_two_rank_store_equal_one_rank(need_deepspeed, tmp_path):
    """Attribution scores streamed from the 2-rank store equal those from the 1-rank store
    (and streaming in blocks of 1 equals one block)."""
    from dattri_ds import make_attributor

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run(_write, 1, path=one, gas=4)
    run(_write, 2, path=two, gas=2)
    with GradientStore.open(one) as a, GradientStore.open(two) as b:
        query = a.to_gradbatch([0, 3])
        gd = make_attributor("graddot")
        ids_a, sa = gd.scores(a.iter_batches(8), query)
        ids_b, sb = gd.scores(b.iter_batches(1), query)
        order = [ids_b.index(i) for i in ids_a]
        assert torch.allclose(sa, sb[order], rtol=1e-5, atol=1e-6)


def _save_zero3(rank, world, path):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_gpt2(seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(3, 1))
    ids = global_examples(4)[rank * 2:rank * 2 + 2]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(path, tag="step1")
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_zero3_checkpoint_loads_live_weights(need_deepspeed, tmp_path):
    """A ZeRO-3 checkpoint written by 2 ranks consolidates (CPU, no process group) to exactly
    the live model's weights."""
    from dattri_ds.integrations.checkpoints import load_state_dict

    live = run(_save_zero3, 2, path=str(tmp_path / "ckpt"))[0]
    state = load_state_dict(tmp_path / "ckpt", "step1")
    assert set(live) <= set(state)
    for name, w in live.items():
        assert torch.equal(state[name], torch.from_numpy(w)), name
    assert torch.equal(load_state_dict(tmp_path / "ckpt" / "step1")["lm_head.weight"],
                       torch.from_numpy(live["lm_head.weight"]))


def _hashes(rank, world, bump):
    import deepspeed

    from dattri_ds.store import weights_hash

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_gpt2(seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(3, 1))
    first = weights_hash(engine.module)
    placeholders = weights_hash(engine.module.state_dict())  # numel-0 tensors: no weights
    if bump and rank == world - 1:  # change one element of the last rank's slice only
        p = next(iter(engine.module.parameters()))
        with torch.no_grad():
            p.ds_tensor[0] += 1.0
    if bump:
        torch.distributed.barrier()
    return first, weights_hash(engine.module), placeholders


def test_zero3_weights_hash_covers_every_partition(need_deepspeed):
    """The manifest's weights hash of a ZeRO-3 module is computed from every rank's partition
    (no gather): equal on all ranks, unchanged for unchanged weights, changed when one rank's
    slice changes, and never the hash of the numel-0 placeholders ``state_dict`` returns."""
    same = run(_hashes, 2, bump=False)
    bumped = run(_hashes, 2, bump=True)
    assert same[0] == same[1]  # every rank records the same hash
    assert same[0][0] == same[0][1] == bumped[0][0]  # deterministic for the same weights
    assert bumped[0][1] == bumped[1][1] != bumped[0][0]  # the last rank's slice changed
    assert same[0][0] != same[0][2]
