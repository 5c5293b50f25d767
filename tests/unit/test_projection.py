"""Random projections: unbiased, within the Johnson-Lindenstrauss bound, seeded without talking.

Invariants: the same (seed, layer, role) gives the same matrix in any process; inner
products survive projection within a few standard deviations of the JL estimate.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from dattri_ds.layers import get_kind
from dattri_ds import Dense, Factorized, LayerGrad
from dattri_ds.ops import Projector, ProjectionConfig, project
from dattri_ds.ops.projection import KINDS, projection_kind


def _pairwise_errors(x: torch.Tensor, px: torch.Tensor) -> torch.Tensor:
    """|<Px_i, Px_j> - <x_i, x_j>| / (|x_i| |x_j|) over all pairs i <= j."""
    g, pg = x @ x.T, px @ px.T
    n = x.norm(dim=1)
    err = (pg - g).abs() / (n[:, None] * n[None])
    return err[torch.triu_indices(len(x), len(x))[0], torch.triu_indices(len(x), len(x))[1]]


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_dense_projection_preserves_inner_products(kind, distribution):
    """Dense and sparse JL projection to k: every pairwise error (all pairs of 24 vectors)
    is within 5 * sqrt(2/k) and the mean within 1.5 * sqrt(2/k) (the dense JL bound)."""
    k, d = 1024, 4096
    x = torch.randn(24, d, generator=torch.Generator().manual_seed(0))
    x[1] = x[0] + 0.3 * x[1]  # a correlated pair
    lg = LayerGrad("w", get_kind("linear"), Dense(x), (64, 64))
    px = project(lg, Projector(ProjectionConfig(kind=kind, dim=k, distribution=distribution,
                                                seed=11))).data.values
    err = _pairwise_errors(x, px)
    assert err.max() <= 5 * math.sqrt(2 / k)
    assert err.mean() <= 1.5 * math.sqrt(2 / k)


def test_kronecker_projection_preserves_inner_products():
    """Kronecker (32 x 32) projection of low-rank (T=6) gradients: pairwise errors stay within
    the Kronecker bound, which is looser than dense JL: it scales with
    ``sqrt(2/ko) + sqrt(2/ki)`` because each side is a JL map of its own factor."""
    k = 1024
    gen = torch.Generator().manual_seed(1)
    f = Factorized(torch.randn(24, 6, 64, generator=gen), torch.randn(24, 6, 64, generator=gen))
    lg = LayerGrad("w", get_kind("linear"), f, (64, 64))
    full = torch.bmm(f.g.transpose(1, 2), f.a).reshape(24, -1)
    px = project(lg, Projector(ProjectionConfig(kind="kronecker", dim=k, seed=2))).data.values
    assert px.shape == (24, k)
    err = _pairwise_errors(full, px)
    side = 2 * math.sqrt(2 / 32)
    assert err.max() <= 3 * side
    assert err.mean() <= side / 4


def test_projection_unbiased_over_seeds():
    """Averaged over seeds, projected inner products converge to the exact one."""
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
    lg = LayerGrad("w", get_kind("linear"), Dense(x), (16, 32))
    est = [project(lg, Projector(ProjectionConfig(kind="dense", dim=64, seed=s))).data.values
           for s in range(200)]
    mean_dot = torch.stack([(p[0] * p[1]).sum() for p in est]).mean()
    exact = (x[0] * x[1]).sum()
    assert abs(mean_dot - exact) <= 4 * x[0].norm() * x[1].norm() * math.sqrt(2 / 64 / 200)


def test_same_seed_same_matrix_other_layer_differs():
    """(seed, layer, role) fixes the matrix; a different layer or seed changes it."""
    a = Projector(ProjectionConfig(seed=5)).side("h.0.fc", "out", 8, 16, torch.device("cpu"))
    b = Projector(ProjectionConfig(seed=5)).side("h.0.fc", "out", 8, 16, torch.device("cpu"))
    c = Projector(ProjectionConfig(seed=5)).side("h.1.fc", "out", 8, 16, torch.device("cpu"))
    d = Projector(ProjectionConfig(seed=6)).side("h.0.fc", "out", 8, 16, torch.device("cpu"))
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)


def test_matrix_identical_in_another_process():
    """A fresh interpreter (another rank) builds bit-identical matrices without communication."""
    code = ("import torch; from dattri_ds.ops import Projector, ProjectionConfig;"
            "p = Projector(ProjectionConfig(seed=9, kind='dense'));"
            "m = p.dense_matrix('blocks.3.attn', 40000, 4);"
            "print(float(m.double().sum()), float(m.double().pow(2).sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    m = Projector(ProjectionConfig(seed=9, kind="dense")).dense_matrix("blocks.3.attn", 40000, 4)
    assert [float(v) for v in out] == [float(m.double().sum()), float(m.double().pow(2).sum())]


def test_invalid_projection_config():
    """Unknown kinds, distributions and sizes are rejected with the allowed values."""
    from dattri_ds import ConfigError
    with pytest.raises(ConfigError, match="kronecker"):
        ProjectionConfig(kind="countsketch")
    with pytest.raises(ConfigError, match="rademacher"):
        ProjectionConfig(distribution="uniform")
    with pytest.raises(ConfigError, match="dim"):
        ProjectionConfig(dim=0)


def test_sparse_projection_is_its_matrix_and_shards_sum():
    """Sparse JL: ``apply`` == ``x @ P^T`` with P of exactly s non-zeros of norm-1 columns,
    factorized layers project like their materialized rows, and column shards'
    partial projections (``apply`` with an index) sum to the whole (tensor-parallel invariant)."""
    from dattri_ds.ops.projection import BLOCK, SPARSE_NNZ

    proj = Projector(ProjectionConfig(kind="sparse", dim=64, seed=4, distribution="rademacher"))
    d = BLOCK + 300  # two seeded blocks
    p = proj.dense_matrix("w", d, 64)
    assert ((p != 0).sum(0) == SPARSE_NNZ).all()
    assert torch.allclose(p.pow(2).sum(0), torch.ones(d))
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(proj.apply("w", x, 64), x @ p.T, rtol=1e-5, atol=1e-4)
    halves = torch.arange(d).chunk(2)
    parts = sum(proj.apply("w", x[:, h], 64, h, d) for h in halves)
    assert torch.allclose(parts, x @ p.T, rtol=1e-5, atol=1e-4)
    # the whole row (no index) is the every-column index's result bit for bit
    assert torch.equal(proj.apply("w", x, 64), proj.apply("w", x, 64, torch.arange(d), d))
    gen = torch.Generator().manual_seed(6)
    f = Factorized(torch.randn(3, 5, 20, generator=gen), torch.randn(3, 5, 30, generator=gen))
    lg = LayerGrad("v", get_kind("linear"), f, (30, 20))
    rows = torch.bmm(f.g.transpose(1, 2), f.a).reshape(3, -1)
    want = rows @ proj.dense_matrix("v", 600, 64).T
    assert torch.allclose(project(lg, proj).data.values, want, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("o,i,k", [(64, 64, 1024), (512, 512, 256)])
def test_every_kind_meets_its_bound_on_all_pairs(kind, o, i, k):
    """Every registered kind (``auto`` resolved per layer) keeps every pairwise inner
    product of 24 low-rank gradients (all pairs) within 5x its own documented error
    ``ProjectionKind.error`` and their mean within 1.5x it, stores ``width`` values, and
    the registry's error is the JL scale sqrt(2/k) for matrix kinds. Breaks when a kind's
    projection is biased or its declared error/width understates the truth."""
    gen = torch.Generator().manual_seed(3)
    f = Factorized(torch.randn(24, 6, i, generator=gen), torch.randn(24, 6, o, generator=gen))
    f.g[1] = f.g[0] + 0.3 * f.g[1]  # a correlated pair
    lg = LayerGrad("w", get_kind("linear"), f, (o, i))
    full = torch.bmm(f.g.transpose(1, 2), f.a).reshape(24, -1)
    projector = Projector(ProjectionConfig(kind=kind, dim=k, seed=5))
    resolved = projection_kind(projector.kind_of(o, i))
    px = project(lg, projector).data.values
    assert px.shape == (24, resolved.width(k, o, i))
    bound = resolved.error(k, o, i)
    if not resolved.factorized:
        assert bound == pytest.approx(math.sqrt(2 / k))
    err = _pairwise_errors(full, px)
    assert err.max() <= 5 * bound
    assert err.mean() <= 1.5 * bound


def test_auto_projection_is_sparse_or_kronecker_per_layer():
    """``auto``: a small layer is projected exactly as ``sparse`` would, a large one exactly as
    ``kronecker`` would (same seeds), as ``ops.cost.choose_projection`` decides from the shape
    alone; the decision and its error are reported. Breaks if auto's per-layer choice
    depends on the batch or disagrees with the cost model."""
    from dattri_ds.ops.cost import choose_projection, explain_projection

    gen = torch.Generator().manual_seed(4)
    for (o, i), want in [((64, 64), "sparse"), ((512, 512), "kronecker")]:
        assert choose_projection(o, i, 256).kind == want
        for b, t in [(3, 5), (7, 2)]:  # the choice never depends on B or T
            f = Factorized(torch.randn(b, t, i, generator=gen), torch.randn(b, t, o, generator=gen))
            lg = LayerGrad("w", get_kind("linear"), f, (o, i))
            auto = project(lg, Projector(ProjectionConfig(kind="auto", dim=256, seed=1)))
            same = project(lg, Projector(ProjectionConfig(kind=want, dim=256, seed=1)))
            torch.testing.assert_close(auto.data.values, same.data.values, rtol=0, atol=0)
    assert choose_projection(8, 8, 256).kind == "identity"
    text = explain_projection({"small": (64, 64), "big": (512, 512)}, 256)
    assert "small [64x64] k=256 -> sparse" in text and "big [512x512] k=256 -> kronecker" in text


def test_space_tags_round_trip():
    """``Space.parse`` / ``Space.tag`` is the one tag grammar: every tag a store or factor
    file writes (projected, kept exactly, whitened, whitened then projected) parses to the
    typed space and back to the same string (breaks if a store's tag could not be read)."""
    from dattri_ds.ops.space import Space

    cfg = ProjectionConfig(kind="kronecker", dim=64, seed=3)
    tags = [None, cfg.tag, f"identity:{cfg.tag}", "whitened:ekfac", f"whitened:kfac:{cfg.tag}",
            f"whitened:ekfac:identity:{cfg.tag}", f"{cfg.tag}+whitened:ekfac",
            f"identity:{ProjectionConfig().tag}+whitened:kfac"]
    for tag in tags:
        assert Space.parse(tag).tag == tag
    sp = Space.parse(f"identity:{cfg.tag}+whitened:ekfac")
    assert sp.identity and sp.whitened == "ekfac" and sp.whitened_first
    assert ProjectionConfig.from_tag(sp.projection) == cfg
    auto = ProjectionConfig(kind="auto", kron_speedup=2.5, distribution="rademacher")
    assert ProjectionConfig.from_tag(auto.tag) == auto and auto.tag.endswith(":x2.5")
    assert Space.parse(f"whitened:ekfac:{cfg.tag}").replace(whitened=None).tag == cfg.tag


def test_layer_grad_holds_a_typed_space():
    """A LayerGrad holds a ``Space``: a tag given as ``space=`` (or positionally) is parsed
    once, ``projection`` reads the same tag back
    (stores write it byte for byte), equal tags give equal, hashable spaces, and a batch
    pickles with its spaces (breaks if a caller's tag or a store's bytes changed)."""
    import pickle

    from dattri_ds.errors import ConfigError
    from dattri_ds.gradient import GradBatch, Space

    cfg = ProjectionConfig(kind="kronecker", dim=4, seed=2)
    rows = Dense(torch.randn(2, 4))
    by_kw = LayerGrad("w", get_kind("linear"), rows, (3, 5), space=cfg.tag)
    by_pos = LayerGrad("w", get_kind("linear"), rows, (3, 5), cfg.tag)
    typed = LayerGrad("w", get_kind("linear"), rows, (3, 5), space=Projector(cfg).space)
    assert by_kw.space == by_pos.space == typed.space == Space.parse(cfg.tag)
    assert isinstance(by_kw.space, Space) and by_kw.projection == cfg.tag
    assert ProjectionConfig.from_tag(by_kw.space.projection) == cfg
    assert len({by_kw.space, by_pos.space, Space(cfg.tag)}) == 1
    assert by_kw.replace(space=f"identity:{cfg.tag}").space.identity
    canonical = LayerGrad("w", get_kind("linear"), Dense(torch.randn(2, 15)), (3, 5))
    assert canonical.space.canonical and canonical.projection is None
    whitened = canonical.replace(space="whitened:ekfac")
    assert whitened.space.awaiting_projection and not whitened.space.projected
    back = pickle.loads(pickle.dumps(GradBatch(0, ("a", "b"), {"w": by_kw})))
    assert back.layers["w"].space == by_kw.space and back.layers["w"].projection == cfg.tag
    assert Space.parse("opaque").projection == "opaque"  # kept as a name
    for bad in ("opaque", "kronecker:gaussian:64:s0", "kronecker:gaussian:k64:s0:8", "a:b:k:s",
                None):
        with pytest.raises(ConfigError, match="not a ProjectionConfig tag"):
            ProjectionConfig.from_tag(bad)


def _column_scatter(proj: Projector, layer: str, x: torch.Tensor, rows: int) -> torch.Tensor:
    """The sparse projection as it was computed before the CSR kernel (commit 0eb5305): every
    column's ``s`` products scattered into ``[B, rows]`` (``index_add_``), block by block."""
    from dattri_ds.ops.projection import BLOCK

    out = x.new_zeros(x.shape[0], rows)
    for blk, start in enumerate(range(0, x.shape[1], BLOCK)):
        idx, val = proj.sparse_block(layer, blk, rows, min(BLOCK, x.shape[1] - start), x.device)
        contrib = x[:, start:start + idx.shape[0]].unsqueeze(-1) * val
        out.index_add_(1, idx.reshape(-1), contrib.reshape(x.shape[0], -1))
    return out


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_sparse_kernel_is_the_same_map_as_the_column_scatter(distribution, monkeypatch):
    """The blocked CSR kernel computes the same linear map as the column scatter it replaced
    (same seeded non-zeros: each CSR block holds exactly ``sparse_block``'s entries, and the
    rows agree with the scatter and with ``x @ P^T`` of the dense matrix up to float
    rounding), for whole rows and for column shards. Breaks if a change of kernel changed
    the sketch (and with it every stored row and LDS number)."""
    from dattri_ds.ops import projection

    monkeypatch.setattr(projection, "BLOCK", 700)  # several seeded blocks, a ragged last one
    k, d = 256, 2 * 700 + 333
    proj = Projector(ProjectionConfig(kind="sparse", dim=k, seed=8, distribution=distribution))
    for blk, start in enumerate(range(0, d, 700)):
        cols = min(700, d - start)
        idx, val = proj.sparse_block("w", blk, k, cols, torch.device("cpu"))
        csr = proj.sparse_csr("w", blk, k, cols, torch.device("cpu")).to_dense()
        want = torch.zeros(k, cols)
        want[idx, torch.arange(cols).unsqueeze(1).expand_as(idx)] = val
        assert torch.equal(csr, want)
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(9))
    got = proj.apply("w", x, k)
    torch.testing.assert_close(got, _column_scatter(proj, "w", x, k), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, x @ proj.dense_matrix("w", d, k).T, rtol=1e-5, atol=1e-5)
    cols = torch.randperm(d, generator=torch.Generator().manual_seed(1))[:400]
    part = proj.apply("w", x[:, cols], k, cols, d)
    torch.testing.assert_close(part, x[:, cols] @ proj.dense_matrix("w", d, k)[:, cols].T,
                               rtol=1e-5, atol=1e-5)


def test_generated_matrices_are_shared_and_bounded():
    """Projectors of one seed reuse the matrices generated on the CPU (a ``collect`` per
    checkpoint draws and sorts them once per process), other seeds get their own, and the
    process-wide store never holds more than the asking config's ``cache_bytes``; a sweep
    over more layers than fit keeps the first ones instead of evicting each before its next
    use (breaks if the cache leaked, thrashed or served another seed's matrix)."""
    from dattri_ds.ops.projection import _MADE, _nbytes

    cpu = torch.device("cpu")
    _MADE.clear()  # other tests' matrices (seed 23 included) would count against the budget
    a = Projector(ProjectionConfig(kind="sparse", dim=64, seed=21))
    b = Projector(ProjectionConfig(kind="sparse", dim=64, seed=21))
    c = Projector(ProjectionConfig(kind="sparse", dim=64, seed=22))
    m = a.sparse_csr("w", 0, 64, 500, cpu)
    assert b.sparse_csr("w", 0, 64, 500, cpu) is m
    assert not torch.equal(c.sparse_csr("w", 0, 64, 500, cpu).to_dense(), m.to_dense())
    budget = 3 * _nbytes(m)
    small = Projector(ProjectionConfig(kind="sparse", dim=64, seed=23, cache_bytes=budget))
    first = small.sparse_csr("l0", 0, 64, 500, cpu)
    for layer in range(1, 6):
        small.sparse_csr(f"l{layer}", 0, 64, 500, cpu)
        assert _MADE._bytes <= budget
    again = Projector(ProjectionConfig(kind="sparse", dim=64, seed=23, cache_bytes=budget))
    assert again.sparse_csr("l0", 0, 64, 500, cpu) is first


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_blockwise_materialized_sparse_projection_equals_the_rows(kind, monkeypatch):
    """A sparse projection of factors materializes one seeded column block at a time
    (``LayerKind.materialize_columns``, blocks straddling output rows): the result equals the
    projection of the whole materialized rows up to float rounding, for outer-product and
    index-input kinds. Breaks if a block took the wrong output rows or column offsets."""
    from dattri_ds.layers import get_kind
    from dattri_ds.ops import projection

    monkeypatch.setattr(projection, "BLOCK", 97)  # not a multiple of I: blocks cut rows
    gen = torch.Generator().manual_seed(12)
    o, i = 13, 29
    a = (torch.randint(0, i, (4, 6), generator=gen) if kind == "embedding"
         else torch.randn(4, 6, i, generator=gen))
    lg = LayerGrad("w", get_kind(kind), Factorized(a, torch.randn(4, 6, o, generator=gen)),
                   (o, i))
    proj = Projector(ProjectionConfig(kind="sparse", dim=64, seed=3))
    rows = lg.kind.rows(lg.data, lg.shape)
    got = project(lg, proj).data.values
    torch.testing.assert_close(got, proj.apply("w", rows, 64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, rows @ proj.dense_matrix("w", o * i, 64).T, rtol=1e-5,
                               atol=1e-5)


def test_embedding_rows_are_the_per_token_sums():
    """An embedding's materialized rows (the input of its sparse projection), written straight
    into the ``[B, D, V]`` layout, hold exactly the per-token sums ``G_b[:, v] = sum_{t:
    idx_bt = v} g_bt``, repeated tokens included, bit for bit as a token-by-token loop adds
    them; also for an output-row slice (``materialize_columns``)."""
    from dattri_ds.layers import get_kind

    gen = torch.Generator().manual_seed(5)
    b, t, d, v = 3, 9, 6, 11
    idx = torch.randint(0, v, (b, t), generator=gen)
    idx[:, :4] = idx[:, :1]  # repeated tokens within an example
    g = torch.randn(b, t, d, generator=gen)
    ref = torch.zeros(b, d, v)
    for bi in range(b):
        for ti in range(t):
            ref[bi, :, idx[bi, ti]] += g[bi, ti]
    kind = get_kind("embedding")
    f = Factorized(idx, g)
    assert torch.equal(kind.materialize(f, (d, v)), ref.reshape(b, -1))
    assert torch.equal(kind.materialize_columns(f, (d, v), 2 * v + 3, 4 * v + 1),
                       ref.reshape(b, -1)[:, 2 * v + 3:4 * v + 1])
