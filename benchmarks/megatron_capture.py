"""Megatron TP=2 on CPU: capture+projection step time over a plain step, and bytes reduced.

Model: Megatron-core GPTModel (``build_gpt``: local spec with torch norms; by default the
size of benchmarks/capture_overhead.py: 4 layers, hidden 256, 4 heads, ffn 1024, vocab
1024), S=128, B=16, tensor-parallel size 2 on 2 gloo processes (forked), token-mean loss;
``--sequence-parallel`` adds Megatron sequence parallelism.
Variants, timed interleaved in the same rounds (median of per-round ratios):

* ``plain``: forward + backward of the TP=2 model.
* ``capture+proj``: the same under ``megatron_capture`` with a Kronecker projection
  (``dim=256`` per layer); sharded layers reduce their ``[B, P]`` partial projections over
  the tensor-parallel group before ``backward()`` returns, so it is inside the timing.

Communication (counted by wrapping the reductions, per rank): bytes all-reduced per
captured step (projections), and for one selection score ``cross_gram(candidates,
target)`` (``[B, 1]`` partial scores, one reduction for all sharded layers), next to the
size of one layer's per-example gradients (what a naive "gather the gradients" would move).

Run: ``.venv/bin/python benchmarks/megatron_capture.py [--quick] [--sequence-parallel]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
import warnings

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(tp: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dattri_ds.models.megatron_gpt import cpu_workarounds

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    cpu_workarounds()


def _model(args):
    from dattri_ds.models.megatron_gpt import build_gpt
    from dattri_ds.launch.megatron_backend import transformer_kwargs

    kw, _ = transformer_kwargs({"model_type": "gpt2", "n_layer": args.layers,
                                "n_embd": args.hidden, "n_head": 4}, 2, args.sequence_parallel)
    return build_gpt(kw, args.vocab, args.seq, seed=0)


class _Counter:
    """Bytes passed to the shard reductions of dattri_ds.ops.inner (per rank)."""

    def __init__(self):
        import dattri_ds.ops.space as inner

        self.inner, self.bytes, self.calls = inner, 0, 0
        self._orig = inner.all_reduce_sum

        def counted(t, group=None, world=1):
            self.bytes += t.numel() * t.element_size()
            self.calls += 1
            return self._orig(t, group, world)
        inner.all_reduce_sum = counted

    def reset(self) -> None:
        self.bytes, self.calls = 0, 0


def _worker(rank, port, args, q):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        _setup(2)
        from dattri_ds import CaptureConfig, ProjectionConfig
        from dattri_ds.integrations.megatron import megatron_capture
        from dattri_ds.ops import cross_gram, grad_sum
        from dattri_ds.gradient import GradBatch

        model = _model(args)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        pos = torch.arange(args.seq).expand(args.batch, args.seq)
        mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), 1)

        def step():
            model(ids, pos, mask, labels=ids).mean().backward()
            model.zero_grad(set_to_none=True)

        counter = _Counter()
        proj = CaptureConfig(label_shift=0, projection=ProjectionConfig(dim=args.dim))
        cap = megatron_capture(model, proj)
        variants = {"plain": step, "capture+proj": step}
        times = {k: [] for k in variants}
        for r in range(args.reps + 1):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                if name == "capture+proj":
                    cap.attach()
                t0 = time.perf_counter()
                variants[name]()
                dt = time.perf_counter() - t0
                if name == "capture+proj":
                    cap.drain()
                    cap.detach()
                if r > 0:  # round 0 warms up
                    times[name].append(dt)
        counter.reset()
        with cap:
            step()
            cap.drain()
        proj_bytes, proj_calls = counter.bytes, counter.calls

        factors = megatron_capture(model, CaptureConfig(label_shift=0))
        with factors:
            step()
            batch = factors.pop()
        target = GradBatch(-1, ("t",), {n: grad_sum(lg) for n, lg in batch.layers.items()})
        counter.reset()
        cross_gram(batch, target)
        score_bytes, score_calls = counter.bytes, counter.calls
        fc1 = batch.layers["decoder.layers.0.mlp.linear_fc1"]
        o, i = fc1.shard.full_shape
        layer_bytes = args.batch * o * i * 4
        ratios = [a / b for a, b in zip(times["capture+proj"], times["plain"])]
        q.put((rank, dict(plain=statistics.median(times["plain"]),
                          capture=statistics.median(times["capture+proj"]),
                          ratio=statistics.median(ratios), proj_bytes=proj_bytes,
                          proj_calls=proj_calls, score_bytes=score_bytes,
                          score_calls=score_calls, layer_bytes=layer_bytes,
                          layers=len(batch.layers),
                          sharded=sum(lg.shard is not None for lg in batch.layers.values()))))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        import traceback

        q.put((rank, traceback.format_exc()))
        raise SystemExit(1) from e


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, 3 rounds")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--sequence-parallel", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.reps, args.layers, args.hidden, args.vocab, args.seq, args.batch = \
            3, 2, 64, 256, 32, 4
    import megatron.core  # noqa: F401  (import once in the parent: forked workers start fast)

    ctx = mp.get_context("fork")
    q, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    res = dict(q.get(timeout=900) for _ in procs)
    for pr in procs:
        pr.join()
    for r, v in res.items():
        if isinstance(v, str):
            raise SystemExit(f"rank {r} failed:\n{v}")
    m = res[0]
    print(f"GPTModel TP=2{' sequence-parallel' if args.sequence_parallel else ''} CPU: "
          f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, S={args.seq}, "
          f"B={args.batch}, Kronecker dim {args.dim}, {m['layers']} layers captured "
          f"({m['sharded']} sharded), {args.reps} rounds")
    print(f"{'plain step':<34}{m['plain'] * 1e3:10.1f} ms")
    print(f"{'capture+projection step':<34}{m['capture'] * 1e3:10.1f} ms")
    print(f"{'ratio (median of paired rounds)':<34}{m['ratio']:10.2f} x")
    print(f"{'projection reduction / step':<34}{m['proj_bytes']:10d} B in {m['proj_calls']} "
          f"all-reduce(s)")
    print(f"{'score reduction (cross_gram)':<34}{m['score_bytes']:10d} B in {m['score_calls']} "
          f"all-reduce(s)")
    print(f"{'one layer per-example grads (fc1)':<34}{m['layer_bytes']:10d} B "
          f"({m['layer_bytes'] / max(1, m['score_bytes']):.0f}x the score reduction)")


if __name__ == "__main__":
    main()
