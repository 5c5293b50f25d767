"""Online selection: scores are exact inner products; the policy does what its definition says.

Invariants: ``score_b = <g_b, mean_j g_target_j>`` with reference per-example gradients;
the policy (top-k plus a seeded uniform share) is a pure function of the scores; bad
configurations fail before any step.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import ConfigError, GradientCapture
from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget, top_k
from dattri_ds.selection.policy import mixed
from reference import reference_grads, rel_err, tiny_gpt2


RAW = dict(score="alignment", normalize=False, per_token=False, uniform_mix=0.0,
           smooth_neighbors=None, content_weight=0.0)  # plain <g_b, g_target>, top-k


def _setup(projection=None, model=None):
    torch.manual_seed(0)
    model = model or tiny_gpt2()
    cfg = SelectionConfig(enabled=True, projection=projection, refresh_every=3, **RAW)
    probe = OnlineSelector.probe_capture(model, cfg)
    tgt_ids = torch.randint(0, 97, (5, 10), generator=torch.Generator().manual_seed(1))
    target = ValidationTarget(probe, lambda b: model(**b).loss,
                              {"input_ids": tgt_ids, "labels": tgt_ids}, batch_size=2,
                              refresh_every=3)
    return model, cfg, probe, target, tgt_ids


def test_scores_equal_reference_inner_products():
    """score_b == <reference g_b, reference mean target gradient> summed over all layers."""
    model, cfg, probe, target, tgt_ids = _setup()
    sel = OnlineSelector(model, cfg, target, probe=probe)
    cand = torch.randint(0, 97, (6, 10), generator=torch.Generator().manual_seed(2))
    chosen = sel.select({"input_ids": cand, "labels": cand}, k=3, step=0)
    ref_c = reference_grads(model, cand)
    ref_t = reference_grads(model, tgt_ids)
    want = sum(ref_c[n] @ ref_t[n].mean(0) for n in ref_c)
    assert rel_err(chosen.scores, want) <= 1e-5
    assert chosen.indices.tolist() == sorted(torch.topk(want, 3).indices.tolist())
    assert chosen.batch["input_ids"].shape == (3, 10)
    assert all(p.grad is None for p in model.parameters())  # scoring touched no .grad
    sel.close()


def test_target_refresh_interval():
    """The target is recomputed only every refresh_every steps."""
    model, cfg, probe, target, _ = _setup()
    a = target.get(0)
    assert target.get(2) is a and target.refreshes == 1
    assert target.get(3) is not a and target.refreshes == 2
    probe.detach()


def test_projected_scores_track_exact_scores():
    """Projected scoring (k=256 per layer) ranks candidates like exact scoring (Spearman > .9)."""
    from dattri_ds import ProjectionConfig
    model, cfg, probe, target, _ = _setup()
    cand = torch.randint(0, 97, (12, 10), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": cand, "labels": cand}
    exact = OnlineSelector(model, cfg, target, probe=probe).score(batch, 0)[1]
    probe.detach()
    _, pcfg, pprobe, ptarget, _ = _setup(projection=ProjectionConfig(dim=256, kind="dense"),
                                         model=model)
    approx = OnlineSelector(model, pcfg, ptarget, probe=pprobe).score(batch, 0)[1]
    rank = lambda x: torch.argsort(torch.argsort(x)).double()  # noqa: E731
    assert torch.corrcoef(torch.stack([rank(exact), rank(approx)]))[0, 1] > 0.9
    pprobe.detach()


def test_policy_on_hand_made_scores():
    """top-k with ties to the lower index; the mix keeps the top ``k - round(mix * k)`` and
    draws the rest uniformly from the others, the same draw for the same generator seed."""
    s = torch.tensor([0.5, -1.0, 2.0, 0.1, 2.0])
    assert top_k(s, 2).tolist() == [2, 4] and top_k(s, 1).tolist() == [2]
    assert mixed(s, 2, uniform_mix=0.0, generator=torch.Generator()).tolist() == [2, 4]
    gen = torch.Generator().manual_seed(3)
    got = mixed(s, 4, uniform_mix=0.5, generator=gen)
    assert {2, 4} <= set(got.tolist()) and got.numel() == 4 and got.unique().numel() == 4
    again = mixed(s, 4, uniform_mix=0.5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, again)
    assert mixed(s, 9, uniform_mix=0.0, generator=gen).tolist() == [0, 1, 2, 3, 4]  # k <= C


def test_bad_selection_input_fails_early():
    """Empty target set, candidate multiple < 1, an unknown key: errors before any step."""
    with pytest.raises(ConfigError, match="candidate_multiple"):
        SelectionConfig(candidate_multiple=0.5)
    with pytest.raises(ConfigError, match="policy"):
        SelectionConfig.from_dict({"policy": "greats"})  # removed after 0eb5305
    model = tiny_gpt2()
    with GradientCapture(model, probe_only=True) as probe:
        empty = torch.zeros(0, 10, dtype=torch.long)
        with pytest.raises(ConfigError, match="target set is empty"):
            ValidationTarget(probe, lambda b: model(**b).loss, {"input_ids": empty})


def test_target_tokenized_differently_is_refused():
    """Target data from another tokenizer or with another sequence length fails at start."""
    from dattri_ds.data import load_documents, tokenize_documents, train_tokenizer
    from dattri_ds.selection import check_target_compatible

    docs = load_documents("data/tiny/train.jsonl")[:40]
    tok_a = train_tokenizer([d.text for d in docs], vocab_size=300)
    tok_b = train_tokenizer([d.text for d in docs[:20]], vocab_size=300)
    train = tokenize_documents(docs[:10], tok_a, 16)
    check_target_compatible(train, tokenize_documents(docs[10:12], tok_a, 16))
    with pytest.raises(ConfigError, match="tokenized with"):
        check_target_compatible(train, tokenize_documents(docs[10:12], tok_b, 16))
    with pytest.raises(ConfigError, match="seq_len"):
        check_target_compatible(train, tokenize_documents(docs[10:12], tok_a, 24))


def test_normalized_scores_divide_by_candidate_norms():
    """normalize=True: score_b = <g_b, g_target> / ||g_b|| with reference gradients."""
    model, _, probe, target, tgt_ids = _setup()
    cfg = SelectionConfig(enabled=True, **{**RAW, "normalize": True})
    cand = torch.randint(0, 97, (5, 10), generator=torch.Generator().manual_seed(6))
    got = OnlineSelector(model, cfg, target, probe=probe).score(
        {"input_ids": cand, "labels": cand}, 0)[1]
    ref_c = reference_grads(model, cand)
    ref_t = reference_grads(model, tgt_ids)
    dots = sum(ref_c[n] @ ref_t[n].mean(0) for n in ref_c)
    norm = torch.cat([ref_c[n] for n in ref_c], 1).norm(dim=1)
    assert rel_err(got, dots / norm) <= 1e-5
    probe.detach()


def test_selection_log_is_rewritten_per_run_and_merged(tmp_path):
    """Each run rewrites its log (training restarts at step 0, so appending would repeat
    steps); logs of DP ranks a previous, wider run left behind are removed; the reader
    merges rank files ordered by (step, rank)."""
    from dattri_ds.selection import log_file, read_selection_log

    log = tmp_path / "selection.jsonl"
    stale = log_file(log, 3)
    stale.write_text('{"step": 0, "dp_rank": 3, "chosen": ["x"]}\n')
    assert stale.name == "selection.dp3.jsonl"
    cand = torch.randint(0, 97, (4, 10), generator=torch.Generator().manual_seed(2))
    for _run in range(2):
        model, cfg, probe, target, _ = _setup()
        sel = OnlineSelector(model, cfg, target, probe=probe, log_path=log)
        for step in range(3):
            chosen = sel.select({"input_ids": cand, "labels": cand}, k=2, step=step)
        sel.close()
    records = read_selection_log(log)
    assert [r["step"] for r in records] == [0, 1, 2] and not stale.exists()
    assert records[-1]["chosen"] == list(chosen.chosen_ids)
    log_file(log, 1).write_text('{"step": 1, "dp_rank": 1, "chosen": ["y"]}\n')
    assert [(r["step"], r["dp_rank"]) for r in read_selection_log(log)] == \
        [(0, 0), (1, 0), (1, 1), (2, 0)]


def _poison_rows(model, rows, when_batch: int):
    """Make the embedding output of candidate ``rows`` NaN in forwards of ``when_batch``
    examples (the candidate batch, not the target batches)."""
    def hook(module, args, out):
        if out.shape[0] == when_batch:
            return out.index_fill(0, torch.tensor(rows), float("nan"))
    return model.transformer.wte.register_forward_hook(hook)


def test_nonfinite_candidate_is_dropped_not_its_batch():
    """A candidate whose gradient is NaN is dropped (named in a warning); the others keep
    their exact scores and the choice is made among them. Breaks if the whole candidate
    batch is dropped, or if positions shift (a kept index pointing at the wrong example)."""
    model, cfg, probe, target, tgt_ids = _setup()
    sel = OnlineSelector(model, cfg, target, probe=probe)
    cand = torch.randint(0, 97, (6, 10), generator=torch.Generator().manual_seed(2))
    target.get(0)  # the target is computed before the poison
    handle = _poison_rows(model, [2], 6)
    with pytest.warns(UserWarning, match=r"NaN/inf per-example gradient for 1 example"):
        chosen = sel.select({"input_ids": cand, "labels": cand}, k=3, step=0)
    handle.remove()
    keep = [0, 1, 3, 4, 5]
    ref_c = reference_grads(model, cand[keep])
    ref_t = reference_grads(model, tgt_ids)
    want = sum(ref_c[n] @ ref_t[n].mean(0) for n in ref_c)
    assert rel_err(chosen.scores, want) <= 1e-5
    top = sorted(keep[i] for i in torch.topk(want, 3).indices.tolist())
    assert chosen.indices.tolist() == top
    assert torch.equal(chosen.batch["input_ids"], cand[top])
    sel.close()


def test_all_nonfinite_candidates_say_so():
    """Every candidate non-finite: a CaptureError that says so, not 'the loss does not
    depend on any captured layer'."""
    from dattri_ds.errors import CaptureError
    model, cfg, probe, target, _ = _setup()
    sel = OnlineSelector(model, cfg, target, probe=probe)
    cand = torch.randint(0, 97, (4, 10), generator=torch.Generator().manual_seed(2))
    target.get(0)
    handle = _poison_rows(model, [0, 1, 2, 3], 4)
    with pytest.warns(UserWarning), pytest.raises(CaptureError, match="Every candidate of step 0"):
        sel.select({"input_ids": cand, "labels": cand}, k=2, step=0)
    handle.remove()
    sel.close()
