"""The planner's GPU terms against the recorded H200 measurements (benchmarks/calibrate.py).

Invariants: the shipped H200 terms are what ``calibrate.fit`` finds on the recorded points
(four numbers: efficiency, kernel latency, capture host time per layer, ZeRO-3 host time per
parameter tensor; no lookup of answers); with them the planner is within 25% of every
recorded collect pass and training step (Qwen2 0.5B / 1.5B / 7B, B=4, T=512) and of the 1B
ZeRO-3 launch step, plain and (held out of the fit) with capture; a size left out of the fit
is still predicted within 25% for collect; the CPU planner has no host terms, so its
predictions are unchanged. Breaks if the time model loses a term or the constants drift
from the data.
"""

from __future__ import annotations

import pytest

from benchmarks import calibrate
from dattri_ds.plan import DEVICES, ModelShape, RunSpec, plan


def test_shipped_h200_terms_are_the_fit():
    dev, ship = calibrate.fit(), DEVICES["h200"]
    for f in ("efficiency", "kernel_latency_s", "capture_layer_s", "zero3_tensor_s"):
        assert getattr(dev, f) == pytest.approx(getattr(ship, f), rel=0.02), f


@pytest.mark.parametrize("m", calibrate.RECORDED, ids=lambda m: m.name)
def test_planner_within_25_percent_of_h200(m):
    pred = calibrate.predict(m, "h200")
    assert abs(pred / m.seconds - 1) <= 0.25, (m.name, pred, m.seconds)


def test_leave_one_size_out_predicts_collect():
    """A fit without a size's two points predicts that size's collect within 25% (the plain
    7B step is the only compute-bound point: without it the efficiency is not identified,
    docs/gpu.md gives that figure)."""
    out = calibrate.leave_one_out()
    for name, (pred, meas) in out.items():
        if "collect" in name or not name.startswith("7b"):
            assert abs(pred / meas - 1) <= 0.25, (name, pred, meas)


def test_launch_bound_small_model_and_cpu_unchanged():
    """On the H200 a 0.5B pass is host-bound (the kernel term exceeds the roofline term);
    on the CPU host terms are zero and a step is its roofline time."""
    shape = ModelShape.from_config("configs/model_qwen_0.5b.json")
    t = plan(shape, "h200", RunSpec(world=1, micro_batch=4, zero_stage=0, capture=False,
                                    k=256)).times
    assert 3 * t["host_forward"] > 3 * t["forward"]
    assert t["train_step"] == pytest.approx(3 * t["host_forward"])
    cpu = DEVICES["cpu"]
    assert cpu.kernel_latency_s == cpu.capture_layer_s == cpu.zero3_tensor_s == 0.0
    tc = plan(shape, "cpu", RunSpec(world=1, micro_batch=1, seq_len=64, zero_stage=0,
                                    dtype="float32", capture=False, k=64)).times
    assert tc["train_step"] == pytest.approx(3 * tc["forward"])


def test_refit_reads_a_gpu_check_run(tmp_path):
    """``calibrate.from_run`` reads a gpu_check folder (throughput.json, launch_steps.json):
    the recorded values written in that form refit to the same terms."""
    import json

    rec = {m.name: m.seconds for m in calibrate.RECORDED}
    (tmp_path / "throughput.json").write_text(json.dumps(
        [{"size": s, "B": 4, "T": 512, "train_s": rec[f"{s} fwd+bwd"],
          "collect_s": rec[f"{s} collect"]} for s in ("0.5b", "1.5b", "7b")]))
    (tmp_path / "launch_steps.json").write_text(json.dumps({
        "opts": {"model_config": "configs/model_llama_1b.json", "micro": 8, "gas": 1,
                 "seq_len": 512, "vocab": 8192},
        "rows": [{"variant": "plain", "step_s": rec["1b launch ZeRO-3 plain"]},
                 {"variant": "capture", "step_s": rec["1b launch ZeRO-3 --capture"]},
                 {"variant": "bare", "step_s": 0.45}]}))
    points = calibrate.from_run(tmp_path)
    assert len(points) == 8 and sum(not m.fitted for m in points) == 1
    dev, ref = calibrate.fit(points), calibrate.fit()
    for f in ("efficiency", "kernel_latency_s", "capture_layer_s", "zero3_tensor_s"):
        assert getattr(dev, f) == pytest.approx(getattr(ref, f), rel=1e-6), f
