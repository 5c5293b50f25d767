"""K-FAC / EK-FAC factors and preconditioning against explicit dense references.

Invariants: preconditioning with the Kronecker factors equals ``G_train (F + lambda I)^-1
G_query^T`` with ``F`` built by ``torch.kron`` of plain-torch factors and inverted as a
``[D, D]`` matrix (EK-FAC: ``F = Q diag(L) Q^T``, ``Q = kron(Q_S, Q_A)``); factors fitted in
parts and merged equal one pass; Kronecker-projected factors are ``P A P^T``; padding tokens
change nothing; bad inputs raise errors naming the layer.
"""

from __future__ import annotations

import json

import pytest
import torch

from dattri_ds import GradientCapture, GradBatch, LayerGrad, Dense
from dattri_ds.errors import DattriDSError, ShapeError
from dattri_ds.layers import get_kind
from dattri_ds.ops import ProjectionConfig, Projector, cross_gram, kron_dims, project_batch
from dattri_ds.ops.kronecker import KFACConfig, KFACFactors
from reference import (
    perturbed, ref_kfac_factors, ref_kron_eigenbasis, reference_grads, rel_err, tiny_gpt2,
)

TOL = 1e-5
VOCAB = 31


def _capture(model, ids, mask=None):
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    with GradientCapture(model, probe_only=True) as cap:
        batch = cap.probe(lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    ref = reference_grads(model, ids, attention_mask=mask, labels=labels)
    return batch, ref


@pytest.fixture(scope="module")
def setup():
    """Tiny GPT-2 (every layer D < 300): a padded train batch and a query batch."""
    model = tiny_gpt2(seed=0, n_layer=1, n_embd=8, vocab=VOCAB, n_positions=16)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (6, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    mask[4, 5:] = 0
    train, rtrain = _capture(model, ids, mask)
    query, rquery = _capture(model, torch.randint(1, VOCAB, (3, 7), generator=gen))
    return model, train, rtrain, query, rquery


F64 = KFACConfig(dtype="float64")  # exactness tests: float64 sums and rotations


def _fit(batches, config=F64, projector=None, ekfac=True):
    f = KFACFactors(config, projector)
    for b in batches:
        f.update(b)
    f.reduce().eigendecompose()
    if ekfac:
        for b in batches:
            f.update_correction(b)
        f.reduce()
    return f


def _ref_influence(gt, gq, A, S, method, damping, mode="relative", full=True,
                   power=KFACConfig().power):
    """``gt (F + lambda I)^-1 gq^T`` with F explicit ``[D, D]``; when A is None (dense-only
    kinds) F is the exact empirical Fisher ``gt^T gt / N`` (``full``) or its diagonal."""
    gt, gq = gt.double(), gq.double()
    if A is None:  # dense-only kinds: empirical Fisher, exact block or diagonal
        evals = gt.pow(2).mean(0)  # the diagonal: same mean as the eigenvalues (trace / D)
        fisher = gt.T @ gt / gt.shape[0] if full else torch.diag(evals)
    else:
        q = ref_kron_eigenbasis(A, S)[2]
        if method == "kfac":
            fisher = torch.kron(S, A)
            evals = torch.diagonal(fisher)  # same mean as the eigenvalues: trace(F) / D
        else:
            evals = ((gt @ q) ** 2).mean(0)
            fisher = q @ torch.diag(evals) @ q.T
    lam = damping * evals.mean() if mode == "relative" else damping
    h = fisher + lam * torch.eye(fisher.shape[0], dtype=fisher.dtype)
    if power == 1.0:
        return gt @ torch.linalg.inv(h) @ gq.T
    w, v = torch.linalg.eigh((h + h.T) / 2)  # h^-power of the explicit [D, D] matrix
    return gt @ (v * w.pow(-power)) @ v.T @ gq.T


def _per_layer_reference(train, rtrain, rquery, method, damping, mode="relative", proj=None,
                         full=True, power=KFACConfig().power):
    out = {}
    for name, lg in train.layers.items():
        gt, gq = rtrain[name], rquery[name]
        if lg.is_factorized:
            sides = proj.get(name) if proj else None
            A, S = ref_kfac_factors(lg, *(sides or ()))
            if sides is not None:
                k = torch.kron(*sides)
                gt, gq = gt @ k.T, gq @ k.T
        else:
            A = S = None
        out[name] = _ref_influence(gt, gq, A, S, method, damping, mode, full, power)
    return out


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
@pytest.mark.parametrize("damping,mode", [(0.1, "relative"), (1e-3, "absolute")])
@pytest.mark.parametrize("full_max,norm_form", [(1024, "full"), (0, "diagonal")])
@pytest.mark.parametrize("power", [1.0, 0.5])
def test_influence_equals_dense_kron_reference(setup, method, damping, mode, full_max,
                                               norm_form, power):
    """Every kind (embedding/conv1d/linear/layernorm): factors -> scores == [D, D] inverse
    (``(F + lambda)^-power``), on the query side and as whitened rows on both sides.

    Layernorm rows get the exact Fisher block by default (``full_max``), the diagonal
    when ``full_max`` is below their width."""
    _, train, rtrain, query, rquery = setup
    f = _fit([train], KFACConfig(damping=damping, damping_mode=mode, dtype="float64",
                                 full_max=full_max, power=power))
    pq = f.precondition(query, method)
    got = cross_gram(train, pq, per_layer=True)
    white = cross_gram(f.whiten(train, method), f.whiten(query, method), per_layer=True)
    want = _per_layer_reference(train, rtrain, rquery, method, damping, mode,
                                full=norm_form == "full", power=power)
    assert {lf.form.name for lf in f.layers.values()} == {"kron", "kron_index", norm_form}
    for name in want:
        assert rel_err(got[name], want[name].float()) <= TOL, name
        assert rel_err(white[name], want[name].float()) <= TOL, name


def test_large_damping_approaches_graddot(setup):
    """lambda -> inf: lambda^p <g_n, (F + lambda)^-p g_q> -> <g_n, g_q> (K-FAC and EK-FAC,
    the default power p)."""
    _, train, _, query, _ = setup
    lam = 1e9
    f = _fit([train], KFACConfig(damping=lam, damping_mode="absolute"))
    dot = cross_gram(train, query)
    for method in ("kfac", "ekfac"):
        scaled = cross_gram(train, f.precondition(query, method)) * lam ** f.config.power
        assert rel_err(scaled, dot) <= 1e-4


def test_parts_merged_equal_one_pass_and_save_load(setup, tmp_path):
    """Factor and EK-FAC sums of two halves, merged, equal one pass (stand-in for 2 ranks)."""
    _, train, _, query, _ = setup
    halves = [train.index([0, 1, 2]), train.index([3, 4, 5])]
    one = _fit([train])
    parts = [KFACFactors(F64) for _ in halves]
    for p, h in zip(parts, halves):
        p.update(h)
    merged = parts[0].merge(parts[1]).reduce().eigendecompose()
    corr = [merged.copy() for _ in halves]
    for c, h in zip(corr, halves):
        c.update_correction(h)
    merged = corr[0].merge(corr[1]).reduce()
    for name, lf in one.layers.items():
        for k, t in lf.sums.items():
            assert rel_err(merged.layers[name].sums[k], t) <= 1e-10, (name, k)
    want = one.precondition(query)
    for name, lg in merged.precondition(query).layers.items():
        assert rel_err(lg.data.values, want.layers[name].data.values) <= TOL, name
    merged.save(tmp_path / "f.pt")
    back = KFACFactors.load(tmp_path / "f.pt")
    assert back.has_correction and back.config == merged.config
    for name, lg in back.precondition(query).layers.items():
        assert torch.equal(lg.data.values, merged.precondition(query).layers[name].data.values)


def test_factor_files_keep_their_power(setup, tmp_path):
    """A factor file keeps the power it was fitted with (and its fingerprint); one written
    before ``KFACConfig.power`` existed (no key) loads with the exact inverse it was used
    with. Breaks if loading silently applies today's default to an old file."""
    _, train, _, query, _ = setup
    f = _fit([train], KFACConfig(power=0.6))
    f.save(tmp_path / "f.pt")
    loaded = KFACFactors.load(tmp_path / "f.pt")
    assert loaded.config.power == 0.6
    # the fingerprint a whitened store records: same factors, same print; another power not
    again = _fit([train], KFACConfig(power=0.6))
    assert loaded.fingerprint() == f.fingerprint() == again.fingerprint()
    assert _fit([train], KFACConfig(power=1.0)).fingerprint() != f.fingerprint()
    state = torch.load(tmp_path / "f.pt", weights_only=True)
    old = json.loads(state["config"])
    del old["power"]
    state["config"] = json.dumps(old)
    torch.save(state, tmp_path / "old.pt")
    back = KFACFactors.load(tmp_path / "old.pt")
    assert back.config.power == 1.0
    want = cross_gram(train, _fit([train], KFACConfig(power=1.0)).precondition(query))
    assert rel_err(cross_gram(train, back.precondition(query)), want) <= TOL


def test_padding_tokens_change_nothing(setup):
    """Appending zero-gradient tokens (with random activations) leaves the factors unchanged."""
    _, train, _, _, _ = setup
    layers = {}
    for name, lg in train.layers.items():
        d = lg.data
        if lg.is_factorized:
            pad_a = d.a[:, :3] if not d.a.is_floating_point() else torch.randn_like(d.a[:, :3])
            d = type(d)(torch.cat([d.a, pad_a], 1), torch.cat([d.g, 0 * d.g[:, :3]], 1))
        layers[name] = lg.replace(data=d)
    padded = GradBatch(0, train.sample_ids, layers)
    a, b = _fit([train], ekfac=False), _fit([padded], ekfac=False)
    for name, lf in a.layers.items():
        for k, t in lf.sums.items():
            assert rel_err(b.layers[name].sums[k], t) <= 1e-12, (name, k)


def test_kronecker_projected_factors(setup):
    """LoGra: projected factors == P_in A P_in^T, P_out S P_out^T; scores == projected reference.

    EK-FAC eigenvalues accumulated from projected store rows equal those from factors.
    """
    _, train, rtrain, query, rquery = setup
    proj = Projector(ProjectionConfig(kind="kronecker", dim=16, seed=3))
    f = _fit([train], projector=proj)
    sides = {}
    for name, lg in train.layers.items():
        o, i = lg.shape
        if not lg.is_factorized or o * i <= 16:
            continue
        ko, ki = kron_dims(16, o, i)
        sides[name] = (proj.side(name, "out", ko, o, torch.device("cpu")),
                       proj.side(name, "in", ki, i, torch.device("cpu")))
        A, S = ref_kfac_factors(lg)
        fa, fs = f.layers[name].form.covariances(f.layers[name].sums)
        p_out, p_in = (s.double() for s in sides[name])
        assert rel_err(fa, p_in @ A @ p_in.T) <= 1e-6 and rel_err(fs, p_out @ S @ p_out.T) <= 1e-6
    assert len(sides) >= 4
    store_train = project_batch(train, proj)
    store_query = project_batch(query, proj)
    for method in ("kfac", "ekfac"):
        want = _per_layer_reference(train, rtrain, rquery, method, F64.damping, proj=sides)
        got = cross_gram(store_train, f.precondition(store_query, method), per_layer=True)
        got_f = cross_gram(store_train, f.precondition(query, method), per_layer=True)
        for name in want:
            # A full Fisher block of 6 examples is rank-deficient: the preconditioned query's
            # null-space part (amplified 1/lambda) cancels against float32 train rows.
            tol = 5 * TOL if f.layers[name].form.name == "full" else TOL
            assert rel_err(got[name], want[name].float()) <= tol, (method, name)
            assert rel_err(got_f[name], got[name]) <= tol, (method, name)
    from_rows = f.copy()
    from_rows._reduced.discard("lam")
    for lf in from_rows.layers.values():
        if lf.form.lam_keys:
            lf.sums["lam"].zero_()
            lf.sums["lam_examples"].zero_()
    from_rows.update_correction(store_train)
    for name, lf in f.layers.items():
        if lf.form.lam_keys:
            assert rel_err(from_rows.layers[name].sums["lam"], lf.sums["lam"]) <= 1e-5, name


def test_bad_inputs_name_the_layer(setup):
    """Unknown layer, shape/projection mismatch, wrong width, missing EK-FAC pass, dense fit."""
    _, train, rtrain, query, _ = setup
    name = "transformer.h.0.mlp.c_fc"
    f = _fit([train.index([0, 1])], ekfac=False)
    sub = KFACFactors()
    sub.update(GradBatch(0, train.sample_ids, {name: train.layers[name]}))
    sub.reduce().eigendecompose()
    with pytest.raises(ShapeError, match="transformer.wte.*no curvature factors"):
        sub.precondition(query, "kfac")
    lg = query.layers[name]
    with pytest.raises(ShapeError, match=name):
        f.precondition_layer(lg.replace(kind=get_kind("linear")), "kfac")
    with pytest.raises(DattriDSError, match="update_correction"):
        f.precondition(query, "ekfac")
    with pytest.raises(ShapeError, match=f"{name}.*factorized form"):
        dense = train.layers[name].replace(data=Dense(rtrain[name]))
        KFACFactors().update(GradBatch(0, train.sample_ids, {name: dense}))
    proj = Projector(ProjectionConfig(kind="kronecker", dim=16, seed=0))
    fp = _fit([train], projector=proj, ekfac=False)
    other = project_batch(query, Projector(ProjectionConfig(kind="kronecker", dim=16, seed=1)))
    with pytest.raises(ShapeError, match=f"{name}.*projection"):
        fp.precondition_layer(other.layers[name], "kfac")
    bad = project_batch(query, proj).layers[name]
    bad = bad.replace(data=Dense(bad.data.values[:, :-1]))
    with pytest.raises(ShapeError, match=f"{name}.*16 columns"):
        fp.precondition_layer(bad, "kfac")
    fp.reduce()  # the EK-FAC phase's reduce
    with pytest.raises(DattriDSError, match="twice"):
        fp.reduce()


@pytest.mark.parametrize("method,weighting", [("ekfac", "uniform"), ("kfac", "lr"),
                                              ("ekfac", "normalized")])
def test_trajectory_equals_sum_of_per_checkpoint_dense_references(setup, method, weighting):
    """``<method>-trajectory`` == sum_c w_c G_train^(c) (F_c + lambda_c I)^-1 G_query^(c)T.

    Three weight snapshots, each with its own factors fitted by ``fit_factors``; the
    reference builds every checkpoint's ``[D, D]`` curvature independently (``torch.kron``
    of plain-torch factors) and sums. Breaks if a checkpoint's factors are reused for
    another checkpoint, if weights are applied wrongly, or if checkpoints are dropped.
    """
    from dattri_ds.methods import Checkpoint, fit_factors, make_attributor

    model = setup[0]
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (5, 7), generator=gen)
    qids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    lrs = [0.3, 0.2, 0.1]
    cks, want = [], 0.0
    for c, lr in enumerate(lrs):
        snap = perturbed(model, 0.1 * c, gen)
        train, rtrain = _capture(snap, ids)
        query, rquery = _capture(snap, qids)
        cks.append(Checkpoint([train], query, lr, fit_factors([train], config=F64)))
        ref = _per_layer_reference(train, rtrain, rquery, method, F64.damping)
        ref = sum(ref.values())
        w = {"lr": lr, "uniform": 1.0, "normalized": 1 / ref.std(0, keepdim=True)}[weighting]
        want = want + w * ref
    att = make_attributor(f"{method}-trajectory", weighting=weighting)
    per: list[torch.Tensor] = []
    got = att.trajectory_scores(iter(cks), per_checkpoint=per)
    assert rel_err(got.values, want.float()) <= TOL
    assert len(per) == 3 and rel_err(sum(per), got.values) <= 1e-6
    single = make_attributor(method, factors=cks[1].factors).scores(cks[1].train, cks[1].query)
    w1 = {"lr": lrs[1], "uniform": 1.0,
          "normalized": 1 / single.values.std(0, keepdim=True)}[weighting]
    assert rel_err(per[1], w1 * single.values) <= 1e-6
    with pytest.raises(DattriDSError, match="Checkpoint 0 has no factors"):
        att.trajectory_scores([cks[0]._replace(factors=None)])


def test_float32_default_equals_float64_scores(setup):
    """KFACConfig's float32 default (sums and eigenbasis rotations) gives the float64 scores.

    Guards the issue-11 change: rotations honour ``KFACConfig.dtype``; the scores must not
    move beyond float32 rounding (relative error <= 1e-4, correlation 1 - 1e-8).
    """
    _, train, _, query, _ = setup
    assert KFACConfig().dtype == "float32"
    for method in ("kfac", "ekfac"):
        s32 = cross_gram(train, _fit([train], KFACConfig()).precondition(query, method))
        s64 = cross_gram(train, _fit([train], F64).precondition(query, method))
        assert rel_err(s32, s64) <= 1e-4, method
        r = torch.corrcoef(torch.stack([s32.flatten(), s64.flatten()]).double())[0, 1]
        assert r >= 1 - 1e-8, method


def _scaled(batch: GradBatch, c: float) -> GradBatch:
    """The batch with every output-gradient factor multiplied by ``c`` (loss scaled by c)."""
    from dattri_ds.gradient import Factorized

    layers = {n: lg.replace(data=Factorized(lg.data.a, lg.data.g * c))
              if lg.is_factorized else lg.replace(data=Dense(lg.data.values * c))
              for n, lg in batch.layers.items()}
    return GradBatch(batch.step, batch.sample_ids, layers, batch.micro_batch,
                     batch.token_counts)


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_default_damping_is_deterministic_and_spectrum_relative(setup, method):
    """The default damping (``KFACConfig.damping`` 0.003, relative) and power (0.8) are
    documented behaviour: refitting gives bit-identical influence (deterministic: no
    data-dependent search), and ``lambda = 0.003 * mean eigenvalue`` per layer makes the
    influence invariant to the loss scale up to one constant factor (gradients x c:
    eigenvalues and lambda scale by c^2, scores by ``c^2 * c^(-2 power)``: every ranking
    unchanged), where an absolute damping is not. Breaks if the default stops being
    relative to each layer's spectrum or becomes nondeterministic."""
    _, train, _, query, _ = setup
    cfg = KFACConfig()
    assert (cfg.damping, cfg.damping_mode, cfg.power) == (0.003, "relative", 0.8)
    one, two = _fit([train], cfg), _fit([train], cfg)
    s1 = cross_gram(train, one.precondition(query, method))
    assert torch.equal(s1, cross_gram(train, two.precondition(query, method)))
    c = 10.0
    big_t, big_q = _scaled(train, c), _scaled(query, c)
    scaled = _fit([big_t], cfg)
    factor = c ** (2 - 2 * cfg.power)
    assert rel_err(cross_gram(big_t, scaled.precondition(big_q, method)), factor * s1) <= 1e-4
    absolute = KFACConfig(damping=1e6, damping_mode="absolute")  # dominates: ~ dot / 1e6
    a1 = cross_gram(train, _fit([train], absolute).precondition(query, method))
    a2 = cross_gram(big_t, _fit([big_t], absolute).precondition(big_q, method))
    assert rel_err(a2, c * c * a1) <= 1e-2 and rel_err(a2, a1) > 1


@pytest.mark.parametrize("d", [3, 256, 511, 700, 1030])
def test_blocked_gram_equals_the_full_product(d):
    """add_gram_ (upper block triangle, mirrored) == out + x^T x, for widths that split
    unevenly into blocks and for one-block widths; exactly symmetric."""
    from dattri_ds.layers.factor_forms import add_gram_
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(64, d, generator=gen)
    out = torch.randn(d, d, generator=gen)
    want = out + x.T @ x
    got = add_gram_(out.clone(), x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    sym = add_gram_(torch.zeros(d, d), x)
    assert torch.equal(sym, sym.T)


@pytest.mark.parametrize("seq", [5, 16])
def test_rotation_route_by_cost_gives_the_reference(seq):
    """EK-FAC with sequences short (T=5: factors rotated first) and long (T=16: the cost
    model materializes first, T above the widths of this model's linears) == the explicit
    [D, D] reference; the route taken is the cost model's decision."""
    from dattri_ds.layers.base import LayerDims
    from dattri_ds.ops.inner import default_cost_model
    model = tiny_gpt2(seed=1, n_layer=1, n_embd=8, vocab=VOCAB, n_positions=16)
    gen = torch.Generator().manual_seed(seq)
    train, rtrain = _capture(model, torch.randint(1, VOCAB, (4, seq), generator=gen))
    query, rquery = _capture(model, torch.randint(1, VOCAB, (2, seq), generator=gen))
    f = _fit([train], KFACConfig(damping=0.1, dtype="float64"))
    got = cross_gram(train, f.precondition(query, "ekfac"), per_layer=True)
    want = _per_layer_reference(train, rtrain, rquery, "ekfac", 0.1)
    routes = set()
    for name, lf in f.layers.items():
        assert rel_err(got[name], want[name].float()) <= TOL, name
        if lf.form.routed_rotation:
            o, i = lf.dims
            routes.add(default_cost_model().choose("rotate", name,
                                                   LayerDims(4, seq, i, o, itemsize=8)).path)
    assert routes == ({"ghost"} if seq == 5 else {"dense"})
