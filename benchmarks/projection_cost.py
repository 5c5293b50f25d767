"""What the default projection costs in ``collect``, against Kronecker at the same k, plain and
whitened, side by side in one run.

    python benchmarks/projection_cost.py [--widths 128 512 1024] [--reps 3] [--quick]

For each width a random-init GPT-2 (``--layers`` blocks, vocabulary ``--vocab``, untied head;
the main job's is 4 x 128 with a 1024-token vocabulary) collects ``--rows`` rows of ``--T``
tokens in batches of ``--B`` through the library (``dattri_ds.collect(model, batches,
CaptureConfig(projection=...))``) with:

* ``exact``: no projection (the capture floor every variant pays: forward and backward);
* ``kron``: ``ProjectionConfig(kind="kronecker", dim=k)``;
* ``auto``: ``ProjectionConfig(dim=k)``, the default (sparse JL where the cost model keeps it,
  Kronecker on layers where sparse costs more than ``kron_speedup`` times as much);
* ``kron+w`` / ``auto+w``: the same, on rows whitened by EK-FAC factors fitted on the same
  batches (``CaptureConfig(whiten="ekfac")``, the main job's recipe for ``auto+w``).

CPU seconds (``time.process_time``) with one thread (``--threads``): steadier than wall time
on a shared machine. One warm-up round (it draws the seeded matrices, kept for the process);
then ``--reps`` rounds, each variant once in an order that rotates from round to round.
Printed: best and median CPU-s per variant and the per-round (paired) median ratios against
``kron`` and, for whitened rows, against the plain rows of the same projection.

``--check``: instead of timing, the largest difference between the rows ``auto`` stores for
each sparse layer (plain and whitened) and the same sketch computed as it was before the
CSR kernel (commit 0eb5305: materialized rows, every column's ``s`` products scattered into
``[B, k]``): the sketch is the same linear map, so only float rounding differs.

``--floor``: instead, what a faster kernel of the same map could at best reach. Per width,
over every layer ``auto`` keeps sparse, the CPU-s of the current projection (``now``), of
the Kronecker projection of the same layers (``kron``), and of the two steps the sparse map
cannot skip: materializing the rows (``materialize``: the cheaper of one batched product per
layer and one per seeded column block) and the CSR products (``csr``: each block's product
with one cached ``[BLOCK, B]`` operand, so only the matrices stream; no transposes; matrices
drawn). ``best auto/kron`` is the ratio of ``collect`` if the sparse layers cost only
``materialize + csr``: ``(kron collect - kron + materialize + csr) / kron collect``. And
``fft``: the two real FFTs of size k per token that a TensorSketch of the same k (a sketch
applied to the factors, no materialization) needs for the same layers, at least.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import base_parser, environment, gpt2, setup_torch, table  # noqa: E402


_FLOOR = ["width", "kron collect", "kron", "now", "materialize", "csr", "fft", "now auto/kron",
          "best auto/kron"]


def _batches(vocab: int, rows: int, b: int, t: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max(1, rows // b)):
        ids = torch.randint(0, vocab, (b, t), generator=gen)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _variants(model, batches, k: int):
    """``{name: () -> None}``: one collect each (the rows are consumed and dropped)."""
    import dattri_ds
    from dattri_ds import CaptureConfig, KFACConfig, ProjectionConfig
    from dattri_ds.methods.curvature import fit_factors

    exact = CaptureConfig()
    factors = fit_factors(list(dattri_ds.collect(model, batches, exact)), config=KFACConfig())
    kron, auto = ProjectionConfig(kind="kronecker", dim=k), ProjectionConfig(dim=k)
    configs = {"exact": (exact, None),
               "kron": (CaptureConfig(projection=kron), None),
               "auto": (CaptureConfig(projection=auto), None),
               "kron+w": (CaptureConfig(projection=kron, whiten="ekfac"), factors),
               "auto+w": (CaptureConfig(projection=auto, whiten="ekfac"), factors)}

    def run(cfg, facs):
        return lambda: [None for _ in dattri_ds.collect(model, batches, cfg, factors=facs)]
    return {n: run(c, f) for n, (c, f) in configs.items()}


def measure(fns: dict, reps: int) -> dict[str, list[float]]:
    """CPU-s per round of every variant (one untimed warm-up round, rotating order)."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for j in range(len(names)):
            n = names[(r + j) % len(names)]
            t0 = time.process_time()
            fns[n]()
            times[n].append(time.process_time() - t0)
    return times


def _paired(times: dict[str, list[float]], num: str, den: str) -> float:
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def _choices(model, k: int, batches) -> str:
    """How ``auto`` resolves the model's layers: ``kind: count`` (identity = kept exactly)."""
    import dattri_ds
    from dattri_ds import CaptureConfig, ProjectionConfig
    from dattri_ds.ops.projection import Projector

    proj = Projector(ProjectionConfig(dim=k))
    got = next(dattri_ds.collect(model, batches[:1], CaptureConfig()))
    kinds: dict[str, int] = {}
    for lg in got.layers.values():
        o, i = lg.shape
        name = "identity" if o * i <= k else proj.kind_of(o, i)
        kinds[name] = kinds.get(name, 0) + 1
    return ", ".join(f"{n}: {c}" for n, c in sorted(kinds.items()))


def _column_scatter(proj, layer: str, x: torch.Tensor, rows: int) -> torch.Tensor:
    """The sparse sketch as computed at commit 0eb5305 (``Projector.apply_at``, no index)."""
    from dattri_ds.ops import projection

    out = x.new_zeros(x.shape[0], rows)
    for blk, start in enumerate(range(0, x.shape[1], projection.BLOCK)):
        idx, val = proj.sparse_block(layer, blk, rows, min(projection.BLOCK, x.shape[1] - start),
                                     x.device, x.dtype)
        contrib = x[:, start:start + idx.shape[0]].unsqueeze(-1) * val
        out.index_add_(1, idx.reshape(-1), contrib.reshape(x.shape[0], -1))
    return out


def check(model, batches, k: int) -> list[list[object]]:
    """Per recipe: sparse layers, max |new - old|, max |old| over the batches' rows."""
    import dattri_ds
    from dattri_ds import CaptureConfig, KFACConfig, ProjectionConfig
    from dattri_ds.methods.curvature import fit_factors
    from dattri_ds.ops.projection import Projector
    from dattri_ds.ops.space import project

    exact = list(dattri_ds.collect(model, batches, CaptureConfig()))
    factors = fit_factors(exact, config=KFACConfig())
    proj = Projector(ProjectionConfig(dim=k))
    out = []
    for recipe, rows_of in (("auto", lambda b: b),
                            ("auto+w", lambda b: factors.whiten(b, method="ekfac"))):
        n, diff, scale = 0, 0.0, 0.0
        for batch in exact:
            for lg in rows_of(batch).layers.values():
                o, i = lg.shape
                if o * i <= k or proj.kind_of(o, i) != "sparse":
                    continue
                new = project(lg, proj).data.values
                old = _column_scatter(proj, lg.name, lg.kind.rows(lg.data, lg.shape), k)
                n += 1
                diff = max(diff, float((new - old).abs().max()))
                scale = max(scale, float(old.abs().max()))
        out.append([recipe, n, diff, scale, diff / scale if scale else 0.0])
    return out


def _median_cpu(fn, reps: int) -> float:
    """Median CPU-s of ``fn()`` over ``reps`` calls after one untimed call."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return statistics.median(out)


def floor(model, batches, k: int, reps: int) -> list[object]:
    """CPU-s over the batches of the layers ``auto`` keeps sparse: now, Kronecker, the
    materialization and CSR products a same-map kernel cannot skip; the best ratio."""
    import dattri_ds
    from dattri_ds import CaptureConfig, ProjectionConfig
    from dattri_ds.ops import projection
    from dattri_ds.ops.projection import Projector
    from dattri_ds.ops.space import project

    exact = list(dattri_ds.collect(model, batches, CaptureConfig()))
    auto = Projector(ProjectionConfig(dim=k))
    kron = Projector(ProjectionConfig(kind="kronecker", dim=k))
    layers = [lg for b in exact for lg in b.layers.values()
              if lg.shape[0] * lg.shape[1] > k and auto.kind_of(*lg.shape) == "sparse"]

    operand = torch.randn(projection.BLOCK, batches[0]["input_ids"].shape[0])

    def csr_products(lg):
        d = lg.shape[0] * lg.shape[1]
        for start in range(0, d, projection.BLOCK):
            cols = min(projection.BLOCK, d - start)
            m = auto.sparse_csr(lg.name, start // projection.BLOCK, k, cols, operand.device)
            torch.sparse.mm(m, operand[:cols])

    def ffts(lg):
        for side in (lg.data.g, lg.data.g):  # the two sides' count sketches, length k
            torch.fft.rfft(side.new_zeros(side.shape[0] * side.shape[1], k))

    def by_block(lg):  # one block's columns at a time (the cheaper layout at width 512)
        f, d = lg.kind.f32(lg.data), lg.shape[0] * lg.shape[1]
        for start in range(0, d, projection.BLOCK):
            lg.kind.materialize_columns(f, lg.shape, start, min(d, start + projection.BLOCK))
    parts = {"now": lambda: [project(lg, auto) for lg in layers],
             "kron": lambda: [project(lg, kron) for lg in layers],
             "whole": lambda: [lg.kind.rows(lg.data, lg.shape) for lg in layers],
             "by block": lambda: [by_block(lg) for lg in layers],
             "csr": lambda: [csr_products(lg) for lg in layers],
             "fft": lambda: [ffts(lg) for lg in layers]}
    t = {n: _median_cpu(fn, reps) for n, fn in parts.items()}
    t["materialize"] = min(t["whole"], t["by block"])
    collect_kron = _median_cpu(lambda: [None for _ in dattri_ds.collect(
        model, batches, CaptureConfig(projection=ProjectionConfig(kind="kronecker", dim=k)))],
        reps)
    base = collect_kron - t["kron"]
    return [collect_kron, t["kron"], t["now"], t["materialize"], t["csr"], t["fft"],
            (base + t["now"]) / collect_kron,
            (base + t["materialize"] + t["csr"]) / collect_kron]


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--widths", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--B", type=int, default=16)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--check", action="store_true",
                   help="compare the stored rows with the pre-CSR sketch instead of timing")
    p.add_argument("--floor", action="store_true",
                   help="time the steps a same-map kernel cannot skip instead (module doc)")
    args = p.parse_args()
    if args.quick:
        args.widths, args.rows, args.reps = [128], 16, args.reps or 2
    reps = args.reps or 3
    setup_torch(args.threads)
    print(f"# projection_cost: {environment()}")
    print(f"# {args.layers} blocks, vocab {args.vocab}, {args.rows} rows x T={args.T}, "
          f"batches of {args.B}, k={args.k}, {reps} rounds after a warm-up; CPU-s")
    rows = []
    for w in args.widths:
        model = gpt2(args.layers, w, args.vocab, args.T).eval()
        batches = _batches(args.vocab, args.rows, args.B, args.T, seed=w)
        print(f"width {w}: auto resolves to {_choices(model, args.k, batches)}", flush=True)
        if args.check:
            print(table(["recipe", "sparse layers x batches", "max |new - old|", "max |old|",
                         "relative"], check(model, batches, args.k)), flush=True)
            continue
        if args.floor:
            rows.append([w] + floor(model, batches, args.k, reps))
            print(table(_FLOOR, rows[-1:]), flush=True)
            continue
        times = measure(_variants(model, batches, args.k), reps)
        for n, ts in times.items():
            plain = n.removesuffix("+w")
            rows.append([w, n, min(ts), statistics.median(ts),
                         _paired(times, n, "kron"),
                         _paired(times, n, plain) if n != plain else "",
                         _paired(times, n, "exact")])
        print(table(["width", "rows", "best CPU-s", "median", "vs kron", "vs plain",
                     "vs exact"], rows[-len(times):]), flush=True)
    if rows and args.floor:
        print()
        print(table(_FLOOR, rows))
    elif rows:
        print()
        print(table(["width", "rows", "best CPU-s", "median", "vs kron", "vs plain",
                     "vs exact"], rows))


if __name__ == "__main__":
    main()
