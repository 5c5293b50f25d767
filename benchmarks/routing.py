"""Cost-model routing: the routed path against the forced ghost and dense paths, per shape.

Ops (one synthetic linear layer, factors ``a [B, T, I]``, ``g [B, T, O]``, float32):

* ``cross_gram``: ``layer_cross_gram(x, y)``, train x query gram ``[B, B]`` (query set of the
  same size and length as the train set).
* ``norm``: ``layer_sq_norms(x)``, ``[B]``.
* ``project_kron``: ``project(x, Projector(ProjectionConfig(dim=1024)))``, ``[B, 32*32]``.

Sweep: T in {1, 16, 128, 512, 2048} x I in {64, 256, 1024, 4096} x O in the same set. For
each case B is the largest power of two (<= 64) for which the roofline estimate of the
slower path stays under a time budget and the estimated peak memory under 3 GB; cases that
do not fit even at B = 1 (a slower path estimated over ``--max-s``, or over the memory cap)
are skipped and listed.

Per case, timed interleaved in the same rounds: forced ``path="ghost"``, forced
``path="dense"``, and ``path=None`` routed by ``CostModel(Roofline.measure())`` and by
``CostModel(Roofline.default("cpu"))``. Each sample repeats the call enough times to last
a few milliseconds, after one untimed call of the same variant (warm caches for all);
the reported time per call is the *minimum* over rounds: other processes on the shared
machine only ever add time, and these calls are short enough (microseconds to 0.1 s) that a
median of a few rounds still carries their interference.

Two ratios per router: *timed* = routed time / min(ghost, dense) (includes the router's own
overhead and timing noise) and *choice* = time of the forced path the router picked /
min(ghost, dense) (noise-free when the router picks the faster path: exactly 1).
Target: routed never > 1.10x the faster forced path. Both paths are also checked to agree.

Run: ``.venv/bin/python benchmarks/routing.py [--quick]``.
"""

from __future__ import annotations

import itertools
import math
import time

import torch

from _common import Variant, base_parser, environment, interleaved, setup_torch, table

from dattri_ds import CostModel, Factorized, LayerGrad, Roofline
from dattri_ds.layers import get_kind
from dattri_ds.ops import ProjectionConfig, Projector, estimate, kron_dims
from dattri_ds.ops import layer_cross_gram, layer_sq_norms, project

TARGET = 1.10
OPS = ("cross_gram", "norm", "project_kron")
TS = (1, 16, 128, 512, 2048)
WIDTHS = (64, 256, 1024, 4096)
B_CHOICES = (64, 32, 16, 8, 4, 2, 1)
MEM_CAP = 3 * 2**30
CHUNK_ELEMS = 1 << 24  # layers/outer.py GHOST_CHUNK_ELEMENTS (ghost intermediates)


def op_kwargs(op: str, B: int, T: int, I: int, O: int, k: int) -> dict[str, int]:
    if op == "cross_gram":
        return {"B2": B, "S": T}
    if op == "project_kron":
        ko, ki = kron_dims(k, O, I)
        return {"ko": ko, "ki": ki}
    return {}


def est_seconds(op: str, B: int, T: int, I: int, O: int, k: int,
                roof: Roofline) -> dict[str, float]:
    dims = get_kind("linear").dims(
        Factorized(torch.empty(B, T, I, device="meta"), torch.empty(B, T, O, device="meta")),
        (O, I))
    costs = estimate(op, dims, **op_kwargs(op, B, T, I, O, k))
    return {p: c.seconds(roof) for p, c in costs.items()}


def est_bytes(op: str, B: int, T: int, I: int, O: int, k: int) -> int:
    """Rough peak: factors + the larger path's intermediates (fp32)."""
    e = 4
    factors = B * T * (I + O) * e * (2 if op == "cross_gram" else 1)
    if op == "cross_gram":
        dense = 2 * B * I * O * e
        ghost = 3 * max(min(B * T * B * T, CHUNK_ELEMS), T * B * T) * e
    elif op == "norm":
        dense = 2 * B * I * O * e
        ghost = 3 * max(min(B * T * T, CHUNK_ELEMS), T * T) * e
    else:
        ko, _ = kron_dims(k, O, I)
        dense = B * I * O * e + B * ko * I * e
        ghost = 2 * B * T * 64 * e
    return factors + max(dense, ghost)


def pick_batch(op, T, I, O, k, roof, budget, max_s) -> tuple[int | None, str]:
    for b in B_CHOICES:
        if est_bytes(op, b, T, I, O, k) > MEM_CAP:
            continue
        if max(est_seconds(op, b, T, I, O, k, roof).values()) <= budget:
            return b, ""
    s1 = max(est_seconds(op, 1, T, I, O, k, roof).values())
    m1 = est_bytes(op, 1, T, I, O, k)
    if m1 > MEM_CAP:
        return None, f"memory {m1 / 2**30:.1f} GB at B=1"
    if s1 > max_s:
        return None, f"slower path est. {s1:.2f} s/call at B=1"
    return 1, ""


def layer(name: str, B: int, T: int, I: int, O: int, gen: torch.Generator) -> LayerGrad:
    a = torch.randn(B, T, I, generator=gen)
    g = torch.randn(B, T, O, generator=gen) / math.sqrt(O)
    return LayerGrad(name, get_kind("linear"), Factorized(a, g), (O, I))


def make_call(op: str, x: LayerGrad, y: LayerGrad | None, projector: Projector):
    if op == "cross_gram":
        return lambda cost, path: layer_cross_gram(x, y, cost, path)
    if op == "norm":
        return lambda cost, path: layer_sq_norms(x, cost, path)
    return lambda cost, path: project(x, projector, cost, path).data.values


def repeated(fn, n: int):
    def run():
        for _ in range(n):
            fn()
    return run


def time_case(call, models: dict[str, CostModel], reps: int, sample_s: float) -> dict:
    fns = {"ghost": lambda: call(models["measure"], "ghost"),
           "dense": lambda: call(models["measure"], "dense")}
    for key, cm in models.items():
        fns[f"routed:{key}"] = (lambda c: (lambda: call(c, None)))(cm)
    results, counts = {}, {}
    for name, fn in fns.items():  # warm-up, calibrate repeats, collect outputs
        t0 = time.perf_counter()
        results[name] = fn()
        dt = time.perf_counter() - t0
        counts[name] = max(1, min(1000, math.ceil(sample_s / max(dt, 1e-7))))
    # setup: one untimed call first, so no variant pays for the cache state that the
    # previous variant (often a large dense materialization) left behind
    variants = [Variant(n, repeated(f, counts[n]), setup=f) for n, f in fns.items()]
    times = interleaved(variants, reps=reps, warmup=0, collect=False)
    per_call = {n: min(ts) / counts[n] for n, ts in times.items()}
    g, d = results["ghost"], results["dense"]
    err = float((g - d).norm() / d.norm().clamp_min(1e-30))
    return {"t": per_call, "err": err}


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--k", type=int, default=1024, help="Kronecker projection dim")
    p.add_argument("--budget", type=float, default=None,
                   help="target est. seconds of the slower path when choosing B")
    p.add_argument("--max-s", type=float, default=0.6,
                   help="skip a case when its slower path is estimated above this at B=1")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--json", default=None, help="also write every case's timings here")
    args = p.parse_args()
    setup_torch(args.threads)
    quick = args.quick
    reps = args.reps or (3 if quick else 5)
    budget = args.budget or (0.03 if quick else 0.1)
    sample_s = 0.003 if quick else 0.01
    ts = (1, 128, 2048) if quick else TS
    widths = (64, 1024) if quick else WIDTHS
    shapes = ([(w, w) for w in widths] if quick else list(itertools.product(widths, widths)))
    ops = [o for o in args.ops.split(",") if o]

    roof_m = Roofline.measure()
    roof_d = Roofline.default("cpu")
    models = {"measure": CostModel(roof_m), "default": CostModel(roof_d),
              "calibrated": CostModel(roof_m, calibrate=True)}
    projector = Projector(ProjectionConfig(dim=args.k))
    gen = torch.Generator().manual_seed(0)
    print("routing: forced ghost / forced dense / routed (measured and default roofline)")
    print(environment())
    print(f"Roofline.measure(): {roof_m.flops_per_s / 1e9:.1f} GFLOP/s, "
          f"{roof_m.bytes_per_s / 1e9:.1f} GB/s; Roofline.default('cpu'): "
          f"{roof_d.flops_per_s / 1e9:.1f} GFLOP/s, {roof_d.bytes_per_s / 1e9:.1f} GB/s")

    rows, skipped, cases = [], [], []
    t_start = time.perf_counter()
    for op in ops:
        for T, (I, O) in itertools.product(ts, shapes):
            B, why = pick_batch(op, T, I, O, args.k, roof_m, budget, args.max_s)
            if B is None:
                skipped.append(f"{op} T={T} I={I} O={O}: {why}")
                continue
            name = f"{op}.T{T}.I{I}.O{O}"
            x = layer(name, B, T, I, O, gen)
            y = layer(name, B, T, I, O, gen) if op == "cross_gram" else None
            res = time_case(make_call(op, x, y, projector), models, reps, sample_s)
            del x, y
            t = res["t"]
            best = min(("ghost", "dense"), key=t.__getitem__)
            case = {"op": op, "T": T, "I": I, "O": O, "B": B, "name": name, "t": t,
                    "best": best, "err": res["err"]}
            for key, cm in models.items():
                dec = [d for d in cm.decisions() if d.layer == name and not d.forced]
                case[f"path:{key}"] = dec[-1].path if dec else "?"
                case[f"timed:{key}"] = t[f"routed:{key}"] / t[best]
                case[f"choice:{key}"] = t[case[f"path:{key}"]] / t[best] if dec else float("nan")
            cases.append(case)
            flag = "" if max(case["choice:measure"], case["choice:default"]) <= TARGET else "  <-- wrong path"
            rows.append((op, T, I, O, B, t["ghost"] * 1e3, t["dense"] * 1e3, best,
                         case["path:measure"], f"{case['timed:measure']:.2f}/{case['choice:measure']:.2f}",
                         case["path:default"], f"{case['timed:default']:.2f}/{case['choice:default']:.2f}",
                         f"{res['err']:.0e}" + flag))
    wall = time.perf_counter() - t_start

    print(f"{len(cases)} cases in {wall:.0f}s ({reps} rounds each); ratio columns are "
          f"timed/choice (see module docstring)\n")
    print(table(["op", "T", "I", "O", "B", "ghost ms", "dense ms", "best", "route(meas)",
                 "x best", "route(def)", "x best", "ghost~dense"], rows))
    if skipped:
        print(f"\nskipped {len(skipped)} infeasible case(s) (time/memory caps):")
        for s in skipped:
            print("  " + s)

    print("\nper op, worst ratio (timed / choice) and wrong-path count (choice > "
          f"{TARGET}):")
    op_rows = []
    for op in ops:
        cs = [c for c in cases if c["op"] == op]
        if not cs:
            continue
        r = [op]
        for key in models:
            r += [f"{max(c[f'timed:{key}'] for c in cs):.2f}",
                  f"{max(c[f'choice:{key}'] for c in cs):.2f}",
                  sum(c[f"choice:{key}"] > TARGET for c in cs)]
        op_rows.append(r)
    print(table(["op"] + [f"{k[:5]} {c}" for k in models for c in ("timed", "choice", "wrong")],
                op_rows))

    print("\ncost model explain() for a few cases:")
    picks = {id(c): c for c in (
        [max(cases, key=lambda c: c["choice:measure"]), max(cases, key=lambda c: c["choice:default"])]
        + [c for c in cases if (c["op"], c["T"], c["I"], c["O"]) in
           {("cross_gram", 128, 1024, 1024), ("norm", 512, 256, 256), ("project_kron", 128, 1024, 1024)}]
    )}
    for c in picks.values():
        print(f"  [{c['name']} B={c['B']}] measured ghost {c['t']['ghost'] * 1e3:.3g} ms, "
              f"dense {c['t']['dense'] * 1e3:.3g} ms")
        for key, cm in models.items():
            for d in cm.decisions():
                if d.layer == c["name"] and not d.forced:
                    print(f"    {key:7s}: {d.explain()}")

    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump({"roofline": {"measure": vars(roof_m), "default": vars(roof_d)},
                       "cases": cases, "skipped": skipped}, fh, indent=1)
    max_err = max(c["err"] for c in cases)
    parts = []
    for key in models:
        wt = max(cases, key=lambda c: c[f"timed:{key}"])
        wc = max(cases, key=lambda c: c[f"choice:{key}"])
        n_bad = sum(c[f"choice:{key}"] > TARGET for c in cases)
        parts.append(f"{key} roofline worst timed {wt[f'timed:{key}']:.2f}x ({wt['name']}), "
                     f"worst choice {wc[f'choice:{key}']:.2f}x ({wc['name']}), "
                     f"{n_bad}/{len(cases)} wrong-path")
    ok = all(c[f"choice:{k}"] <= TARGET for c in cases for k in models)
    print(f"\nSUMMARY routing: routed/best (target <= {TARGET}x) {'PASS' if ok else 'FAIL'}: "
          + "; ".join(parts) + f"; ghost~dense max rel err {max_err:.1e}; {len(skipped)} "
          f"skipped; {len(cases)} cases in {wall:.0f}s")


if __name__ == "__main__":
    main()
