"""Calibration of the planner's device terms from measured GPU step times.

``RECORDED`` holds the first H200 measurements (commit 0eb5305, issue 34; docs/gpu.md): the
throughput ladder of ``benchmarks/scale.py throughput`` (bf16, B=4, T=512, Kronecker k=256; a
plain forward+backward and a collect pass) at Qwen2 0.5B / 1.5B / 7B, and ``launch/train.py``
steps of the 1B Llama config under ZeRO-3 on one GPU (micro-batch 8, T=512, vocabulary 8192).

``fit`` chooses the four host and device terms of a ``DeviceSpec`` that ``plan._times`` reads
(``efficiency``, ``kernel_latency_s``, ``capture_layer_s``, ``zero3_tensor_s``): a grid over
the first two, the others in closed form, minimizing the squared relative error of every
fitted point. ``python benchmarks/calibrate.py`` prints the fit, each point's error and the
leave-one-size-out predictions; ``--from runs/gpu_check`` refits on a new
``tools/gpu_check.sh`` run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from dattri_ds.plan import DEVICES, DeviceSpec, ModelShape, RunSpec, plan

__all__ = ["Measurement", "RECORDED", "predict", "fit", "leave_one_out", "from_run"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Measurement:
    """One measured time.

    Attributes:
        name: label (size and what ran). config: model config (path under the repository
        root). kind: ``train`` (one plain step: the plan's ``train_step``), ``collect``
        (one probe pass over the batch: ``collect_per_example x B``) or ``capture_step``
        (a training step with capture: the plan's ``step``). spec: the run. seconds:
        measured. fitted: used by the fit (False: a held-out check).
    """

    name: str
    config: str
    kind: Literal["train", "collect", "capture_step"]
    spec: RunSpec
    seconds: float
    vocab: int | None = None
    fitted: bool = True

    def shape(self) -> ModelShape:
        return ModelShape.from_config(ROOT / self.config, vocab_size=self.vocab)


_LADDER = dict(world=1, seq_len=512, micro_batch=4, zero_stage=0, dtype="bfloat16", k=256)
_LAUNCH = dict(world=1, seq_len=512, micro_batch=8, zero_stage=3, dtype="bfloat16", k=256,
               optimizer="adamw")
_QWEN = {"0.5b": "configs/model_qwen_0.5b.json", "1.5b": "configs/model_qwen_1.5b.json",
         "7b": "configs/model_qwen_7b.json"}

#: The H200 measurements of issue 34 (seconds).
RECORDED: tuple[Measurement, ...] = (
    *(Measurement(f"{n} fwd+bwd", _QWEN[n], "train",
                  RunSpec(**_LADDER, capture=False, optimizer="sgd"), s)
      for n, s in (("0.5b", 0.062), ("1.5b", 0.068), ("7b", 0.173))),
    *(Measurement(f"{n} collect", _QWEN[n], "collect", RunSpec(**_LADDER, train=False), s)
      for n, s in (("0.5b", (0.113 + 0.127) / 2), ("1.5b", (0.139 + 0.147) / 2),
                   ("7b", (0.215 + 0.224) / 2))),
    Measurement("1b launch ZeRO-3 plain", "configs/model_llama_1b.json", "train",
                RunSpec(**_LAUNCH, capture=False), 8 / 15.8, vocab=8192),
    Measurement("1b launch ZeRO-3 --capture", "configs/model_llama_1b.json", "capture_step",
                RunSpec(**_LAUNCH, capture=True), 8 / 13.5, vocab=8192, fitted=False),
)


def predict(m: Measurement, dev: DeviceSpec | str = "h200") -> float:
    """The planner's seconds for what ``m`` measured."""
    p = plan(m.shape(), dev, m.spec)
    if m.kind == "collect":
        return p.times["collect_per_example"] * m.spec.micro_batch
    return p.times["train_step" if m.kind == "train" else "step"]


def _parts(m: Measurement, base: DeviceSpec) -> dict[str, float]:
    """The planner's terms of ``m`` at efficiency 1 and zero host terms, and the counts the
    host terms multiply (``_times``'s formula, split for a vectorized fit)."""
    unit = replace(base, efficiency=1.0, kernel_latency_s=0.0, capture_layer_s=0.0,
                   zero3_tensor_s=0.0)
    sh = m.shape()
    t = plan(sh, unit, m.spec).times
    return {"fwd": t["forward"], "proj": t["capture"] if m.kind != "collect" else
            t["collect_per_example"] * m.spec.micro_batch - 2 * t["forward"],
            "kernels": sh.forward_kernels(), "layers": sum(L.count for L in sh.captured_layers()),
            "tensors": sh.param_tensors if m.spec.zero_stage >= 3 else 0}


def fit(points: tuple[Measurement, ...] = RECORDED, base: DeviceSpec | str = "h200"
        ) -> DeviceSpec:
    """``base`` with the four terms that best predict the ``fitted`` points (see module)."""
    base = DEVICES[base] if isinstance(base, str) else base
    pts = [m for m in points if m.fitted]
    P = {k: np.array([_parts(m, base)[k] for m in pts]) for k in
         ("fwd", "proj", "kernels", "layers", "tensors")}
    y = np.array([m.seconds for m in pts])
    kind = np.array([m.kind for m in pts])
    eff = np.arange(0.20, 1.0001, 0.005)[:, None]
    lat = (np.arange(1.0, 60.0001, 0.1) * 1e-6)[None, :]
    best = (np.inf, None)
    for e_ in eff[:, 0]:
        fwd, host = P["fwd"][None, :] / e_, P["kernels"][None, :] * lat.T
        # train points: max(3h + z, 3 fwd) (z: per-tensor ZeRO-3, fitted below);
        # collect: 2h + layers c + 2 fwd + proj (c fitted in closed form)
        col = kind == "collect"
        rest = 2 * host + 2 * fwd + P["proj"][None, :]
        n = np.where(col, P["layers"], 0.0)[None, :] / y
        r = np.where(col[None, :], rest / y - 1, 0.0)
        c = np.clip(-(r * n).sum(1, keepdims=True) / np.maximum((n * n).sum(), 1e-30), 0, None)
        z = _fit_zero3(P, y, kind, fwd, host)
        pred_train = np.maximum(3 * host + P["tensors"][None, :] * z, 3 * fwd)
        pred = np.where(col[None, :], rest + c * P["layers"][None, :], pred_train)
        pred = np.where(kind == "capture_step", pred_train + c * P["layers"][None, :]
                        + P["proj"][None, :], pred)
        loss = ((pred / y - 1) ** 2).sum(1)
        i = int(np.argmin(loss))
        if loss[i] < best[0]:
            best = (loss[i], (float(e_), float(lat[0, i]), float(c[i, 0]), float(z[i, 0])))
    e_, l_, c_, z_ = best[1]
    return replace(base, efficiency=round(e_, 3), kernel_latency_s=float(f"{l_:.3g}"),
                   capture_layer_s=float(f"{c_:.3g}"), zero3_tensor_s=float(f"{z_:.3g}"))


def _fit_zero3(P, y, kind, fwd, host) -> np.ndarray:
    """Per-tensor ZeRO-3 host time of every latency candidate: the ZeRO-3 training points'
    ``(y - 3h) / tensors`` (their mean in relative terms), 0 without such points."""
    sel = (kind == "train") & (P["tensors"] > 0)
    if not sel.any():
        return np.zeros((host.shape[0], 1))
    z = (y[sel][None, :] - 3 * host[:, sel]) / P["tensors"][sel][None, :]
    return np.clip(z.mean(1, keepdims=True), 0, None)


def leave_one_out(points: tuple[Measurement, ...] = RECORDED, base: str = "h200"
                  ) -> dict[str, tuple[float, float]]:
    """Per ladder size: ``name -> (prediction, measured)`` of its points by a fit without
    that size's points."""
    out: dict[str, tuple[float, float]] = {}
    for size in _QWEN:
        held = [m for m in points if m.config == _QWEN[size]]
        if not held or all(m in held for m in points if m.fitted):
            continue
        dev = fit(tuple(m for m in points if m not in held), base)
        out.update({m.name: (predict(m, dev), m.seconds) for m in held})
    return out


def from_run(folder: str | Path) -> tuple[Measurement, ...]:
    """The measurements of a ``tools/gpu_check.sh`` run: its ``throughput.json`` (ladder:
    fwd+bwd and collect per size) and ``launch_steps.json`` (the plain step fitted, the
    capture step held out)."""
    folder, out = Path(folder), []
    tp = folder / "throughput.json"
    for r in (json.loads(tp.read_text()) if tp.exists() else []):
        if r["size"] not in _QWEN:
            continue
        lad = {**_LADDER, "micro_batch": r["B"], "seq_len": r["T"]}
        out += [Measurement(f"{r['size']} fwd+bwd", _QWEN[r["size"]], "train",
                            RunSpec(**lad, capture=False, optimizer="sgd"), r["train_s"]),
                Measurement(f"{r['size']} collect", _QWEN[r["size"]], "collect",
                            RunSpec(**lad, train=False), r["collect_s"])]
    ls = folder / "launch_steps.json"
    if ls.exists():
        rec = json.loads(ls.read_text())
        o = rec["opts"]
        cfg = o["model_config"]  # absolute, or relative to the repository root
        launch = {**_LAUNCH, "micro_batch": o["micro"] * o["gas"], "seq_len": o["seq_len"]}
        for r in rec["rows"]:
            if r.get("variant") in ("plain", "capture") and "step_s" in r:
                cap = r["variant"] == "capture"
                out.append(Measurement(f"launch {r['variant']}", cfg,
                                       "capture_step" if cap else "train",
                                       RunSpec(**launch, capture=cap), r["step_s"],
                                       vocab=o["vocab"], fitted=not cap))
    return tuple(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="run", default=None,
                   help="refit on a tools/gpu_check.sh output folder instead of RECORDED")
    args = p.parse_args(argv)
    points = from_run(args.run) if args.run else RECORDED
    if not any(m.fitted for m in points):
        raise SystemExit(f"no ladder or launch measurement under {args.run}")
    dev = fit(points)
    print(f"fit: efficiency {dev.efficiency}, kernel_latency_s {dev.kernel_latency_s:.3g}, "
          f"capture_layer_s {dev.capture_layer_s:.3g}, zero3_tensor_s {dev.zero3_tensor_s:.3g}")
    print("| point | measured s | fitted planner s | error | shipped planner s | error |")
    print("|---|---|---|---|---|---|")
    for m in points:
        a, b = predict(m, dev), predict(m, "h200")
        print(f"| {m.name}{'' if m.fitted else ' (held out)'} | {m.seconds:.3f} | {a:.3f} | "
              f"{a / m.seconds - 1:+.0%} | {b:.3f} | {b / m.seconds - 1:+.0%} |")
    print("\nleave one size out (that size's two points not fitted):")
    for name, (pred, y) in leave_one_out(points).items():
        print(f"  {name}: predicted {pred:.3f} s, measured {y:.3f} s ({pred / y - 1:+.0%})")


if __name__ == "__main__":
    main()
