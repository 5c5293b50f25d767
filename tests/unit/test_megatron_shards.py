"""Megatron tensor-parallel maths on hand-sharded factors, without Megatron or a process group.

Invariants: the shards of a layer (column-parallel: O split; row-parallel: I split with the
bias column on the last shard only; vocabulary-parallel: V split) tile its canonical layout
exactly once, so the per-shard partial inner products, norms and Kronecker/dense projections
sum to the unsharded layer's (the all-reduce is replaced by collecting the partials);
mismatched shards and misconfigured layers are refused by name; ``import dattri_ds`` does
not import megatron; capture scales sequence-first outputs per example along their B axis.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from dattri_ds.layers import get_kind
from dattri_ds import (
    CaptureConfig, Dense, Factorized, GradBatch, GradientCapture, LayerGrad, ShardInfo,
)
from dattri_ds.errors import ConfigError, ShapeError, UnsupportedLayerError
from dattri_ds.layers import kind_for
from dattri_ds.layers.megatron import SEQUENCE_FIRST_ATTR, split_even
from dattri_ds.ops import (
    ProjectionConfig, Projector, cross_gram, grad_sum, layer_cross_gram, layer_sq_norms,
    materialize, project, project_batch, sq_norms,
)
from dattri_ds.ops import inner, projection, space
from reference import rel_err

TOL = 1e-5
B, T, O, I, V, R = 3, 4, 6, 8, 10, 2  # O, I, V divisible by R


@pytest.fixture
def collect(monkeypatch):
    """Replace the all-reduce by the identity: each shard returns its partial result."""
    calls = []

    def fake(t, group=None, world=1):
        calls.append(world)
        return t
    monkeypatch.setattr(space, "all_reduce_sum", fake)
    return calls


def full_layer(layout: str, seed: int = 0) -> LayerGrad:
    """An unsharded layer: linear with a bias column, or an embedding with index inputs."""
    g = torch.Generator().manual_seed(seed)
    if layout == "vocab":
        idx = torch.randint(0, V, (B, T), generator=g)
        return LayerGrad("emb", get_kind("embedding"),
                         Factorized(idx, torch.randn(B, T, O, generator=g)),
                         (O, V))
    a = torch.cat([torch.randn(B, T, I, generator=g), torch.ones(B, T, 1)], -1)
    return LayerGrad("fc", get_kind("linear"), Factorized(a, torch.randn(B, T, O, generator=g)),
                     (O, I + 1))


def shards(full: LayerGrad, layout: str) -> list[LayerGrad]:
    """Hand-shard ``full`` as the Megatron kinds capture it on each of R ranks."""
    f, out = full.data, []
    for r in range(R):
        if layout == "column":
            per = O // R
            data, shape = Factorized(f.a, f.g[..., r * per:(r + 1) * per]), (per, I + 1)
            info, kind = ShardInfo(0, r, R, (O, I + 1), offset=r * per), "megatron_column"
        elif layout == "row":
            per = I // R
            stop = (r + 1) * per + (1 if r == R - 1 else 0)  # bias column: last rank only
            data, shape = Factorized(f.a[..., r * per:stop], f.g), (O, stop - r * per)
            info, kind = ShardInfo(1, r, R, (O, I + 1), offset=r * per), "megatron_row"
        else:
            per = V // R
            idx = f.a - r * per
            valid = (idx >= 0) & (idx < per)
            data = Factorized(torch.where(valid, idx, 0), f.g * valid.unsqueeze(-1))
            shape, kind = (O, per), "megatron_vocab_embedding"
            info = ShardInfo(1, r, R, (O, V), offset=r * per)
        out.append(LayerGrad(full.name, get_kind(kind), data, shape, shard=info))
    return out


LAYOUTS = ["column", "row", "vocab"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shards_tile_the_canonical_layout(layout):
    """Each shard's rows are its ShardInfo block of the full rows, and the blocks' flat
    positions partition range(O*I') (else gathered grads would overlap or miss entries)."""
    full = full_layer(layout)
    rows = materialize(full)
    seen = []
    for lg in shards(full, layout):
        local = materialize(lg.replace(shard=None))
        assert rel_err(local, lg.shard.local_of(rows, lg.shape)) <= TOL
        idx = lg.shard.flat_index(lg.shape)
        assert rel_err(local, rows[:, idx]) <= TOL
        seen.append(idx)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(rows.shape[1]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_ops_sum_to_the_full_layer(layout, collect, monkeypatch):
    """Per-shard cross grams (factorized x factorized, x a sharded dense target, x a full
    dense target sliced to the shard), squared norms and Kronecker/dense projections
    (with seeded blocks straddling shards) sum to the unsharded layer's results."""
    monkeypatch.setattr(projection, "BLOCK", 7)
    full, other = full_layer(layout, 0), full_layer(layout, 1)
    parts, other_parts = shards(full, layout), shards(other, layout)
    full_target = grad_sum(other)
    kron = Projector(ProjectionConfig(kind="kronecker", dim=12, seed=5))
    dense = Projector(ProjectionConfig(kind="dense", dim=9, seed=5))
    want = {"gram": layer_cross_gram(full, other, path="dense"),
            "target": layer_cross_gram(full, full_target),
            "norms": layer_sq_norms(full, path="dense"),
            "kron": project(full, kron, path="dense").data.values,
            "dense": project(full, dense).data.values}
    got = {k: 0 for k in want}
    for lg, og in zip(parts, other_parts):
        got["gram"] = got["gram"] + layer_cross_gram(lg, og)
        got["target"] = got["target"] + layer_cross_gram(lg, grad_sum(og))
        if layout != "vocab":
            assert rel_err(layer_cross_gram(lg, full_target), layer_cross_gram(
                lg, grad_sum(og))) <= TOL  # a full-shape target is sliced to the shard
        got["norms"] = got["norms"] + layer_sq_norms(lg)
        pk, pd = project(lg, kron), project(lg, dense)
        assert pk.shard is None and pk.shape == full.shape and pk.projection == kron.config.tag
        got["kron"] = got["kron"] + pk.data.values
        got["dense"] = got["dense"] + pd.data.values
    for k in want:
        assert rel_err(got[k], want[k]) <= TOL, k


def test_dense_apply_of_columns_equals_the_matrix_columns(monkeypatch):
    """``DenseKind.apply`` of any column subset equals ``x @ P[:, index]^T`` of the full
    seeded matrix, across block boundaries."""
    monkeypatch.setattr(projection, "BLOCK", 5)
    proj = Projector(ProjectionConfig(kind="dense", dim=4, seed=2))
    d = 23
    p = proj.dense_matrix("w", d, 4)
    index = torch.tensor([0, 4, 5, 9, 13, 22, 17])
    x = torch.randn(3, index.numel())
    assert rel_err(proj.apply("w", x, 4, index, d), x @ p[:, index].T) <= TOL


def test_reductions_once_per_group(collect):
    """The whole-model gram (and norms, and a batch projection) reduces the partials of all
    sharded layers once (small [B1, B2] / [B, P] results, never per-example gradients);
    per-layer grams reduce each layer."""
    col = shards(full_layer("column"), "column")[0]
    row = shards(full_layer("row"), "row")[0].replace(name="fc2")
    plain = full_layer("row", 3).replace(name="plain")
    batch = GradBatch(0, ("a", "b", "c"), {"fc": col, "fc2": row, "plain": plain})
    cross_gram(batch, batch)
    assert collect == [R]
    sq_norms(batch)
    assert collect == [R, R]
    cross_gram(batch, batch, per_layer=True)
    assert collect == [R, R, R, R]
    projected = project_batch(batch, Projector(ProjectionConfig(dim=12)))
    assert collect == [R] * 5  # both sharded layers' [B, P] partials in one buffer
    for name in ("fc", "fc2"):
        one = project(batch.layers[name], Projector(ProjectionConfig(dim=12)))
        assert torch.equal(projected.layers[name].data.values, one.data.values)


def test_mismatched_shards_are_refused():
    """Products between different shards, or a shard and a projected/other-shape layer,
    raise ShapeError naming the layer (they would silently mix blocks)."""
    s0, s1 = shards(full_layer("column"), "column")
    with pytest.raises(ShapeError, match="'fc'.*same rank"):
        layer_cross_gram(s0, s1)
    projected = LayerGrad("fc", get_kind("linear"), Dense(torch.zeros(B, 12)), (O, I + 1),
                          space="x")
    with pytest.raises(ShapeError, match="'fc'"):
        layer_cross_gram(s0, projected)


def test_split_even_refuses_uneven_sizes():
    """A tensor-parallel size that does not divide the layer is a ConfigError naming it."""
    assert split_even("mlp.fc1", "output_size", 64, 4) == 16
    with pytest.raises(ConfigError, match="'mlp.fc1'.*output_size = 63.*size 2"):
        split_even("mlp.fc1", "output_size", 63, 2)


def _stub(cls_name: str, module: str, **attrs) -> nn.Module:
    """A module whose class looks like ``module.cls_name`` (matching is by class name)."""
    cls = type(cls_name, (nn.Module,), {"forward": lambda self, x: x @ self.weight.T})
    cls.__module__ = module
    m = cls()
    m.weight = nn.Parameter(torch.randn(4, 4))
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


@pytest.mark.parametrize("cls_name,module,attrs,what", [
    ("TELayerNormColumnParallelLinear", "transformer_engine.pytorch.module", {},
     "fused layer norm"),
    ("ColumnParallelLinear", "megatron.core.tensor_parallel.layers", {"is_expert": True},
     "expert"),
])
def test_unsupported_megatron_layers_are_named_at_attach(cls_name, module, attrs, what):
    """Transformer Engine and expert layers fail when the capture attaches, naming the
    layer and the capture.exclude fix; excluding them works."""
    model = nn.Sequential(nn.Linear(4, 4), _stub(cls_name, module, **attrs))
    with pytest.raises(UnsupportedLayerError, match=f"Layer '1'.*{what}.*exclude=\\['1'\\]"):
        GradientCapture(model).attach()
    GradientCapture(model, CaptureConfig(exclude=("1",))).attach().detach()


class SeqFirstNormModel(nn.Module):
    """Embedding (batch-first) -> LayerNorm on [S, B, H] (marked) -> head (batch-first)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.norm, self.head = nn.Embedding(V, 6), nn.LayerNorm(6), nn.Linear(6, V)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()
        setattr(self.norm, SEQUENCE_FIRST_ATTR, (None, 1))

    def forward(self, input_ids, labels):
        x = self.norm(self.emb(input_ids).transpose(0, 1)).transpose(0, 1)
        return nn.functional.cross_entropy(self.head(x).transpose(1, 2), labels,
                                           reduction="none")


def test_sequence_first_kind_scales_along_its_batch_axis():
    """With unequal loss-token counts (example_mean), a sequence-first layer's output-grad
    is scaled per example along dim 1 (not the sequence): every layer equals the
    one-backward-per-example reference."""
    model = SeqFirstNormModel()
    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :2] = -100
    labels[2, 4:] = -100
    n = (labels != -100).sum(1)
    with GradientCapture(model, CaptureConfig(label_shift=0,
                                              loss_reduction="example_mean")) as cap:
        (model(ids, labels=labels).sum(1) / n).mean().backward()
        batch = cap.pop()
    assert batch.layers["norm"].kind_name == "megatron_norm"
    for name in ("emb", "norm", "head"):
        mod = dict(model.named_modules())[name]
        want = []
        for b in range(3):
            model.zero_grad()
            model(ids[b:b + 1], labels=labels[b:b + 1]).sum().backward()
            grads = {k: p.grad for k, p in mod.named_parameters(recurse=False)}
            want.append(kind_for(mod).canonical(mod, grads))
        assert rel_err(materialize(batch.layers[name]), torch.stack(want)) <= TOL, name


def test_import_does_not_import_megatron():
    """``import dattri_ds`` registers the Megatron kinds without importing megatron."""
    code = ("import sys, dattri_ds; from dattri_ds.layers import registered_kinds; "
            "assert 'megatron_column' in registered_kinds(); "
            "assert not [m for m in sys.modules if m.startswith('megatron')]")
    subprocess.run([sys.executable, "-c", code], check=True)
