"""The peer benchmark's own adapters (benchmarks/_peer_tasks.py) against its exact reference.

Invariant: the benchmark's baselines compute what they claim, so its ratios compare equal
work. The dattri-ds exact grad-dot path equals the per-example-autograd reference, and the
vmap baseline (per-example weight gradients, then dattri-ds's seeded Kronecker matrices)
equals dattri-ds's projected scores. Peers are not needed (they are not installed here).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
T = pytest.importorskip("_peer_tasks")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def wl():
    return T.build(64, n_train=4, n_query=3, seq=16)


def _close(x: torch.Tensor, y: torch.Tensor, tol: float = 1e-5) -> None:
    assert x.shape == y.shape
    err = float((x - y).norm() / y.norm())
    assert err < tol, err


def test_workload_is_the_16_weights_without_bias(wl):
    """The attributed set is the 16 attention/MLP weights (no biases to disagree on)."""
    mods = [wl.model.get_submodule(n) for n in wl.layers]
    assert len(mods) == 16
    assert all(isinstance(m, torch.nn.Linear) and m.bias is None for m in mods)


def test_dattri_ds_exact_graddot_equals_autograd_reference(wl):
    """Exact scores of the dattri-ds ghost path == per-example autograd (the reference)."""
    ref = T.exact(wl, T.Clock())
    _close(T.ds_graddot_exact(wl, T.Clock()), ref)


def test_vmap_baseline_equals_dattri_ds_projection(wl):
    """vmap rows projected with dattri-ds's matrices give dattri-ds's projected scores."""
    _close(T.vmap_graddot(wl, T.Clock()), T.ds_graddot(wl, T.Clock()), 1e-4)


def test_clock_times_one_region(wl):
    """The worker rejects adapters that time zero or several regions; this one times one."""
    clock = T.Clock()
    T.ds_collect(wl, clock)
    assert clock.entered == 1 and clock.cpu > 0 and clock.peak_mb > 0
