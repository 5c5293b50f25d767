"""ZeRO-3, 2 gloo ranks: step time with capture+projection, and with online selection, vs plain.

    python benchmarks/zero3_step.py [--quick] [--reps 7]

Three DeepSpeed engines are built from the same init on every rank and stepped side by side
in rotating order (one round = one optimizer step of each), same trained micro-batch size:

* plain:     the engine's forward/backward/step;
* capture:   the same with GradientCapture.for_engine + Kronecker projection (k per layer),
             projected batches handed to a callback (no disk);
* selection: online selection with ``candidate_multiple`` 2 (probe pass on 2x candidates,
             scores against a validation-target gradient, top-k, training on the chosen).

Prints per-round medians and paired ratios (targets: capture <= 1.15x, selection <= 1.5x).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import base_parser, environment, median, spread, table  # noqa: E402


def _worker(rank, world, port, args, q):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import importlib
    import logging

    import deepspeed
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    from benchmarks._common import gpt2
    from dattri_ds import CaptureConfig, GradientCapture, ProjectionConfig, TrainingCallback
    from dattri_ds.distributed import ParallelContext
    from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget

    k, T = args.micro, args.T
    cfg = {"train_micro_batch_size_per_gpu": k, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}

    def engine():
        m = gpt2(args.layers, args.width, args.vocab, T, seed=0)
        m.train()
        return deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]

    plain, cap_eng, sel_eng = engine(), engine(), engine()

    class Drop(TrainingCallback):
        def on_batch(self, batch):
            self.last = batch

    cap = GradientCapture.for_engine(cap_eng, CaptureConfig(
        projection=ProjectionConfig(dim=args.k)), callbacks=[Drop()]).attach()
    scfg = SelectionConfig(
        enabled=True, score="alignment", candidate_multiple=2.0, refresh_every=10**6,
        projection=ProjectionConfig(dim=args.sel_k) if args.sel_k else None,
        include=tuple(args.sel_include.split(",")) if args.sel_include else ())
    probe = OnlineSelector.probe_capture(sel_eng.module, scfg)
    gen = torch.Generator().manual_seed(rank)
    tgt = torch.randint(0, args.vocab, (8, T), generator=gen)
    ctx = ParallelContext.from_default_group()
    target = ValidationTarget(probe, lambda b: sel_eng.module(**b).loss,
                              {"input_ids": tgt, "labels": tgt}, ctx=ctx)
    selector = OnlineSelector(sel_eng.module, scfg, target, probe=probe, ctx=ctx)
    target.get(0)  # computed once up front (refresh cost is amortized over refresh_every)

    def step(eng, n):
        ids = torch.randint(0, args.vocab, (n, T), generator=gen)
        return {"input_ids": ids, "labels": ids}

    def run_plain():
        b = step(plain, k)
        plain.backward(plain(**b).loss)
        plain.step()

    def run_capture():
        b = step(cap_eng, k)
        cap_eng.backward(cap_eng(**b).loss)
        cap_eng.step()

    def run_selection():
        b = selector.select(step(sel_eng, 2 * k), k, 0).batch
        sel_eng.backward(sel_eng(**b).loss)
        sel_eng.step()

    variants = [("plain", run_plain), ("capture", run_capture), ("selection", run_selection)]
    for _, fn in variants:  # warm-up
        fn()
    times = {n: [] for n, _ in variants}
    for r in range(args.reps):
        for j in range(len(variants)):
            name, fn = variants[(r + j) % len(variants)]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn()
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - t0)
    cap.detach()
    selector.close()
    q.put((rank, times))


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--sel-k", type=int, default=0,
                   help="score selection in a Kronecker-projected space of this size "
                        "(0 = exact ghost scores)")
    p.add_argument("--sel-include", default="",
                   help="comma-separated module patterns scored (default: every layer)")
    args = p.parse_args()
    if args.quick:
        args.layers, args.width, args.vocab, args.T, args.micro, args.k = 2, 64, 512, 32, 4, 256
    args.reps = args.reps or (3 if args.quick else 7)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    results = dict(q.get(timeout=3600) for _ in procs)
    for pr in procs:
        pr.join()
    times = results[0]
    print(f"ZeRO-3, 2 ranks, GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, T={args.T}, "
          f"micro-batch {args.micro}/rank, k={args.k}; selection scores: "
          f"{'projected k=' + str(args.sel_k) if args.sel_k else 'exact'}"
          f"{', layers ' + args.sel_include if args.sel_include else ', all layers'}; "
          f"{environment()}")
    rows = [[n, median(v) * 1e3, *[x * 1e3 for x in spread(v)]] for n, v in times.items()]
    print(table(["variant", "median ms/step", "p25", "p75"], rows))
    ratio = {n: median([a / b for a, b in zip(times[n], times["plain"])])
             for n in ("capture", "selection")}
    print(f"capture+projection / plain: {ratio['capture']:.2f}x (target <= 1.15x)")
    print(f"selection (2x candidates) / plain: {ratio['selection']:.2f}x (target <= 1.5x)")
    print(json.dumps({"capture_ratio": ratio["capture"], "selection_ratio": ratio["selection"]}))


if __name__ == "__main__":
    main()
