"""The cascade (``selection.shortlist``) and the controller under ZeRO-3 on 2 gloo ranks.

Invariant: on each rank, over two micro-batches of that rank's own candidates, the
shortlist, the probed candidates' scores (<= 1e-5 fp32) and the chosen examples equal those
of the same cascade run in one process on an unpartitioned copy of the weights with the
same target documents; the scores equal the per-example autograd cosine; ranks probe the
same number of candidates (ZeRO-3's parameter gathers stay matched). The controller runs
the same arm on every rank at every step, from all-reduced measurements.
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


def _controller_arms(rank, world):
    """The run-time controller under ZeRO-3 with measured CPU costs (which differ between
    ranks): every rank runs the same arm at every step (the probe's parameter gathers stay
    matched) and reports the same allocation; the held-out loss equals one process's."""
    from dattri_ds.selection.controller import HeldOutLoss

    engine, ctx, ref = _zero3_engine()
    tgt = torch.randint(0, 97, (9, T), generator=torch.Generator().manual_seed(7))
    cfg = SelectionConfig(enabled=True, score="alignment",
                          validation_fraction=0.34, controller=True,
                          controller_block=1, controller_window=3, shortlist=1.5,
                          refresh_every=100)
    sel = OnlineSelector.for_target_data(engine.module, cfg, {"input_ids": tgt, "labels": tgt},
                                         ctx=ctx)
    arms = []
    for step in range(7):
        ids = torch.randint(0, 97, (2 * K, T),
                            generator=torch.Generator().manual_seed(60 + 10 * rank + step))
        sel.select({"input_ids": ids, "labels": ids}, K, step)
        arms.append(sel.controller._arm)
    summary = sel.summary()["controller"]
    held = tgt[2::3]  # split_rows(9, 0.34): every third document held out
    loss_zero = HeldOutLoss(engine.module, {"input_ids": held, "labels": held}, ctx)()
    loss_one = HeldOutLoss(ref, {"input_ids": held, "labels": held})()
    sel.close()
    return dict(arms=arms, history=summary["history"], costs=[
        v["cost"] for v in summary["arms"].values()], loss_err=abs(loss_zero - loss_one))


def test_controller_under_zero3_runs_the_same_arm_on_every_rank(need_deepspeed):
    """ZeRO-3 (2 gloo ranks): the same arms, allocation and (all-reduced) costs on both
    ranks; the held-out loss equals one process's (<= 1e-5)."""
    a, b = run(_controller_arms, 2)
    assert a["arms"] == b["arms"] and a["history"] == b["history"] and a["costs"] == b["costs"]
    assert set(a["arms"]) == {"uniform", "content", "gradient"}
    assert a["loss_err"] <= 1e-5 and b["loss_err"] <= 1e-5
