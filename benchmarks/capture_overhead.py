"""Capture overhead: forward+backward with GradientCapture over plain forward+backward.

Model: random-init GPT2LMHeadModel (4 layers, n_embd 256, 4 heads, vocab 4096), T=128,
B=16, CPU, HF token-mean loss. Variants, timed interleaved in the same rounds:

* ``plain``: ``model(input_ids, labels).loss.backward()``.
* ``capture+proj``: the same inside ``GradientCapture`` with
  ``CaptureConfig(projection=ProjectionConfig(dim=k))`` (Kronecker, k=1024 per layer); the
  projected GradBatch is built before ``backward()`` returns, so it is inside the timing.
* ``capture (factors)``: capture without projection (per-example factors only).
* ``hooks only`` (diagnostic): the capture's hooks and tensor retention, with the
  end-of-backward build/projection replaced by a no-op; splits the overhead into
  "hooks + keeping factors alive" and "building + projecting".

Reported ratio: median over rounds of (variant time / plain time in the same round).
Target: capture+proj <= 1.15x plain. A separate, instrumented run (not used for the ratio)
prints where the capture spends its time.

Run: ``.venv/bin/python benchmarks/capture_overhead.py [--quick] [--profile]``.
"""

from __future__ import annotations

import collections
import time
import warnings

import torch

from _common import (
    Variant, base_parser, environment, gpt2, interleaved, median, model_args, n_params,
    paired_ratio, setup_torch, spread, table,
)

from dattri_ds import CaptureConfig, GradientCapture, ProjectionConfig
import dattri_ds.capture.hooks as capture_mod

TARGET = 1.15


class HooksOnlyCapture(GradientCapture):
    """Diagnostic: forward/tensor hooks and factor retention, no build/projection at the end."""

    def _finalize(self, rec) -> None:  # noqa: D102 - mirrors the library's private hook
        rec.done = True
        self._in_backward = None
        if rec in self._open:
            self._open.remove(rec)
        rec.pairs.clear()


def make_step(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    return step


def capture_variant(name: str, model, ids, cap: GradientCapture, out: dict) -> Variant:
    step = make_step(model, ids)

    def fn():
        step()
        out[name] = cap.pop()

    return Variant(name, fn, setup=cap.attach, teardown=cap.detach)


def breakdown(model, ids, config: CaptureConfig, reps: int) -> list[tuple[str, float]]:
    """Mean ms per step in the capture's finalize stages (instrumented, best effort)."""
    acc: dict[str, float] = collections.defaultdict(float)
    cap = GradientCapture(model, config)
    patched: list[tuple[object, str, object]] = []

    def wrap(obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr, None)
        if fn is None:
            return

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0

        patched.append((obj, attr, fn))
        setattr(obj, attr, timed)

    wrap(cap, "_finalize", "finalize (total, inside backward)")
    wrap(cap, "_build", "  _build: factors, projection, finiteness")
    wrap(cap, "_layers", "    _layers: stacked per-layer factors (scaled)")
    wrap(capture_mod, "project_layers", "    project_layers: Kronecker projection")
    wrap(cap, "_read", "    _read: finiteness total + ids, one host copy")
    step = make_step(model, ids)
    try:
        with cap:
            step()
            cap.pop()
            acc.clear()
            t_total = 0.0
            for _ in range(reps):
                t0 = time.perf_counter()
                step()
                t_total += time.perf_counter() - t0
                cap.pop()
    finally:
        for obj, attr, fn in patched:
            if obj is cap:
                delattr(cap, attr)
            else:
                setattr(obj, attr, fn)
    rows = [("step (fwd+bwd+capture)", t_total / reps * 1e3)]
    rows += [(k, v / reps * 1e3) for k, v in acc.items()]
    return rows


def profile(model, ids, config: CaptureConfig) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    step = make_step(model, ids)
    for label, cap in (("plain", None), ("capture+proj", GradientCapture(model, config))):
        if cap is not None:
            cap.attach()
        step()
        with tprofile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        if cap is not None:
            cap.pop()
            cap.detach()
        print(f"\n-- profiler, {label} (one step; self CPU time, top ops) --")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def main() -> None:
    p = base_parser(__doc__)
    model_args(p)
    p.add_argument("--profile", action="store_true", help="print torch.profiler op tables")
    p.add_argument("--no-diagnostic", action="store_true", help="skip the hooks-only variant")
    args = p.parse_args()
    if args.quick:
        args.B, args.T = min(args.B, 4), min(args.T, 64)
    reps = args.reps or (3 if args.quick else 11)
    setup_torch(args.threads)
    warnings.filterwarnings("ignore", message=".*loss_type.*")

    model = gpt2(args.layers, args.embd, args.vocab, args.T)
    ids = torch.randint(0, args.vocab, (args.B, args.T))
    proj_cfg = CaptureConfig(projection=ProjectionConfig(dim=args.k))
    out: dict = {}
    variants = [
        Variant("plain", make_step(model, ids)),
        capture_variant("capture+proj", model, ids, GradientCapture(model, proj_cfg), out),
        capture_variant("capture (factors)", model, ids, GradientCapture(model), out),
    ]
    if not args.no_diagnostic:
        variants.append(capture_variant("hooks only (diag)", model, ids,
                                        HooksOnlyCapture(model), out))

    print(f"capture_overhead: GPT-2 {args.layers}L d={args.embd} V={args.vocab} "
          f"({n_params(model) / 1e6:.2f}M params), B={args.B} T={args.T}, k={args.k}")
    print(environment())
    t0 = time.perf_counter()
    times = interleaved(variants, reps=reps, warmup=1)
    wall = time.perf_counter() - t0

    batch = out["capture+proj"]
    vals = [lg.data.values for lg in batch.layers.values()]
    finite = all(bool(torch.isfinite(v).all()) for v in vals)
    print(f"projected batch: {len(vals)} layers, {sum(v.shape[1] for v in vals)} dims/example, "
          f"finite={finite}; {reps} rounds in {wall:.1f}s\n")

    rows = []
    for v in variants:
        lo, hi = spread(times[v.name])
        if v.name == "plain":
            r, rlo, rhi = 1.0, 1.0, 1.0
        else:
            ratios = [a / b for a, b in zip(times[v.name], times["plain"])]
            r, (rlo, rhi) = paired_ratio(times, v.name, "plain"), spread(ratios)
        rows.append((v.name, median(times[v.name]) * 1e3, f"{lo * 1e3:.0f}-{hi * 1e3:.0f}",
                     r, f"{rlo:.2f}-{rhi:.2f}"))
    print(table(["variant", "median ms", "p25-p75 ms", "x plain", "ratio p25-p75"], rows))

    print("\nwhere capture+proj spends its time (instrumented run, mean ms/step):")
    print(table(["stage", "ms"], breakdown(model, ids, proj_cfg, max(2, reps // 3))))
    if args.profile:
        profile(model, ids, proj_cfg)

    r_proj = paired_ratio(times, "capture+proj", "plain")
    r_fac = paired_ratio(times, "capture (factors)", "plain")
    verdict = "PASS" if r_proj <= TARGET else "FAIL"
    print(f"\nSUMMARY capture_overhead: capture+kron-proj(k={args.k}) / plain fwd+bwd = "
          f"{r_proj:.3f}x (target <= {TARGET}x) {verdict}; factors only = {r_fac:.3f}x "
          f"[B={args.B} T={args.T}, {reps} rounds]")


if __name__ == "__main__":
    main()
