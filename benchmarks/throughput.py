"""Per-example projected-gradient throughput (examples/s) at equal fidelity.

Same model as capture_overhead.py (GPT-2 4L, n_embd 256, 4 heads, vocab 4096, T=128,
B=16, CPU) and the same Kronecker projection (k=1024 per layer). Variants, timed
interleaved in the same rounds:

* (a) ``dattri-ds``: forward+backward of the batch inside ``GradientCapture`` with
  ``CaptureConfig(projection=ProjectionConfig(dim=k))``; output: projected rows per layer.
* (b) ``vmap baseline``: ``torch.func.vmap(grad(per-example loss))`` materializes every
  per-example parameter gradient, maps it to the canonical ``[O, I']`` layout
  (``LayerKind.canonical``) and projects it with the *same* seeded matrices:
  ``vec(P_out G P_in^T)`` with ``P_out, P_in`` from ``Projector.side`` (layers with
  ``O*I' <= k`` are kept exactly, as the library does). The per-example loss is the sum of
  token losses, which is what the capture's default ``per_example_loss="sum"`` means.
* (c) ``plain fwd+bwd``: one ordinary forward+backward of the batch (the physical floor:
  any method has to run at least this).

Targets: (a) >= 2x the throughput of (b); (a) within 1.15x of (c) in time. (a) and (b) are
also compared numerically (relative error per layer), so the speed comparison is at equal
fidelity.

Run: ``.venv/bin/python benchmarks/throughput.py [--quick]``.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from _common import (
    Variant, base_parser, environment, gpt2, interleaved, median, model_args, n_params,
    paired_ratio, setup_torch, spread, table,
)

from dattri_ds import CaptureConfig, GradientCapture, ProjectionConfig, Projector, kind_for
from dattri_ds.ops.projection import kron_dims

TARGET_VS_VMAP = 2.0
TARGET_VS_PLAIN = 1.15


def vmap_projected(model, ids: torch.Tensor, layers: list[str], projector: Projector,
                   chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """``{layer: [B, P]}``: per-example gradients by vmap(grad), then the seeded projection."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss_one(p, x):
        logits = functional_call(model, (p, buffers), args=(),
                                 kwargs={"input_ids": x.unsqueeze(0)}).logits
        return F.cross_entropy(logits[0, :-1].float(), x[1:], reduction="sum")

    grads = vmap(grad(loss_one), in_dims=(None, 0), chunk_size=chunk_size)(params, ids)
    k = projector.config.dim
    out = {}
    for name in layers:
        module = model.get_submodule(name)
        kind = kind_for(module)
        own = {pn: grads[f"{name}.{pn}"] for pn, _ in module.named_parameters(recurse=False)}
        g = kind.canonical(module, own)  # [B, O*I']
        o, i = kind.layer_shape(module)
        if o * i <= k:
            out[name] = g
            continue
        ko, ki = kron_dims(k, o, i)
        p_out = projector.side(name, "out", ko, o, g.device)
        p_in = projector.side(name, "in", ki, i, g.device)
        out[name] = (p_out @ g.view(-1, o, i) @ p_in.T).reshape(g.shape[0], -1)
    return out


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def main() -> None:
    p = base_parser(__doc__)
    model_args(p)
    p.add_argument("--chunk", type=int, default=None, help="vmap chunk_size (default: none)")
    args = p.parse_args()
    if args.quick:
        args.B, args.T = min(args.B, 4), min(args.T, 64)
    reps = args.reps or (3 if args.quick else 9)
    setup_torch(args.threads)
    warnings.filterwarnings("ignore", message=".*loss_type.*")
    warnings.filterwarnings("ignore", message=".*performance drop.*")  # sdpa batching rule

    model = gpt2(args.layers, args.embd, args.vocab, args.T)
    ids = torch.randint(0, args.vocab, (args.B, args.T))
    cfg = ProjectionConfig(dim=args.k)
    cap = GradientCapture(model, CaptureConfig(projection=cfg))
    projector = Projector(cfg)
    out: dict = {}

    def plain():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    def ours():
        plain()
        out["a"] = cap.pop()

    cap.attach()
    ours()
    layers = list(out["a"].layers)
    cap.detach()

    def baseline():
        out["b"] = vmap_projected(model, ids, layers, projector, args.chunk)

    variants = [Variant("(a) dattri-ds capture+proj", ours, setup=cap.attach,
                        teardown=cap.detach),
                Variant("(b) vmap(grad)+proj", baseline),
                Variant("(c) plain fwd+bwd", plain)]
    a, b, c = (v.name for v in variants)

    print(f"throughput: GPT-2 {args.layers}L d={args.embd} V={args.vocab} "
          f"({n_params(model) / 1e6:.2f}M params), B={args.B} T={args.T}, kron k={args.k}, "
          f"{len(layers)} captured layers")
    print(environment())
    t0 = time.perf_counter()
    times = interleaved(variants, reps=reps, warmup=1)
    wall = time.perf_counter() - t0

    # fidelity: same projected vectors from (a) and (b)
    ya = {n: lg.data.values for n, lg in out["a"].layers.items()}
    yb = out["b"]
    errs = {n: rel_err(ya[n], yb[n]) for n in layers}
    worst = max(errs, key=errs.__getitem__)
    total = rel_err(torch.cat([ya[n] for n in layers], 1), torch.cat([yb[n] for n in layers], 1))

    rows = []
    for v in variants:
        t = median(times[v.name])
        lo, hi = spread(times[v.name])
        rows.append((v.name, t * 1e3, f"{lo * 1e3:.0f}-{hi * 1e3:.0f}", args.B / t,
                     paired_ratio(times, v.name, a)))
    print(f"{reps} rounds in {wall:.1f}s\n")
    print(table(["variant", "median ms/batch", "p25-p75", "examples/s", "time x (a)"], rows))
    print(f"\nfidelity (a) vs (b): relative error all layers {total:.2e}, worst layer "
          f"{worst} {errs[worst]:.2e}")

    speedup = paired_ratio(times, b, a)  # throughput(a) / throughput(b)
    vs_plain = paired_ratio(times, a, c)
    ok1 = "PASS" if speedup >= TARGET_VS_VMAP else "FAIL"
    ok2 = "PASS" if vs_plain <= TARGET_VS_PLAIN else "FAIL"
    print(f"\nSUMMARY throughput: dattri-ds {args.B / median(times[a]):.1f} ex/s = "
          f"{speedup:.2f}x vmap baseline (target >= {TARGET_VS_VMAP}x) {ok1}; time = "
          f"{vs_plain:.3f}x plain fwd+bwd (target <= {TARGET_VS_PLAIN}x) {ok2}; "
          f"vmap baseline = {paired_ratio(times, b, c):.3f}x plain; fidelity rel err "
          f"{total:.1e} [B={args.B} T={args.T}, {reps} rounds]")


if __name__ == "__main__":
    main()
