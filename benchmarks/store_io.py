"""Gradient store I/O: write throughput, and scoring from the store vs a plain memmap read.

    python benchmarks/store_io.py [--quick] [--rows 20000] [--layers 8] [--k 256]

Writes ``rows`` projected examples (``layers`` x ``k`` floats each) through
GradientStoreWriter (fsync'd commits) and reports MB/s. Then, side by side and interleaved:
(a) train x query dot products streamed from the store (GradientStore.iter_blocks + matmul,
checksums verified on first read) and (b) a plain ``np.memmap`` read of the same bytes with
the same matmul. Target: (a) runs at >= 50% of (b)'s rate. Page cache is warm for both.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import base_parser, environment, median, setup_torch, table  # noqa: E402


def _batch(b: int, layers: int, k: int, start: int, proj_tag: str):
    from dattri_ds import Dense, GradBatch, LayerGrad
    from dattri_ds.layers import get_kind
    gen = torch.Generator().manual_seed(start)
    lg = {f"l{i}": LayerGrad(f"l{i}", get_kind("linear"), Dense(torch.randn(b, k, generator=gen)),
                             (64, 64), space=proj_tag) for i in range(layers)}
    return GradBatch(0, tuple(f"ex{start + j}" for j in range(b)), lg)


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--queries", type=int, default=16)
    args = p.parse_args()
    if args.quick:
        args.rows, args.layers, args.k = 2000, 4, 128
    setup_torch(args.threads)
    from dattri_ds import ProjectionConfig
    from dattri_ds.store import GradientStore, GradientStoreWriter, StoreConfig, StoreSpec

    proj = ProjectionConfig(dim=args.k)
    tmp = tempfile.mkdtemp(prefix="dattri-store-bench-")
    first = _batch(256, args.layers, args.k, 0, proj.tag)
    spec = StoreSpec.from_batch(first, projection=proj, fingerprint="bench")
    t0 = time.perf_counter()
    with GradientStoreWriter(StoreConfig(path=tmp, flush_every=4096), spec) as w:
        for start in range(0, args.rows, 256):
            w.append(_batch(min(256, args.rows - start), args.layers, args.k, start, proj.tag))
    write_s = time.perf_counter() - t0
    nbytes = args.rows * args.layers * args.k * 4
    q = torch.randn(args.layers * args.k, args.queries)
    data_file = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".data"))

    def from_store(verify="lazy"):
        with GradientStore.open(tmp, verify=verify) as s:
            for _, block in s.iter_blocks(4096):
                block @ q

    def unverified():
        from_store("off")

    def plain():
        m = np.memmap(data_file, dtype=np.float32, mode="r",
                      shape=(args.rows, args.layers * args.k))
        for start in range(0, args.rows, 4096):
            torch.from_numpy(np.ascontiguousarray(m[start:start + 4096])) @ q

    from_store(), plain()  # warm the page cache
    reps = args.reps or 5
    variants = [("store", from_store), ("store, verify off", unverified), ("memmap", plain)]
    times = {n: [] for n, _ in variants}
    for r in range(reps):
        for name, fn in variants[r % 3:] + variants[:r % 3]:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ratio = median([b / a for a, b in zip(times["store"], times["memmap"])])
    ratio_off = median([b / a for a, b in zip(times["store, verify off"], times["memmap"])])
    print(f"{args.rows} rows x {args.layers * args.k} floats ({nbytes / 1e6:.0f} MB); "
          f"{environment()}")
    print(f"write (fsync'd commits of 4096 rows): {nbytes / 1e6 / write_s:.0f} MB/s")
    print(table(["reader", "median s", "MB/s", "pairs/s"],
                [[n, median(v), nbytes / 1e6 / median(v), args.rows * args.queries / median(v)]
                 for n, v in times.items()]))
    print(f"store scoring rate / plain memmap rate: {ratio:.2f} with CRC verification on "
          f"first read, {ratio_off:.2f} without (target >= 0.5)")


if __name__ == "__main__":
    main()
