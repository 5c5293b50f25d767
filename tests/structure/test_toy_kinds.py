"""A new layer kind and a new projection kind are each one class, defined here.

Invariant: registering ``PointwiseConv1dKind`` (``nn.Conv1d`` with kernel 1, one class),
``SubsampleKind`` (a seeded coordinate-subsampling projection, one class) and
``LopsidedKind`` (a factorized, shardable Kronecker projection with another split of k, one
class), all defined in this file (in fixtures, so they are unregistered after), with no
library file edited, is enough for the whole pipeline: capture -> project -> cross_gram ->
EK-FAC (``fit_factors`` + ``make_attributor("ekfac")``), tensor-parallel shards, stores and
LoGra factors, and every result equals the same maths done on per-example gradients from
autograd (one backward per example) or on the captured exact rows. It breaks if an op
switches on kind names, if projection dispatches on a fixed list of kinds, or if the
curvature code assumes the built-in kinds.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from dattri_ds import CaptureConfig, GradientCapture, fit_factors, make_attributor
from dattri_ds.errors import UnsupportedLayerError
from dattri_ds.gradient import Factorized
from dattri_ds.layers.base import unregister_kind
from dattri_ds.layers.outer import OuterProductKind, with_bias_column
from dattri_ds.ops import cross_gram, materialize, project_batch
from dattri_ds.ops.projection import (
    PROJECTION_KINDS, KroneckerKind, ProjectionConfig, ProjectionKind, Projector, stable_seed,
)
from reference import rel_err

TOL = 1e-4
B, C, L = 6, 5, 7  # examples, input channels, positions (the token axis T)


@pytest.fixture(scope="module")
def toy():
    """The two toy classes, registered for this module's tests only (unregistered after, so
    other tests still see ``nn.Conv1d`` as unsupported and the built-in projection kinds)."""

    class PointwiseConv1dKind(OuterProductKind, name="toy_conv1d_k1", modules=(nn.Conv1d,)):
        """``nn.Conv1d(kernel_size=1)``: ``y[:, :, l] = W x[:, :, l] + b``, a linear layer per
        position over channel-first ``[B, C, L]`` inputs. Canonical layout ``[O, I (+1)]``."""

        def matches(self, module):
            return isinstance(module, nn.Conv1d) and module.kernel_size == (1,)

        def check(self, module, name):
            if module.groups != 1 or module.stride != (1,) or module.padding not in ((0,), "valid"):
                raise UnsupportedLayerError(f"Layer '{name}': only groups=1, stride 1, no padding")

        def layer_shape(self, module):
            return module.out_channels, module.in_channels + int(module.bias is not None)

        def build(self, module, a, g):
            a3 = a.transpose(1, 2).contiguous()  # [B, C, L] -> [B, T=L, I]
            if module.bias is not None:
                a3 = with_bias_column(a3)
            return Factorized(a3, g.transpose(1, 2).contiguous())

        def canonical(self, module, grads):
            w = grads["weight"].squeeze(-1)
            if "bias" in grads:
                w = torch.cat([w, grads["bias"].unsqueeze(-1)], dim=-1)
            return w.flatten(-2)


    class SubsampleKind(ProjectionKind, name="toy_subsample"):
        """``k`` seeded coordinates of the flattened gradient, scaled by ``sqrt(D / k)`` (an
        unbiased inner-product estimate; matrix-free)."""

        def matrix_bytes(self, k, o, i):
            return 8 * k

        def flops(self, k, o, i, t):
            return 2.0 * t * o * i

        def columns(self, projector: Projector, layer: str, d: int) -> torch.Tensor:
            gen = torch.Generator().manual_seed(stable_seed(projector.config.seed, layer, "toy"))
            return torch.randperm(d, generator=gen)[:projector.config.dim]

        def project(self, projector, lg, cost, path=None):
            rows = lg.kind.rows(lg.data, lg.shape)
            cols = self.columns(projector, lg.name, rows.shape[1]).to(rows.device)
            return rows[:, cols] * math.sqrt(rows.shape[1] / cols.numel())

    yield PointwiseConv1dKind, SubsampleKind
    unregister_kind(PointwiseConv1dKind.name)
    PROJECTION_KINDS.unregister(SubsampleKind.name)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(C, 8, 1), nn.Tanh(), nn.Conv1d(8, 3, 1, bias=False))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example losses ``[B]``: squared error summed over channels and positions."""
    return 0.5 * (out - y).pow(2).sum((1, 2))


def _capture(model, x, y, ids, projection=None):
    cfg = CaptureConfig(loss_reduction="sum", label_shift=0, projection=projection)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no input_ids: ids come from tag()
        with GradientCapture(model, cfg) as cap:
            cap.tag(ids)
            _loss(model(x), y).sum().backward()
            batch = cap.pop()
    model.zero_grad(set_to_none=True)
    return batch


def _autograd(kind, model, x, y) -> dict[str, torch.Tensor]:
    """``{layer: [B, D]}`` canonical per-example gradients, one backward per example."""
    out: dict[str, list[torch.Tensor]] = {"0": [], "2": []}
    for b in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        _loss(model(x[b:b + 1]), y[b:b + 1]).sum().backward()
        for name in out:
            m = model[int(name)]
            out[name].append(kind.canonical(m, {k: p.grad for k, p in m.named_parameters()}))
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(v).detach() for n, v in out.items()}


def _data(seed: int, n: int = B):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, C, L, generator=g), torch.randn(n, 3, L, generator=g)


def test_toy_kinds_capture_project_cross_gram(toy):
    """Capture gives the autograd per-example gradients; the toy projection of the captured
    factors equals the same columns of the autograd rows; cross_gram of projected train x
    query rows equals the reference dot products."""
    model = _model()
    x, y = _data(1)
    xq, yq = _data(2, 3)
    train = _capture(model, x, y, [f"t{i}" for i in range(B)])
    assert {lg.kind_name for lg in train.layers.values()} == {"toy_conv1d_k1"}
    kind, toy_projection = toy[0](), toy[1]()
    ref, ref_q = _autograd(kind, model, x, y), _autograd(kind, model, xq, yq)
    for name, lg in train.layers.items():
        assert rel_err(materialize(lg), ref[name]) <= TOL

    cfg = ProjectionConfig(kind="toy_subsample", dim=10, seed=3)
    projector = Projector(cfg)
    ptrain = project_batch(train, projector)
    pquery = _capture(model, xq, yq, ["q0", "q1", "q2"], projection=cfg)  # projected in capture
    want = 0
    for name in ("0", "2"):
        d = ref[name].shape[1]
        cols = toy_projection.columns(projector, name, d)
        scale = math.sqrt(d / cols.numel())
        assert ptrain.layers[name].projection == cfg.tag == pquery.layers[name].projection
        assert rel_err(ptrain.layers[name].data.values, ref[name][:, cols] * scale) <= TOL
        want = want + (ref[name][:, cols] * scale) @ (ref_q[name][:, cols] * scale).T
    assert rel_err(cross_gram(ptrain, pquery), want) <= TOL


def _ekfac_reference(lf, g_train, g_query, damping, power, whiten=False):
    """EK-FAC from autograd gradients in the fitted eigenbasis: ``L = mean_b (Q_S^T G_b
    Q_A)^2``, scores ``<G_n, Q_S [(Q_S^T G_q Q_A) / (L + lambda)^p] Q_A^T>``."""
    o, i = lf.dims
    q_s, q_a = lf.eig["q_s"], lf.eig["q_a"]
    rot = lambda g: q_s.T @ g.double().view(-1, o, i) @ q_a  # noqa: E731
    lam = rot(g_train).pow(2).mean(0)
    inv = (lam + damping * lam.mean()).pow(-power)
    if whiten:
        return lam, rot(g_train) * inv.sqrt(), rot(g_query) * inv.sqrt()
    pre = q_s @ (rot(g_query) * inv) @ q_a.T
    return lam, g_train.double() @ pre.reshape(pre.shape[0], -1).T


def test_toy_kind_ekfac_matches_autograd(toy):
    """EK-FAC on the toy kind: the corrected eigenvalues and the influence scores (exact, and
    whitened then toy-projected) equal the reference computed from autograd gradients."""
    model = _model()
    x, y = _data(3)
    xq, yq = _data(4, 3)
    train = _capture(model, x, y, [f"t{i}" for i in range(B)])
    query = _capture(model, xq, yq, ["q0", "q1", "q2"])
    kind, toy_projection = toy[0](), toy[1]()
    ref, ref_q = _autograd(kind, model, x, y), _autograd(kind, model, xq, yq)
    factors = fit_factors([train])
    cfg = factors.config
    assert {lf.form.name for lf in factors.layers.values()} == {"kron"}
    assert all(lf.form is kind.factor_form(lf.shape[0] * lf.shape[1], cfg.full_max)
               for lf in factors.layers.values())  # the kind hands out the form object

    scores = make_attributor("ekfac", factors=factors).scores([train], query).values
    want = 0
    for name, lf in factors.layers.items():
        lam, s = _ekfac_reference(lf, ref[name], ref_q[name], cfg.damping, cfg.power)
        got_lam = lf.sums["lam"].double() / float(lf.sums["lam_examples"])
        assert rel_err(got_lam, lam) <= TOL
        want = want + s
    assert rel_err(scores.double(), want) <= 1e-3

    projector = Projector(ProjectionConfig(kind="toy_subsample", dim=12, seed=5))
    ekfac = make_attributor("ekfac", factors=factors, projector=projector, whitened=True)
    got = ekfac.scores([ekfac.train_rows(train)], query).values
    want = 0
    for name, lf in factors.layers.items():
        _, r_train, r_query = _ekfac_reference(lf, ref[name], ref_q[name], cfg.damping,
                                               cfg.power, whiten=True)
        d = r_train[0].numel()
        cols = toy_projection.columns(projector, name, d)
        scale = math.sqrt(d / cols.numel())
        pt = r_train.reshape(B, -1)[:, cols] * scale
        pq = r_query.reshape(3, -1)[:, cols] * scale
        want = want + pt @ pq.T
    assert rel_err(got.double(), want) <= 1e-3


@pytest.mark.parametrize("projection", ["kronecker", "toy_subsample"])
def test_toy_kinds_plan_a_run(toy, projection):
    """The planner reads every layer's terms from its kind: a model made of toy-kind layers
    plans a run (nothing in dattri_ds/plan/ names a kind), with the toy projection too. Its
    parameters and parameter tensors are the real model's, its captured factor bytes are
    those of a real capture, its store is the width of a real projected capture, its
    projection matrices are the toy projection's ``matrix_bytes`` and every layer is routed."""
    from dattri_ds.layers import get_kind
    from dattri_ds.plan import LayerShape, ModelShape, RunSpec, captured_factor_bytes, plan

    conv = get_kind(toy[0].name)

    class ToyShape(ModelShape):
        def captured_layers(self):
            return [LayerShape("0", conv, C + 1, 8, bias=True), LayerShape("2", conv, 8, 3)]

    shape = ToyShape(family="llama", layers=1, hidden=8, heads=1, kv_heads=1, head_dim=8,
                     intermediate=8, vocab=3)
    model = _model()
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.param_tensors == len(list(model.parameters()))
    x, y = _data(5)
    batch = _capture(model, x, y, [f"t{i}" for i in range(B)])
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    spec = RunSpec(seq_len=L, micro_batch=B, dtype="float32", world=1, zero_stage=0,
                   projection=projection, k=10, examples=7, store_dtype="float32")
    assert captured_factor_bytes(shape, spec, B) == {
        "inputs": sum(nbytes(lg.data.a) for lg in batch.layers.values()),
        "grads": sum(nbytes(lg.data.g) for lg in batch.layers.values()), "dense": 0}

    cfg = ProjectionConfig(kind=projection, dim=10, seed=1)
    projected = _capture(model, x, y, [f"t{i}" for i in range(B)], projection=cfg)
    width = sum(lg.data.values.shape[1] for lg in projected.layers.values())
    p = plan(shape, "cpu", spec)
    assert p.store_bytes == 7 * width * 4
    assert set(p.routing) == {"0", "2"}
    if projection == "toy_subsample":
        assert p.memory["projections"] == 2 * toy[1]().matrix_bytes(10, 8, C + 1)


def test_kind_for_asks_instance_matchers_per_module(toy):
    """``kind_for`` resolves a module class once, yet a kind whose ``matches`` reads the module
    (the toy kind: the kernel size) is still asked for each module, and a marked module
    (``MARK_PREFIX``, e.g. a Megatron decoder's norm) asks every kind."""
    from dattri_ds.layers.base import MARK_PREFIX, kind_for

    assert kind_for(nn.Conv1d(2, 2, 1)).name == "toy_conv1d_k1"
    assert kind_for(nn.Conv1d(2, 2, 3)) is None
    assert kind_for(nn.Conv1d(3, 4, 1)).name == "toy_conv1d_k1"
    marked = nn.LayerNorm(4)
    setattr(marked, MARK_PREFIX + "sequence_first", (None, 1))
    assert kind_for(marked).name == "megatron_norm"
    assert kind_for(nn.LayerNorm(4)).name == "layernorm"


@pytest.fixture
def lopsided():
    """A factorized, shardable projection kind, registered for one test only."""

    class LopsidedKind(KroneckerKind, name="toy_lopsided"):
        """``P_out (x) P_in`` with a thin output side: ``ko = min(O, 2)``, ``ki = k // ko``."""

        def side_dims(self, k, o, i):
            ko = min(o, 2)
            return ko, min(i, max(1, k // ko))

    yield LopsidedKind
    PROJECTION_KINDS.unregister(LopsidedKind.name)


def test_toy_factorized_kind_captures_stores_shards_and_scores(lopsided, tmp_path, monkeypatch):
    """The lopsided kind's captured rows are ``vec(P_out G P_in^T)`` of the exact rows with
    its own side sizes; two tensor-parallel shards (column and row) sum to them; a store
    keeps them; grad-dot scores on the store equal the reference dot products; a LoGra
    EK-FAC fit holds its factors in the lopsided space."""
    from dattri_ds.gradient import LayerGrad, ShardInfo
    from dattri_ds.methods import fit_factors as fit
    from dattri_ds.ops import space
    from dattri_ds.store import GradientStore, GradientStoreWriter, StoreConfig, StoreSpec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(C, 8), nn.Tanh(), nn.Linear(8, 3, bias=False))
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(B, L, C, generator=g), torch.randn(B, L, 3, generator=g)
    xq, yq = torch.randn(2, L, C, generator=g), torch.randn(2, L, 3, generator=g)
    cfg = ProjectionConfig(kind="toy_lopsided", dim=8, seed=4)
    projector = Projector(cfg)
    ids = [f"t{i}" for i in range(B)]
    exact, query = _capture(model, x, y, ids), _capture(model, xq, yq, ["q0", "q1"])
    train = _capture(model, x, y, ids, projection=cfg)  # projected in capture (stacked)
    want, want_q = {}, {}
    for name, lg in exact.layers.items():
        o, i = lg.shape
        p_out, p_in = projector.kron_sides(name, o, i, torch.device("cpu"))
        assert p_out.shape == (2, o) and p_in.shape == (4, i)  # its split, not kron_dims'
        side = lambda rows: (p_out @ rows.view(-1, o, i) @ p_in.T).flatten(1)  # noqa: E731
        want[name], want_q[name] = side(materialize(lg)), side(materialize(query.layers[name]))
        assert train.layers[name].projection == cfg.tag
        assert rel_err(train.layers[name].data.values, want[name]) <= TOL

    monkeypatch.setattr(space, "all_reduce_sum", lambda t, group=None, world=1: t)
    lg = exact.layers["0"]
    (o, i), f = lg.shape, lg.data
    for dim, cut in ((0, o // 2), (1, i // 2)):
        total = 0
        for r, (a, b) in enumerate(((0, cut), (cut, (o, i)[dim]))):
            part = (Factorized(f.a, f.g[..., a:b]) if dim == 0 else Factorized(f.a[..., a:b], f.g))
            shape = (b - a, i) if dim == 0 else (o, b - a)
            shard = LayerGrad("0", lg.kind, part, shape,
                              shard=ShardInfo(dim, r, 2, (o, i), offset=a))
            total = total + space.project(shard, projector).data.values
        assert rel_err(total, want["0"]) <= TOL, dim

    spec = StoreSpec.from_batch(train, projection=cfg, fingerprint="toy@0")
    writer = GradientStoreWriter(StoreConfig(path=str(tmp_path / "store")), spec)
    writer.append(train)
    writer.close()
    store = GradientStore.open(tmp_path / "store", expect=spec)
    scores = make_attributor("graddot", projector=projector).scores(store.iter_batches(4), query)
    ref = sum(want[n] @ want_q[n].T for n in want)
    assert scores.train_ids == tuple(train.sample_ids) and rel_err(scores.values, ref) <= TOL

    factors = fit([exact], ekfac=True, projector=projector)
    logra = make_attributor("ekfac", factors=factors).scores([train],
                                                             project_batch(query, projector))
    assert logra.values.shape == (B, 2) and torch.isfinite(logra.values).all()
    assert {n: lf.dims for n, lf in factors.layers.items()} == {"0": (2, 4), "2": (2, 4)}
