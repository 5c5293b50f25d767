"""Where a selection step's time goes, and its ratio to a plain step (1 process or ZeRO-3).

    python benchmarks/selection_step.py [--world 2] [--steps 20] [--quick] [--set top_blocks=1]

Two models from the same init are trained side by side, one optimizer step each in turn
(same trained micro-batch size): *plain* (forward, backward, optimizer step on ``micro``
random examples) and *selection* (the default ``SelectionConfig`` unless ``--set`` changes
it: ``2 * micro`` candidates, a validation target of ``--target-docs`` texts refreshed
every ``refresh_every`` steps, then the training step on the chosen). ``--world 1`` uses a
plain torch model + AdamW; ``--world 2`` two gloo ranks of DeepSpeed ZeRO-3 (AdamW).

CPU seconds (``time.process_time``, one thread per rank) are split into exclusive phases:
target refresh (its own probe passes included), probe forward, probe backward (+ building
the per-example factors), scoring, policy (+ bookkeeping), training forward (none when the
candidates' forward is reused), training backward, optimizer step.
Prints per-phase CPU-s per step and the selection/plain ratio (paired per step, median),
rank 0's view (ranks do the same work).
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import base_parser, environment, table  # noqa: E402

PHASES = ("target refresh", "probe forward", "probe backward", "scoring", "policy",
          "train forward", "train backward", "optimizer step")


class PhaseClock:
    """Exclusive CPU seconds per phase: nested phases are charged to the innermost one."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._t = time.process_time()

    def _switch(self) -> None:
        now = time.process_time()
        if self._stack:
            self.total[self._stack[-1]] += now - self._t
        self._t = now

    def wrap(self, phase: str, fn):
        def timed(*a, **kw):
            self._switch()
            # the target refresh's own probe passes belong to the refresh
            refresh = bool(self._stack) and self._stack[-1] == "target refresh"
            self._stack.append("target refresh" if refresh else phase)
            try:
                return fn(*a, **kw)
            finally:
                self._switch()
                self._stack.pop()
        return timed

    def take(self) -> dict[str, float]:
        out, self.total = dict(self.total), defaultdict(float)
        return out


def _coerce(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


def _instrument(selector, clock: PhaseClock) -> None:
    """Wrap the selector's parts (instance attributes only: nothing global is patched)."""
    probe = selector.probe
    target = selector.target
    inner = getattr(target, "inner", target)  # PreconditionedTarget wraps the provider
    inner._compute = clock.wrap("target refresh", inner._compute)
    raw_probe = probe.probe

    def probe_timed(forward, **kw):
        return raw_probe(clock.wrap("probe forward", forward), **kw)
    probe.probe = clock.wrap("probe backward", probe_timed)
    selector._against = clock.wrap("scoring", selector._against)
    selector.select = clock.wrap("policy", selector.select)


def _worker(rank: int, world: int, port: int, args, q) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from benchmarks._common import gpt2
    from dattri_ds.distributed import ParallelContext
    from dattri_ds.selection import OnlineSelector, SelectionConfig

    k, T, V = args.micro, args.T, args.vocab
    overrides = {kv.split("=", 1)[0]: _coerce(kv.split("=", 1)[1]) for kv in args.set}
    scfg = SelectionConfig.from_dict({"enabled": True, "candidate_multiple": 2.0,
                                      **overrides})

    def build():
        m = gpt2(args.layers, args.width, V, T, seed=0)
        m.train()
        return m

    if world == 1:
        models = [build(), build()]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]

        def trainer(i):
            m, opt = models[i], opts[i]

            def backward(loss):
                loss.backward()

            def step():
                opt.step()
                opt.zero_grad(set_to_none=True)
            return m, m, backward, step, opt
        ctx = ParallelContext()
    else:
        import importlib
        import logging

        import deepspeed
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        deepspeed.init_distributed(dist_backend="gloo")
        cfg = {"train_micro_batch_size_per_gpu": k, "steps_per_print": 10**9,
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
        engines = []
        for _ in range(2):
            m = build()
            engines.append(deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                                config=cfg)[0])

        def trainer(i):
            e = engines[i]
            return e, e.module, e.backward, e.step, e.optimizer
        ctx = ParallelContext.from_default_group()

    clock = PhaseClock()
    gen = torch.Generator().manual_seed(1000 + rank)
    tgt = torch.randint(0, V, (args.target_docs, T), generator=torch.Generator().manual_seed(7))
    _, sel_module, _, _, sel_opt = trainer(1)
    selector = OnlineSelector.for_target_data(sel_module, scfg,
                                              {"input_ids": tgt, "labels": tgt}, ctx=ctx,
                                              optimizer=sel_opt)
    _instrument(selector, clock)

    def one_step(i, step):
        call, _, backward, opt_step, _ = trainer(i)
        n = k if i == 0 else selector.num_candidates(k)
        ids = torch.randint(0, V, (n, T), generator=gen)
        batch = {"input_ids": ids, "labels": ids}
        reused = None
        if i == 1:
            sel = selector.select(batch, k, step, train_loss=True)
            batch, reused = sel.batch, sel.loss
        loss = reused if reused is not None else \
            clock.wrap("train forward", lambda: call(**batch).loss)()
        clock.wrap("train backward", backward)(loss)
        clock.wrap("optimizer step", opt_step)()

    per_step: list[tuple[dict, dict]] = []
    for step in range(args.warmup + args.steps):
        got = []
        for i in ((0, 1) if step % 2 == 0 else (1, 0)):
            if world > 1:
                torch.distributed.barrier()
            clock.take()
            one_step(i, step)
            got.append((i, clock.take()))
        if step >= args.warmup:
            per_step.append(tuple(d for _, d in sorted(got)))
    selector.close()
    plan = selector.plan
    q.put((rank, per_step, f"selection/stepcost.py predicts {plan.ratio():.2f}x (floor of this "
                           f"path {plan.bound():.2f}x): {plan.units()}"))


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--world", type=int, default=1, choices=(1, 2))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--target-docs", type=int, default=64,
                   help="target texts (SelectionConfig.target_max_docs' default: 64)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--set", action="append", default=[],
                   help="SelectionConfig override KEY=VALUE (repeatable)")
    args = p.parse_args()
    if args.quick:
        args.layers, args.width, args.vocab, args.T, args.micro = 2, 64, 512, 32, 4
        args.target_docs, args.steps = 16, 6
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, q))
             for r in range(args.world)]
    for pr in procs:
        pr.start()
    results = {}
    while len(results) < len(procs):
        try:
            r, steps, note = q.get(timeout=10)
            results[r] = (steps, note)
        except queue.Empty:
            if any(pr.exitcode not in (None, 0) for pr in procs):
                for pr in procs:
                    pr.kill()
                raise SystemExit("a benchmark rank failed (traceback above)") from None
    for pr in procs:
        pr.join()
    steps, note = results[0]
    mode = "plain torch + AdamW, 1 process" if args.world == 1 else "ZeRO-3, 2 gloo ranks"
    multiple = dict(kv.split("=", 1) for kv in args.set).get(
        "candidate_multiple", "2")  # the benchmark's own default (scfg below)
    print(f"{mode}; GPT-2 {args.layers}x{args.width}, vocab {args.vocab}, T={args.T}, "
          f"micro-batch {args.micro}, {multiple}x candidates, {args.target_docs} target docs, "
          f"selection overrides {args.set or 'none (defaults)'}; {args.steps} steps; "
          f"{environment()}")
    if note:
        print(note)
    plain = [sum(a.values()) for a, _ in steps]
    sel = [sum(b.values()) for _, b in steps]
    rows = []
    for ph in PHASES:
        a = statistics.mean(s[0].get(ph, 0.0) for s in steps)
        b = statistics.mean(s[1].get(ph, 0.0) for s in steps)
        rows.append([ph, a * 1e3, b * 1e3, b / statistics.mean(plain)])
    rows.append(["total", statistics.mean(plain) * 1e3, statistics.mean(sel) * 1e3,
                 statistics.mean(sel) / statistics.mean(plain)])
    print(table(["phase", "plain CPU-ms/step", "selection CPU-ms/step", "x plain step"], rows))
    ratio_mean = statistics.mean(sel) / statistics.mean(plain)
    ratio_med = statistics.median(b / a for a, b in zip(plain, sel))
    print(f"selection step / plain step (CPU s, mean over steps incl. refreshes): "
          f"{ratio_mean:.2f}x; median paired per step: {ratio_med:.2f}x (goal <= 1.5x)")
    print(json.dumps({"ratio_mean": ratio_mean, "ratio_median": ratio_med}))


if __name__ == "__main__":
    main()
