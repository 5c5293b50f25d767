"""The cheaper selection step (issue 11): truncated scoring against the exact path.

Invariants: ``top_blocks=N`` scores equal the exact (per-example autograd) scores restricted
to the layers of the last N blocks, with the default scoring (cosine, per-token); the probe
backward never reaches the blocks below (no gradient is computed for their outputs); bad
settings fail at construction.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import ConfigError
from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget
from dattri_ds.selection.blocks import find_blocks, top_block_patterns
from reference import reference_grads, rel_err, tiny_gpt2


def _ids(n, seed, t=10):
    return torch.randint(0, 97, (n, t), generator=torch.Generator().manual_seed(seed))


def _selector(model, cfg, tgt):
    probe = OnlineSelector.probe_capture(model, cfg)
    target = ValidationTarget(probe, lambda b: model(**b).loss, tgt, batch_size=2)
    return OnlineSelector(model, cfg, target, probe=probe)


def _block_layers(model, first_block):
    return [n for n in reference_grads(model, _ids(1, 0)) if n.startswith("transformer.h.")
            and int(n.split(".")[2]) >= first_block]


def test_top_blocks_finds_the_block_list():
    """GPT-2's blocks are transformer.h; top 1 of 3 is block 2 (and all its sub-layers)."""
    model = tiny_gpt2(n_layer=3)
    assert find_blocks(model) == ("transformer.h", 3)
    assert top_block_patterns(model, 1) == ("transformer.h.2", "transformer.h.2.*")
    probe = OnlineSelector.probe_capture(model, SelectionConfig(score="alignment", top_blocks=1))
    assert sorted(probe.layers) == sorted(_block_layers(model, 2))
    probe.detach()


@pytest.mark.parametrize("n", [1, 2])
def test_top_block_scores_equal_exact_scores_of_those_layers(n):
    """Cosine scoring of mean-token loss gradients on the top n of 3 blocks
    equals <g_b, mean_q g_q> / ||g_b|| over exactly those layers, from per-example
    autograd."""
    model = tiny_gpt2(n_layer=3)
    tgt, cand = _ids(4, 1), _ids(6, 2)
    tgt, cand = {"input_ids": tgt, "labels": tgt}, {"input_ids": cand, "labels": cand}
    sel = _selector(model, SelectionConfig(score="alignment", top_blocks=n), tgt)
    got = sel.score(cand, 0)[1]
    layers = _block_layers(model, 3 - n)
    rc = reference_grads(model, cand["input_ids"], per_example_loss="mean", layers=layers)
    rt = reference_grads(model, tgt["input_ids"], per_example_loss="mean", layers=layers)
    dot = sum(rc[k] @ rt[k].mean(0) for k in layers)
    norm = sum(rc[k].pow(2).sum(1) for k in layers).sqrt()
    assert rel_err(got, dot / norm) <= 1e-5
    sel.close()


def _hits_below(model, cfg):
    """Times a gradient reached block 0's output during one scoring pass."""
    hits = []

    def fwd_hook(_m, _a, out):
        h = out[0] if isinstance(out, tuple) else out
        if h.requires_grad:
            h.register_hook(lambda g: hits.append(1))
    handle = model.transformer.h[0].register_forward_hook(fwd_hook)
    ids = _ids(3, 5)
    sel = _selector(model, cfg, {"input_ids": ids, "labels": ids})
    sel.target.get(0)
    hits.clear()
    sel.score({"input_ids": _ids(4, 6), "labels": _ids(4, 6)}, 0)
    handle.remove()
    sel.close()
    return len(hits)


def test_truncated_probe_backward_stops_above_the_scored_blocks():
    """top_blocks=2 of 3: no gradient is ever computed for block 0's output (the backward
    stops at block 1); full scoring does reach it (so the hook really observes)."""
    model = tiny_gpt2(n_layer=3)
    assert _hits_below(model, SelectionConfig(score="alignment")) == 1
    assert _hits_below(model, SelectionConfig(score="alignment", top_blocks=2)) == 0


def test_bad_top_blocks_fail_early():
    """More blocks than the model has, or top_blocks together with include: ConfigError."""
    with pytest.raises(ConfigError, match="at most 2"):
        OnlineSelector.probe_capture(tiny_gpt2(), SelectionConfig(score="alignment",
                                                                  top_blocks=3))
    with pytest.raises(ConfigError, match="only"):
        SelectionConfig(score="alignment", top_blocks=1, include=("lm_head",))
    with pytest.raises(ConfigError):
        SelectionConfig(score="alignment", top_blocks=0)


def test_step_cost_units_and_probe_share():
    """The cost model's units (selection/stepcost.py table) on hand-picked sizes, and the
    probe share: top 1 of 3 blocks -> 1/3, every layer (embeddings) -> 1, head only -> 1/3."""
    from dattri_ds.selection.blocks import probe_share
    from dattri_ds.selection.stepcost import StepCost

    plan = StepCost(candidates=16, trained=8, share=0.25, normalize=True, target_examples=64,
                    refresh_every=10)
    assert plan.units() == {"probe forward": 16.0, "probe backward": 4.0, "scoring": 8.0,
                            "training step": 24.0, "target refresh": 9.6}
    assert plan.ratio() == pytest.approx(61.6 / 24)
    assert plan.bound() == pytest.approx(44 / 24)
    model = tiny_gpt2(n_layer=3)
    every = [n for n, _ in model.named_modules() if n.startswith("transformer.")]
    assert probe_share(model, _block_layers(model, 2)) == pytest.approx(1 / 3)
    assert probe_share(model, every) == 1.0
    assert probe_share(model, ["lm_head"]) == pytest.approx(1 / 3)


def _padded(n, seed):
    """Examples of different lengths (pads masked out of the loss), so the token-mean
    over a batch differs from the mean of per-example means."""
    ids = _ids(n, seed)
    mask = torch.ones_like(ids)
    for b in range(n):
        mask[b, 3 + b % 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_reused_forward_gives_the_batch_loss_gradients_and_scores():
    """reuse_forward: Selection.loss equals the model's loss on the chosen batch and its
    backward the same parameter gradients (<= 1e-5); the scores equal those of the batched
    probe; no candidate's graph is forwarded twice (one model call per candidate)."""
    model = tiny_gpt2(n_layer=2)
    tgt, cand = _padded(4, 1), _padded(6, 2)
    base = SelectionConfig(score="alignment", uniform_mix=0.0)
    plain = _selector(model, base, tgt)
    want_scores = plain.score(cand, 0)[1]
    plain.close()
    sel = _selector(model, SelectionConfig(score="alignment", uniform_mix=0.0,
                                           reuse_forward="on"), tgt)
    sel.target.get(0)
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    got = sel.select(cand, 3, 0, train_loss=True)
    handle.remove()
    assert len(calls) == 6 and rel_err(got.scores, want_scores) <= 1e-5
    model.zero_grad(set_to_none=True)
    got.loss.backward()
    g_reuse = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(**got.batch).loss
    ref.backward()
    assert rel_err(got.loss.detach(), ref.detach()) <= 1e-6
    assert max(rel_err(g_reuse[n], p.grad) for n, p in model.named_parameters()) <= 1e-5
    model.zero_grad(set_to_none=True)
    sel.close()


def test_reuse_forward_decision_and_refusals(monkeypatch):
    """auto: on for an unpartitioned CPU model whose saved forwards outweigh the per-call
    overhead when the caller trains on Selection.loss; off for callers that forward the
    chosen themselves, for small per-example work, and with a recording capture attached (it
    would not see the trained forward), where 'on' is refused."""
    from dattri_ds import GradientCapture
    from dattri_ds.selection import stepcost

    model = tiny_gpt2()
    ids = _ids(4, 1)
    batch = {"input_ids": ids, "labels": ids}
    small = _selector(model, SelectionConfig(score="alignment"), batch)
    assert small.select(batch, 2, 0, train_loss=True).loss is None and not small.scorer.reuse
    monkeypatch.setattr(stepcost, "REUSE_CALL_OVERHEAD_S", 0.0)
    auto = _selector(model, SelectionConfig(score="alignment"), batch)
    assert auto.select(batch, 2, 0, train_loss=True).loss is not None and auto.plan.reuse
    assert auto.select(batch, 2, 1).loss is None
    with GradientCapture(model):
        assert auto.select(batch, 2, 2, train_loss=True).loss is None and not auto.scorer.reuse
        on = _selector(model, SelectionConfig(score="alignment", reuse_forward="on"), batch)
        with pytest.raises(ConfigError, match="capture"):
            on.select(batch, 2, 0, train_loss=True)
    for s in (small, auto, on):
        s.close()
