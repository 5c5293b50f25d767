"""The cascade (``selection.shortlist``) under ZeRO-3 on 2 gloo ranks.

Invariant: on each rank, over two micro-batches of that rank's own candidates, the
shortlist, the probed candidates' scores (<= 1e-5 fp32) and the chosen examples equal those
of the same cascade run in one process on an unpartitioned copy of the weights with the
same target documents; the scores equal the per-example autograd cosine; ranks probe the
same number of candidates (ZeRO-3's parameter gathers stay matched).
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds.selection import OnlineSelector, SelectionConfig
from reference import rel_err, tiny_gpt2

from _dist import run

pytestmark = pytest.mark.dist
K, T = 4, 8


def _zero3_engine():
    """A ZeRO-3 engine on tiny GPT-2, its data-parallel context and a gathered plain copy."""
    import deepspeed

    from dattri_ds.distributed import ParallelContext

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_gpt2(seed=0)
    cfg = {"train_micro_batch_size_per_gpu": K, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
           "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        ref = tiny_gpt2(seed=0)
        ref.load_state_dict({n: p.detach().clone()
                             for n, p in engine.module.named_parameters()}, strict=False)
    return engine, ParallelContext.from_default_group(), ref


def _cascade_vs_one_process(rank, world):
    from reference import reference_grads

    engine, ctx, ref = _zero3_engine()
    tgt = torch.randint(0, 97, (6, T), generator=torch.Generator().manual_seed(7))
    cfg = SelectionConfig(enabled=True, score="alignment",
                          per_token=False, shortlist=1.5, uniform_mix=0.5,
                          smooth_neighbors=2, refresh_every=100)
    docs = {"input_ids": tgt, "labels": tgt}
    zero = OnlineSelector.for_target_data(engine.module, cfg, docs, ctx=ctx)
    one = OnlineSelector.for_target_data(ref, cfg, docs)
    out = {"score_err": 0.0, "autograd_err": 0.0, "same": True, "probed": []}
    for step in range(2):
        ids = torch.randint(0, 97, (2 * K, T),
                            generator=torch.Generator().manual_seed(40 + 10 * rank + step))
        ids[::3, :4] = tgt[0, :4]
        a = zero.select({"input_ids": ids, "labels": ids}, K, step)
        b = one.select({"input_ids": ids, "labels": ids}, K, step)
        rc, rt = reference_grads(ref, ids[a.probed]), reference_grads(ref, tgt)
        flat = torch.cat([rc[n] for n in rc], 1)
        want = sum(rc[n] @ rt[n].mean(0) for n in rc) / flat.norm(dim=1)
        out["score_err"] = max(out["score_err"], rel_err(a.scores, b.scores))
        out["autograd_err"] = max(out["autograd_err"], rel_err(a.scores, want))
        out["same"] &= (a.probed.tolist() == b.probed.tolist()
                        and a.indices.tolist() == b.indices.tolist())
        out["probed"].append(a.probed.numel())
    out["summary"] = zero.summary()["cascade"]
    zero.close()
    one.close()
    return out


def test_cascade_under_zero3_equals_one_process(need_deepspeed):
    """ZeRO-3 (2 gloo ranks) cascade == one-process cascade: shortlist, scores, choice."""
    res = run(_cascade_vs_one_process, 2)
    for r in res:
        assert r["score_err"] <= 1e-5 and r["autograd_err"] <= 1e-5, r
        assert r["same"] and r["probed"] == [3, 3], r
    assert res[0]["summary"] == res[1]["summary"]
    assert res[0]["summary"]["probed"] == 12 and res[0]["summary"]["candidates"] == 32
