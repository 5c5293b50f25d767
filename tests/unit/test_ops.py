"""Identity tests for every LayerKind x operation x path.

Invariants: the factorized ("ghost") and materialized ("dense") paths of every op give the
same numbers; both equal an autograd reference; norms are the diagonal of the gram;
streaming sums equal one-shot sums; zero-gradient (padding) tokens change nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_ds import Dense, Factorized, GradAccumulator, GradBatch, LayerGrad
from dattri_ds.layers import kind_for
from dattri_ds.ops import (
    Projector, ProjectionConfig, cosine, cross_gram, grad_sum, kron_dims, layer_cross_gram,
    layer_sq_norms, materialize, project,
)
from reference import rel_err

TOL = 1e-6


class FakeConv1D(nn.Module):
    """Same attributes and maths as transformers' Conv1D (weight [I, O])."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.2)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(
            *x.shape[:-1], self.nf)


FakeConv1D.__name__ = "Conv1D"


def _module(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {
        "linear": lambda: nn.Linear(6, 5),
        "linear_nobias": lambda: nn.Linear(6, 5, bias=False),
        "conv1d": lambda: FakeConv1D(5, 6),
        "embedding": lambda: nn.Embedding(11, 5, padding_idx=0),
        "layernorm": lambda: nn.LayerNorm(6),
        "rmsnorm": lambda: nn.RMSNorm(6, eps=1e-5),
    }[kind]()


KINDS = ["linear", "linear_nobias", "conv1d", "embedding", "layernorm", "rmsnorm"]
#: (kind, path) cases: factorized kinds run both the "ghost" and "dense" paths; dense-only
#: kinds (the norms) have no factorized form, the path argument cannot change what they
#: compute, so they run once (as "dense") instead of repeating a case under another name.
KIND_PATHS = [(k, p) for k in KINDS
              for p in (("dense",) if kind_for(_module(k)).dense_only else ("ghost", "dense"))]


def _inputs(kind: str, b: int, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if kind == "embedding":
        return torch.randint(0, 11, (b, t), generator=g)
    return torch.randn(b, t, 6, generator=g)


def _layer(kind: str, b: int = 4, t: int = 3, seed: int = 1):
    """(LayerGrad captured from random inputs/output-grads, reference [B, D])."""
    module = _module(kind)
    x = _inputs(kind, b, t, seed)
    out = module(x)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100))
    k = kind_for(module)
    lg = LayerGrad(kind, k, k.build(module, x, r), k.layer_shape(module))
    ref = []
    for i in range(b):
        module.zero_grad()
        (module(x[i:i + 1]) * r[i:i + 1]).sum().backward()
        ref.append(k.canonical(module, {n: p.grad for n, p in module.named_parameters()}))
    return lg, torch.stack(ref)


@pytest.mark.parametrize("kind", KINDS)
def test_materialize_equals_reference(kind):
    """The factorized form materializes to the autograd per-example gradient."""
    lg, ref = _layer(kind)
    assert rel_err(materialize(lg), ref) <= TOL


@pytest.mark.parametrize(("kind", "path"), KIND_PATHS)
def test_cross_gram_paths(kind, path):
    """Factorized x factorized and factorized x dense grams equal the reference gram."""
    x, rx = _layer(kind, 4, 3, 1)
    y, ry = _layer(kind, 3, 5, 2)
    want = rx @ ry.T
    assert rel_err(layer_cross_gram(x, y, path=path), want) <= TOL
    y_dense = y.replace(data=Dense(ry))
    assert rel_err(layer_cross_gram(x, y_dense, path=path), want) <= TOL
    assert rel_err(layer_cross_gram(y_dense, x, path=path), want.T) <= TOL


@pytest.mark.parametrize(("kind", "path"), KIND_PATHS)
def test_norm_is_gram_diagonal(kind, path):
    """Squared norms equal the diagonal of the self-gram and the reference norms."""
    x, rx = _layer(kind, 5, 4)
    sq = layer_sq_norms(x, path=path)
    assert rel_err(sq, rx.pow(2).sum(1)) <= TOL
    assert rel_err(sq, torch.diagonal(layer_cross_gram(x, x))) <= TOL


@pytest.mark.parametrize(("kind", "path"), KIND_PATHS)
def test_sum_streaming_equals_one_shot(kind, path):
    """grad_sum equals the reference sum; GradAccumulator over chunks equals one shot."""
    x, rx = _layer(kind, 6, 3)
    assert rel_err(grad_sum(x, path=path).data.values[0], rx.sum(0)) <= TOL
    acc = GradAccumulator()
    for sl in (slice(0, 1), slice(1, 4), slice(4, 6)):
        acc.add(GradBatch(0, tuple(str(i) for i in range(sl.stop - sl.start)),
                          {x.name: x.index(sl)}))
    assert acc.count == 6
    assert rel_err(acc.mean().layers[x.name].data.values[0], rx.mean(0)) <= TOL


@pytest.mark.parametrize("kind", ["linear", "conv1d", "embedding"])
def test_zero_grad_tokens_change_nothing(kind):
    """Appending tokens whose output-grad is zero (padding) leaves every op unchanged."""
    x, rx = _layer(kind, 3, 4)
    f = x.data
    pad_a = f.a[:, :2] if f.a.dim() == 2 else torch.randn_like(f.a[:, :2])
    padded = x.replace(data=Factorized(torch.cat([f.a, pad_a], 1),
                                       torch.cat([f.g, torch.zeros_like(f.g[:, :2])], 1)))
    assert rel_err(materialize(padded), rx) <= TOL
    assert rel_err(layer_cross_gram(padded, x, path="ghost"), rx @ rx.T) <= TOL
    assert rel_err(layer_sq_norms(padded, path="ghost"), rx.pow(2).sum(1)) <= TOL


@pytest.mark.parametrize("path", ["ghost", "dense"])
@pytest.mark.parametrize("kind", ["linear", "conv1d", "embedding"])
def test_kronecker_projection_equals_dense_kron_matrix(kind, path):
    """Kronecker projection == materialized gradient times kron(P_out, P_in)^T."""
    x, rx = _layer(kind, 4, 3)
    proj = Projector(ProjectionConfig(kind="kronecker", dim=12, seed=3))
    px = project(x, proj, path=path)
    o, i = x.shape
    ko, ki = kron_dims(12, o, i)
    p_out = proj.side(x.name, "out", ko, o, torch.device("cpu"))
    p_in = proj.side(x.name, "in", ki, i, torch.device("cpu"))
    assert px.data.values.shape == (4, ko * ki)
    assert rel_err(px.data.values, rx @ torch.kron(p_out, p_in).T) <= TOL


@pytest.mark.parametrize(("kind", "path"), KIND_PATHS)
def test_dense_projection_equals_matrix(kind, path):
    """Dense projection (streamed over seeded column blocks) == materialized @ P^T."""
    x, rx = _layer(kind, 4, 1)
    proj = Projector(ProjectionConfig(kind="dense", dim=3, seed=5))
    px = project(x, proj, path=path)
    assert px.projection == proj.config.tag
    p = proj.dense_matrix(x.name, rx.shape[1], 3)
    assert rel_err(px.data.values, rx @ p.T) <= TOL


def test_batch_level_cross_gram_cosine_sum_over_layers():
    """GradBatch cross_gram sums layers; cosine divides by whole-model norms."""
    lx, rx = _layer("linear", 4, 3, 1)
    ly, ry = _layer("linear", 2, 3, 2)
    ex, erx = _layer("embedding", 4, 3, 1)
    ey, ery = _layer("embedding", 2, 3, 2)
    xb = GradBatch(0, tuple("abcd"), {"l": lx, "e": ex})
    yb = GradBatch(0, ("p", "q"), {"l": ly, "e": ey})
    fx, fy = torch.cat([rx, erx], 1), torch.cat([ry, ery], 1)
    assert rel_err(cross_gram(xb, yb), fx @ fy.T) <= TOL
    per = cross_gram(xb, yb, per_layer=True)
    assert rel_err(per["e"], erx @ ery.T) <= TOL
    want = (fx @ fy.T) / fx.norm(dim=1)[:, None] / fy.norm(dim=1)[None]
    assert rel_err(cosine(xb, yb), want) <= TOL


def test_projection_mismatch_is_refused():
    """Inner products between differently projected layers raise an error naming the layer."""
    x, _ = _layer("linear", 2, 3)
    a = project(x, Projector(ProjectionConfig(dim=12, seed=0)))
    b = project(x, Projector(ProjectionConfig(dim=12, seed=1)))
    with pytest.raises(ValueError, match="linear.*projection"):
        layer_cross_gram(a, b)


def test_small_layers_are_kept_exactly():
    """A layer with O*I' <= dim is stored unprojected (identity), still tagged by the config."""
    x, rx = _layer("rmsnorm", 3, 2)
    px = project(x, Projector(ProjectionConfig(dim=64)))
    assert px.projection.startswith("identity:")
    assert rel_err(px.data.values, rx) <= TOL
