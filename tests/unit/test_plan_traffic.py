"""plan --nodes: inter-node bytes per step of capture and selection, on hand-computed cases.

Invariant: each collective's bytes per inter-node link follow the ring formulas of
dattri_ds/plan/traffic.py (all_reduce 2 (R-1)/R S, all_gather (R-1)/R S, 0 on one node),
times its calls per step; capture adds none; a content score adds none per step.
"""

from __future__ import annotations

import pytest

from dattri_ds.errors import ConfigError
from dattri_ds.layers import get_kind
from dattri_ds.plan import LayerShape, RunSpec
from dattri_ds.plan.traffic import TrafficSpec, ring_link_bytes, traffic


class _Model:
    """1000 parameters; captured: two [20, 10] linears and one 8-wide norm."""

    num_params = 1000

    def captured_layers(self):
        return [LayerShape("a", get_kind("linear"), 10, 20, count=2),
                LayerShape("n", get_kind("rmsnorm"), 8, 1)]


PROBE = RunSpec(world=4, method="selection", selection_probe=True, zero_stage=3,
                dtype="bfloat16")
TWO = TrafficSpec(nodes=2, gas=2, refresh_every=10, target_docs=64, target_batch_size=8)


def test_ring_formulas():
    """1000 bytes over 4 ranks on 2 nodes: all_reduce 2 * 3/4 * 1000, all_gather 3/4 * 1000;
    one node: nothing crosses a link."""
    assert ring_link_bytes("all_reduce", 1000, 4, 2) == 1500
    assert ring_link_bytes("all_gather", 1000, 4, 2) == 750
    assert ring_link_bytes("all_reduce", 1000, 4, 1) == 0
    with pytest.raises(ConfigError, match="all_reduce or all_gather"):
        ring_link_bytes("broadcast", 1, 2, 2)


def test_probe_selection_under_zero3_by_hand():
    """Weights 1000 x 2 B. Probe: 2 gas x 2 gathers x 3/4 x 2000 = 6000. Target rows:
    widths min(64, 200) x 2 + min(64, 8) = 136 floats + count: all_reduce of 548 B every 10
    steps: 0.1 x 1.5 x 548 = 82.2. Target passes: ceil(ceil(64 / 4) / 8) = 2, forward and
    backward, every 10 steps: 0.4 x 1500 = 600. Sum 6682.2."""
    got = traffic(_Model(), PROBE, TWO, k=64)
    assert got.per_path() == {"capture": 0.0, "selection": pytest.approx(6682.2)}
    assert sorted(c.link_bytes for c in got.collectives) == pytest.approx(
        [82.2, 600, 6000])
    assert got.to_dict()["bytes_per_step_per_link"]["selection"] == pytest.approx(6682.2)
    assert "8 ranks" not in got.table() and "4 ranks on 2 nodes" in got.table()


def test_other_layouts_by_hand():
    """ZeRO-2: weights are replicated, only the refresh's all-reduce remains (82.2);
    one node: 0; a content score (no probe): no collective a step; 3 ranks on 2 nodes:
    refused naming both numbers."""
    z2 = traffic(_Model(), RunSpec(world=4, method="selection", selection_probe=True,
                                   zero_stage=2, dtype="bfloat16"), TWO, k=64)
    assert z2.per_path()["selection"] == pytest.approx(82.2)
    assert traffic(_Model(), PROBE, TrafficSpec(nodes=1), k=64).per_path() == {
        "capture": 0.0, "selection": 0.0}
    content = RunSpec(world=4, method="selection", selection_probe=False, zero_stage=3)
    assert traffic(_Model(), content, TWO, k=64).collectives == ()
    with pytest.raises(ConfigError, match="--nodes 2 does not divide --world 3"):
        traffic(_Model(), RunSpec(world=3), TWO, k=64)


def test_plan_cli_reports_traffic_with_nodes(capsys):
    """``dattri-ds plan --nodes 2`` adds the traffic section; one node has none."""
    from dattri_ds.tools.plan import main

    base = ["--model", "configs/model_llama_tiny.json", "--vocab-size", "512", "--world", "4",
            "--method", "selection", "--selection-probe", "--json"]
    two = main([*base, "--nodes", "2"])
    assert two["traffic"]["nodes"] == 2 and two["traffic"]["bytes_per_step_per_link"][
        "selection"] > 0
    assert "traffic" not in main(base)
