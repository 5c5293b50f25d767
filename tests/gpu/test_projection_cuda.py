"""The projections on CUDA equal the CPU's (skipped without a GPU; collected on CPU).

Invariants: the seeded matrices are drawn on the CPU and copied, so a layer projected on CUDA
(sparse CSR blocks through cuSPARSE, Kronecker sides, shards' zero-padded blocks, whitened
rows) equals the CPU projection of the same data up to reordered float sums (rel. err
<= 1e-4, TF32 off). Breaks if a CUDA path built other matrices or dropped a block.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")]
TOL = 1e-4
DEV = "cuda"


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.cpu() - y.cpu()).norm() / y.cpu().norm().clamp_min(1e-30))


@pytest.mark.parametrize("kind", ["sparse", "kronecker", "auto"])
@pytest.mark.parametrize("layer", ["linear", "embedding"])
def test_projection_on_cuda_equals_cpu(kind, layer, monkeypatch):
    """Factorized layers and their materialized rows project alike on CUDA and CPU, over
    several seeded blocks (BLOCK shrunk so blocks cut output rows)."""
    from dattri_ds import Dense, Factorized, LayerGrad
    from dattri_ds.layers import get_kind
    from dattri_ds.ops import Projector, ProjectionConfig, project, projection

    monkeypatch.setattr(projection, "BLOCK", 997)
    gen = torch.Generator().manual_seed(0)
    o, i = 96, 65
    a = (torch.randint(0, i, (8, 12), generator=gen) if layer == "embedding"
         else torch.randn(8, 12, i, generator=gen))
    lg = LayerGrad("w", get_kind(layer), Factorized(a, torch.randn(8, 12, o, generator=gen)),
                   (o, i))
    proj = Projector(ProjectionConfig(kind=kind, dim=512, seed=3))
    want = project(lg, proj).data.values
    got = project(lg.replace(data=lg.data.to(DEV)), proj).data.values
    assert got.device.type == DEV and _rel(got, want) <= TOL
    rows = Dense(lg.kind.rows(lg.data, lg.shape).to(DEV))
    assert _rel(project(lg.replace(data=rows), proj).data.values, want) <= TOL


def test_sparse_shards_on_cuda_sum_to_the_row():
    """``Projector.apply`` of columns on CUDA: column shards' partial projections sum to the whole row."""
    from dattri_ds.ops import Projector, ProjectionConfig

    proj = Projector(ProjectionConfig(kind="sparse", dim=256, seed=5))
    d = 40000
    x = torch.randn(4, d, generator=torch.Generator().manual_seed(1))
    want = proj.apply("w", x, 256)
    xc = x.to(DEV)
    halves = [h.to(DEV) for h in torch.arange(d).chunk(3)]
    parts = sum(proj.apply("w", xc[:, h], 256, h, d) for h in halves)
    assert _rel(parts, want) <= TOL
