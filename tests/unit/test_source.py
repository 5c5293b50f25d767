"""SOURCE (segment-wise unrolled influence) against an explicit dense reference.

Invariants: ``source`` scores equal ``sum_l G_train^(l) R_l S_{l+1} ... S_L G_q^T`` with, per
layer, ``H_l`` the checkpoint's EK-FAC (K-FAC) built as a ``[D, D]`` matrix from plain-torch
factors, ``S_l = matrix_exp(-eta_l K_l H_l)`` and ``R_l = (I - S_l) H_l^-1`` (no
eigen-formula shared with the library); a short segment is ``eta K`` times grad-dot, a long
one the influence function (``ekfac`` at power 1); missing steps or learning rates raise
errors naming the flag that fixes them; the registry and the tools see the method.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from dattri_ds import GradientCapture
from dattri_ds.errors import ConfigError, DattriDSError
from dattri_ds.methods import Checkpoint, fit_factors, make_attributor, registered_attributors
from dattri_ds.methods.source import Source, unroll_coefficients
from dattri_ds.ops.kronecker import KFACConfig
from reference import (
    perturbed, ref_kfac_factors, ref_kron_eigenbasis, reference_grads, rel_err, tiny_gpt2,
)

VOCAB = 31
F64 = KFACConfig(dtype="float64", power=1.0)
STEPS = [4, 10, 13]
LRS = [0.3, 0.2, 0.1]


def _capture(model, ids):
    """The captured batch and its per-example gradients ``{layer: [B, D]}`` in float64,
    built from the captured factors by plain torch (``G_b = sum_t g_bt a_bt^T``), so that
    the reference and the library see the same numbers: past a long segment, ``exp(-eta K
    h)`` multiplies float32 rounding differences of ``h`` by ``eta K h`` (hundreds here)."""
    with GradientCapture(model, probe_only=True) as cap:
        batch = cap.probe(lambda: model(input_ids=ids, labels=ids).loss)
    dense = {}
    for name, lg in batch.layers.items():
        if not lg.is_factorized:
            dense[name] = lg.data.values.double()
            continue
        a, g = lg.data.a, lg.data.g.double()
        a = F.one_hot(a, lg.shape[1]).double() if not a.is_floating_point() else a.double()
        dense[name] = torch.einsum("bto,bti->boi", g, a).reshape(g.shape[0], -1)
    ref = reference_grads(model, ids, labels=ids)
    assert all(rel_err(dense[n].float(), ref[n]) <= 1e-5 for n in dense)  # capture is right
    return batch, dense


@pytest.fixture(scope="module")
def trajectory():
    """Three perturbed snapshots of a tiny GPT-2 (every layer D < 300): per checkpoint the
    captured train / query batches, their dense per-example gradients and fp64 factors."""
    model = tiny_gpt2(seed=0, n_layer=1, n_embd=8, vocab=VOCAB, n_positions=16)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (5, 7), generator=gen)
    qids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    out = []
    for c in range(3):
        snap = perturbed(model, 0.1 * c, gen)
        train, rtrain = _capture(snap, ids)
        query, rquery = _capture(snap, qids)
        out.append({"train": train, "rtrain": rtrain, "query": query, "rquery": rquery,
                    "factors": fit_factors([train], config=F64)})
    return out


def _dense_curvature(lg, gt, method, damping):
    """``H = F + lambda I`` ``[D, D]`` of one layer from plain-torch factors (float64)."""
    gt = gt.double()
    if not lg.is_factorized:  # norm layers: the exact empirical Fisher block
        fisher = gt.T @ gt / gt.shape[0]
        evals = torch.linalg.eigvalsh(fisher).clamp_min(0)
    else:
        A, S = ref_kfac_factors(lg)
        l_s, l_a, q = ref_kron_eigenbasis(A, S)
        if method == "kfac":
            evals = torch.kron(l_s.clamp_min(0), l_a.clamp_min(0))
        else:
            evals = ((gt @ q) ** 2).mean(0)
        fisher = q @ torch.diag(evals) @ q.T
    lam = damping * evals.mean()
    return fisher + lam * torch.eye(fisher.shape[0], dtype=fisher.dtype)


def _dense_source(cks, horizons, method):
    """``sum_l G^(l) R_l S_{l+1} ... S_L G_q^T`` summed over layers, by matrix exponentials."""
    total = 0.0
    for name, lg in cks[-1]["train"].layers.items():
        u = cks[-1]["rquery"][name].double().T  # [D, Q]
        for c in range(len(cks) - 1, -1, -1):
            h = _dense_curvature(cks[c]["train"].layers[name], cks[c]["rtrain"][name], method,
                                 F64.damping)
            s = torch.linalg.matrix_exp(-horizons[c] * h)
            r = (torch.eye(h.shape[0], dtype=h.dtype) - s) @ torch.linalg.inv(h)
            total = total + cks[c]["rtrain"][name].double() @ r @ u
            u = s @ u
    return total


def _checkpoints(cks, steps=STEPS, lrs=LRS, one_shot=False):
    return [Checkpoint(iter([c["train"]]) if one_shot else [c["train"]], c["query"], lr,
                       c["factors"], step) for c, step, lr in zip(cks, steps, lrs)]


@pytest.mark.parametrize("method", ["ekfac", "kfac"])
@pytest.mark.parametrize("scale", [1.0, 300.0])
def test_source_equals_dense_unrolled_reference(trajectory, method, scale):
    """``source`` == the dense unrolled sum (fp64 factors; scores and query rows are float32,
    rel. err <= 1e-6 against the float64 reference), at learning rates
    where ``eta K lambda`` is small (scale 1) and where it reaches past 1 (scale 300), with
    one-shot training streams. Breaks if a segment uses another segment's factors, steps or
    lr, if the propagation order is reversed, or if a layer form is mishandled."""
    lrs = [scale * lr for lr in LRS]
    horizons = [lrs[0] * 4, lrs[0] * 6, lrs[1] * 3]  # eta_l = lr after checkpoint l-1
    want = _dense_source(trajectory, horizons, method)
    att = make_attributor("source", inner=method)
    per: list[torch.Tensor] = []
    got = att.trajectory_scores(iter(_checkpoints(trajectory, lrs=lrs, one_shot=True)),
                                per_checkpoint=per)
    assert Source.horizons(_checkpoints(trajectory, lrs=lrs)) == pytest.approx(horizons)
    assert rel_err(got.values.double(), want) <= 1e-6  # scores are returned as float32
    assert len(per) == 3 and rel_err(sum(per), got.values) <= 1e-6
    assert got.train_ids == trajectory[0]["train"].sample_ids
    # the query side R_l u_l itself (float32 rows, like every preconditioned query), per
    # layer and segment; the propagated u stays in the factors' float64 (past a long
    # segment what is left of g_q is ~1e-7 of it: wpe at scale 300)
    parts = att.unrolled_queries(_checkpoints(trajectory, lrs=lrs), horizons,
                                 trajectory[-1]["query"])
    for name in trajectory[-1]["query"].layers:
        u = trajectory[-1]["rquery"][name].T
        for c in range(2, -1, -1):
            h = _dense_curvature(trajectory[c]["train"].layers[name],
                                 trajectory[c]["rtrain"][name], method, F64.damping)
            s = torch.linalg.matrix_exp(-horizons[c] * h)
            r = (torch.eye(h.shape[0], dtype=h.dtype) - s) @ torch.linalg.inv(h)
            assert rel_err(parts[c].layers[name].data.values.double(), (r @ u).T) <= 1e-6, \
                (name, c)
            u = s @ u


def test_short_segment_is_eta_k_times_graddot(trajectory):
    """One segment with ``eta K lambda ~ 1e-9``: scores == ``eta K <g_n, g_q>``."""
    ck = trajectory[-1]
    got = make_attributor("source").trajectory_scores(
        [Checkpoint([ck["train"]], ck["query"], 1e-9, ck["factors"], 7)])
    dot = make_attributor("graddot").scores([ck["train"]], ck["query"]).values
    assert rel_err(got.values, 7e-9 * dot) <= 1e-6


def test_long_segment_is_the_influence_function(trajectory):
    """One segment with ``eta K lambda`` >> 1 for every (damped) eigenvalue: scores ==
    ``<g_n, (F + lambda)^-1 g_q>``, the ``ekfac`` method at power 1."""
    ck = trajectory[-1]
    got = make_attributor("source").trajectory_scores(
        [Checkpoint([ck["train"]], ck["query"], 1e12, ck["factors"], 1)])
    want = make_attributor("ekfac", factors=ck["factors"]).scores([ck["train"]], ck["query"])
    assert rel_err(got.values, want.values) <= 1e-6


def test_coefficients_limits():
    """``r = (1 - e^-x) / h`` and ``s = e^-x`` keep both limits in float64."""
    h = torch.tensor([0.0, 1e-20, 1e-3, 1.0, 1e6], dtype=torch.float64)
    r, s = unroll_coefficients(h, 2.0)
    assert torch.allclose(r[:2], torch.full((2,), 2.0, dtype=torch.float64))
    assert torch.allclose(r[2:], -torch.expm1(-2.0 * h[2:]) / h[2:], rtol=1e-14)
    assert torch.allclose(s, torch.exp(-2.0 * h))


def test_whitened_rows_score_like_exact_rows(trajectory):
    """Rows whitened by each checkpoint's factors (``collect --whiten``) with the query
    built in whitened coordinates score like the exact rows (the ``whitened=True`` path)."""
    cks = _checkpoints(trajectory)
    exact = make_attributor("source").trajectory_scores(cks)
    white = [ck._replace(train=[ck.factors.whiten(t) for t in ck.train]) for ck in cks]
    got = make_attributor("source", whitened=True).trajectory_scores(white)
    assert rel_err(got.values, exact.values) <= 1e-6


@pytest.mark.parametrize("field,value,match", [
    ("step", None, "--steps"), ("lr", None, "--lrs"), ("lr", 0.0, "--lrs"),
    ("step", 4, "not after the previous"), ("factors", None, "has no factors")])
def test_missing_schedule_names_the_fix(trajectory, field, value, match):
    """A checkpoint without a step, lr or factors (or out of order) raises a ConfigError
    naming the flag or call that fixes it."""
    cks = _checkpoints(trajectory)
    cks[1] = cks[1]._replace(**{field: value})
    with pytest.raises(ConfigError, match=match):
        make_attributor("source").trajectory_scores(cks)


def test_options_and_registry():
    """``source`` is registered as a curvature trajectory (so ``benchmarks/lds.py`` fits factors
    per checkpoint and ``attribute`` reads each checkpoint's lr); bad options raise."""
    from dattri_ds.recipe import Recipe

    assert registered_attributors()["source"] is Source
    recipe = Recipe(method="source")
    assert recipe.trajectory and recipe.curvature and recipe.inner == "ekfac"
    with pytest.raises(DattriDSError, match="uniform"):
        make_attributor("source", weighting="uniform")
    with pytest.raises(DattriDSError, match="no curvature"):
        make_attributor("source", inner="graddot")
    with pytest.raises(DattriDSError, match="at least one"):
        make_attributor("source").trajectory_scores([])
