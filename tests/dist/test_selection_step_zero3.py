"""The cheaper selection step under ZeRO-3 (2 gloo ranks) equals the exact single-process path.

Invariant: truncated scoring (``top_blocks``) with the default scoring (cosine, per-token)
under ZeRO-3 partitioned parameters gives, on every rank, the exact scores of that rank's
candidates over the top blocks' layers (per-example autograd on a plain copy of the
gathered weights, the target averaged over the rows of both ranks), <= 1e-5 fp32; and the
full-scoring path still agrees with the same reference over every layer.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget
from reference import reference_grads, rel_err, tiny_gpt2

from _dist import run

pytestmark = pytest.mark.dist
T = 8


def _scores_under_zero3(rank, world, top_blocks):
    import deepspeed

    from dattri_ds.distributed import ParallelContext

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_gpt2(seed=0, n_layer=3)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    ctx = ParallelContext.from_default_group()
    tgt = torch.randint(0, 97, (6, T), generator=torch.Generator().manual_seed(7))
    cand = torch.randint(0, 97, (4, T), generator=torch.Generator().manual_seed(20 + rank))
    cfg = SelectionConfig(enabled=True, score="alignment", top_blocks=top_blocks)
    probe = OnlineSelector.probe_capture(engine.module, cfg)
    target = ValidationTarget(probe, lambda b: engine.module(**b).loss,
                              {"input_ids": tgt, "labels": tgt}, ctx=ctx)
    selector = OnlineSelector(engine.module, cfg, target, probe=probe, ctx=ctx)
    got = selector.score({"input_ids": cand, "labels": cand}, 0)[1]
    layers = sorted(probe.layers)
    from dattri_ds.selection import stepcost

    stepcost.REUSE_CALL_OVERHEAD_S = 0.0  # so that only the partitioned parameters decide
    assert not selector.scorer.reusing(T, 4, 2) and "ZeRO-3" in selector.scorer.why
    selector.close()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        ref = tiny_gpt2(seed=0, n_layer=3)
        ref.load_state_dict({n: p.detach().clone()
                             for n, p in engine.module.named_parameters()}, strict=False)
    rc = reference_grads(ref, cand, per_example_loss="mean", layers=layers)
    rt = reference_grads(ref, tgt, per_example_loss="mean", layers=layers)
    want = sum(rc[n] @ rt[n].mean(0) for n in layers)
    want = want / sum(rc[n].pow(2).sum(1) for n in layers).sqrt()
    return dict(err=rel_err(got, want), layers=len(layers))


@pytest.mark.parametrize("top_blocks", [1, None])
def test_truncated_scores_under_zero3_equal_exact(need_deepspeed, top_blocks):
    """top_blocks=1 (and full scoring) under ZeRO-3 on 2 ranks == exact single-process."""
    res = run(_scores_under_zero3, 2, top_blocks=top_blocks)
    for r in res:
        assert r["err"] <= 1e-5, r
        assert r["layers"] == (6 if top_blocks == 1 else 22), r


def _engine(model):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              "zero_allow_untested_optimizer": True}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                config=config)[0]


def _step(engine, batch, loss=None):
    """One optimizer step; returns (full gradients, full parameters after the step)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    engine.backward(engine(**batch).loss if loss is None else loss)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    engine.step()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return grads, state


def _reuse_vs_subset(rank, world, top_blocks):
    import copy

    import deepspeed

    from dattri_ds.distributed import ParallelContext

    deepspeed.init_distributed(dist_backend="gloo")
    base = tiny_gpt2(seed=0, n_layer=3)
    eng_sel, eng_ref = _engine(copy.deepcopy(base)), _engine(copy.deepcopy(base))
    ctx = ParallelContext.from_default_group()
    tgt = torch.randint(0, 97, (6, T), generator=torch.Generator().manual_seed(7))
    cand = torch.randint(0, 97, (4, T), generator=torch.Generator().manual_seed(30 + rank))
    mask = torch.ones_like(cand)
    mask[0, 5:] = 0
    cand = {"input_ids": cand, "attention_mask": mask, "labels": cand.masked_fill(mask == 0, -100)}
    cfg = SelectionConfig(enabled=True, score="alignment",
                          reuse_forward="on", top_blocks=top_blocks)
    probe = OnlineSelector.probe_capture(eng_sel.module, cfg)
    target = ValidationTarget(probe, lambda b: eng_sel.module(**b).loss,
                              {"input_ids": tgt, "labels": tgt}, ctx=ctx)
    selector = OnlineSelector(eng_sel.module, cfg, target, probe=probe, ctx=ctx)
    sel = selector.select(cand, 2, 0, train_loss=True)
    assert sel.loss is not None
    g_sel, p_sel = _step(eng_sel, sel.batch, sel.loss)
    selector.close()
    g_ref, p_ref = _step(eng_ref, sel.batch)
    return dict(grad_err=max(rel_err(g_sel[n], g_ref[n]) for n in g_ref),
                param_err=max(rel_err(p_sel[n], p_ref[n]) for n in p_ref),
                moved=max(rel_err(p_sel[n], base.state_dict()[n]) for n in p_sel))


@pytest.mark.parametrize("top_blocks", [1, None])
def test_reused_forward_update_under_zero3_equals_subset_update(need_deepspeed, top_blocks):
    """reuse_forward under ZeRO-3 (the chosen examples' probe graphs back-propagated by
    engine.backward) == a ZeRO-3 engine trained on the chosen subset: grads, SGD params."""
    res = run(_reuse_vs_subset, 2, top_blocks=top_blocks)
    for r in res:
        assert r["grad_err"] <= 1e-5 and r["param_err"] <= 1e-5 and r["moved"] > 1e-4, r
