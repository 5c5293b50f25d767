"""Cost model: picks the path that is cheaper by its own estimate, explains, caches, obeys force."""

from __future__ import annotations

import pytest

from dattri_ds.layers import get_kind
from dattri_ds import ConfigError
from dattri_ds.layers import LayerDims
from dattri_ds.ops import CostModel, Roofline, estimate

RL = Roofline(flops_per_s=1e11, bytes_per_s=1e10)


@pytest.mark.parametrize("op,dims,kw,want", [
    ("cross_gram", LayerDims(8, 1, 1024, 1024), dict(B2=8, S=1), "ghost"),
    ("cross_gram", LayerDims(8, 2048, 64, 64), dict(B2=8, S=2048), "dense"),
    ("norm", LayerDims(16, 32, 1024, 4096), {}, "ghost"),
    ("norm", LayerDims(16, 1024, 64, 64), {}, "dense"),
    ("project_kron", LayerDims(16, 128, 256, 1024), dict(ko=32, ki=32), "ghost"),
    ("project_kron", LayerDims(16, 2048, 16, 16), dict(ko=16, ki=16), "dense"),
    ("cross_dense", LayerDims(16, 128, 256, 256), dict(Q=1), "ghost"),
    ("project_dense", LayerDims(16, 64, 256, 256), dict(P=128), "dense"),
    ("sum", LayerDims(16, 64, 256, 256), {}, "ghost"),
])
def test_hand_picked_shapes(op, dims, kw, want):
    """On shapes where one path is clearly cheaper, that path is chosen, and it is the argmin."""
    dec = CostModel(RL).choose(op, "layer", dims, **kw)
    assert dec.path == want
    assert dec.seconds[dec.path] == min(dec.seconds.values())
    assert not dec.forced


def test_index_inputs_are_cheaper_on_ghost():
    """Embedding (one-hot) inputs drop the I factor from ghost products."""
    dense_in = estimate("cross_gram", LayerDims(4, 64, 8192, 256), B2=4, S=64)
    index_in = estimate("cross_gram", LayerDims(4, 64, 8192, 256, index_input=True), B2=4, S=64)
    assert index_in["ghost"].flops < dense_in["ghost"].flops / 10


def test_bytes_change_the_decision():
    """Counting bytes matters: with a starved memory system the lighter-traffic path wins."""
    d = LayerDims(32, 8, 512, 512)
    flops_only = CostModel(Roofline(1e11, 1e18)).choose("cross_gram", "l", d, B2=32, S=8)
    est = estimate("cross_gram", d, B2=32, S=8)
    lighter = min(est, key=lambda p: est[p].bytes)
    slow_mem = CostModel(Roofline(1e18, 1e9)).choose("cross_gram", "l", d, B2=32, S=8)
    assert slow_mem.path == lighter
    assert flops_only.path == min(est, key=lambda p: est[p].flops)


def test_force_explain_and_cache():
    """Forced ops are obeyed and marked; decisions are cached and readable."""
    cm = CostModel(RL, force={"cross_gram": "dense"})
    d = LayerDims(8, 1, 1024, 1024)
    dec = cm.choose("cross_gram", "h.0.mlp", d, B2=8, S=1)
    assert dec.path == "dense" and dec.forced
    assert cm.choose("cross_gram", "h.0.mlp", d, B2=8, S=1) is dec
    assert cm.choose("norm", "h.0.mlp", d, path="dense").path == "dense"
    text = cm.explain()
    assert "h.0.mlp cross_gram" in text and "forced" in text and "MFLOP" in text
    assert len(cm.decisions()) == 2


def test_bad_force_rejected():
    """Unknown ops and paths are configuration errors listing what is allowed."""
    with pytest.raises(ConfigError, match="known ops"):
        CostModel(RL, force={"gram": "dense"})
    with pytest.raises(ConfigError, match="paths"):
        CostModel(RL, force={"norm": "fast"})


def test_measured_roofline_is_positive():
    """Roofline.measure returns finite positive throughputs on this device."""
    rl = Roofline.measure("cpu", size=128)
    assert rl.flops_per_s > 1e6 and rl.bytes_per_s > 1e6


def test_calibrate_settles_close_calls_by_timing():
    """calibrate=True: a close call is timed once on the real tensors and cached (marked
    'timed'); the result is the same as either path's."""
    import torch

    from dattri_ds import Factorized, LayerGrad
    from dattri_ds.ops import layer_cross_gram

    gen = torch.Generator().manual_seed(0)
    f = Factorized(torch.randn(4, 3, 8, generator=gen), torch.randn(4, 3, 8, generator=gen))
    lg = LayerGrad("fc", get_kind("linear"), f, (8, 8))
    cm = CostModel(RL, calibrate=True, calibrate_band=1e9)  # every decision counts as close
    got = layer_cross_gram(lg, lg, cost=cm)
    dec = cm.decisions()[0]
    assert dec.args.get("timed") == 1 and dec.path in ("ghost", "dense")
    assert torch.allclose(got, layer_cross_gram(lg, lg, path="dense"), rtol=1e-5)
    again = layer_cross_gram(lg, lg, cost=cm)  # cached: no second timing
    assert torch.allclose(again, got) and len(cm.decisions()) == 1


@pytest.mark.parametrize("kind", ["kronecker", "rotate"])
def test_calibrate_covers_projection_and_rotation(kind):
    """project_kron and the EK-FAC rotation go through ``CostModel.route`` too: with
    calibrate=True both paths are timed once and the decision is marked 'timed' (breaks if
    an op picks its path outside the router)."""
    import torch

    from dattri_ds import CaptureConfig, GradientCapture, fit_factors, make_attributor
    from dattri_ds.ops import ProjectionConfig, Projector, project_batch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(11, 16), nn.Linear(16, 16))
    x = torch.randint(0, 11, (3, 5))
    with GradientCapture(net, CaptureConfig(loss_reduction="sum", label_shift=0)) as cap:
        cap.tag(["a", "b", "c"])
        net(x).pow(2).sum().backward()
        batch = cap.pop()
    cm = CostModel(RL, calibrate=True, calibrate_band=1e9)  # every decision counts as close
    op = "project_kron" if kind == "kronecker" else "rotate"
    if kind == "kronecker":
        project_batch(batch, Projector(ProjectionConfig(kind="kronecker", dim=16)), cost=cm)
    else:
        from dattri_ds.ops import cost as cost_module

        factors = fit_factors([batch])
        key = torch.device("cpu").type
        saved = cost_module._DEFAULT_MODELS.get(key)
        cost_module._DEFAULT_MODELS[key] = cm  # the factors route through the default model
        try:
            make_attributor("ekfac", factors=factors).scores([batch], batch)
        finally:
            cost_module._DEFAULT_MODELS[key] = saved
    timed = [d for d in cm.decisions() if d.op == op]
    assert timed and all(d.args.get("timed") == 1 for d in timed)


def test_route_builds_layer_dims_from_the_kind():
    """``CostModel.route`` is where LayerDims is built: B, T from the factors, (O, I') from
    the shape, the index case from the kind (an embedding's input side costs no I)."""
    import torch

    from dattri_ds import Factorized
    from dattri_ds.layers import get_kind

    f = Factorized(torch.randint(0, 50, (2, 3)), torch.randn(2, 3, 4))
    cm = CostModel(RL)
    cm.route("norm", "emb", get_kind("embedding"), f, (4, 50), {"ghost": lambda: 1,
                                                                 "dense": lambda: 2})
    dims = next(iter(cm._cache))[2]
    assert dims == LayerDims(B=2, T=3, I=50, O=4, index_input=True, itemsize=4)
