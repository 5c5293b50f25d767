"""Scale: the >= 1B ZeRO-3 run on CPU, and the planner checked against measured runs.

    python benchmarks/scale.py large  [--out runs/scale1b]   # >= 1B: train 5 steps, then collect
    python benchmarks/scale.py ladder [--sizes 10m,50m,200m] # planner vs measured, 3 sizes
    python benchmarks/scale.py paper                         # the planner on 110B, 4x H200

Not part of CI (the large run takes 30-60 minutes on 2 shared cores and about 13 GB).

Every run here is 2 gloo ranks of DeepSpeed ZeRO-3 driven through the project's own entry
points: ``launch/train.py``'s ``main`` (``--capture --online-selection``) for training, and
``tools/collect.py``'s ``collect_checkpoint`` on the ZeRO-3 engine restored from the run's
checkpoint by ``engine.load_checkpoint`` (each rank holds half the weights; the stock
``dattri-ds collect`` would load the whole consolidated model on every rank).

What is measured, per rank: peak RSS (``getrusage``), CPU seconds (``process_time``; the
two cores are shared with other jobs, so wall time is reported but is noise), and every
``torch.distributed`` collective, classified by who called it: ``zero`` (DeepSpeed's own
parameter gathers and gradient reductions), ``capture`` (dattri_ds: capture, store),
``selection`` (the online selector) or ``loop``. Capture and selection must only move the
small results (projected ``[B, k]`` rows, ``[B1, B2]`` scores, a projected target), never
per-example gradients: the largest single collective of each is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter",
                "all_to_all_single", "all_gather_object", "broadcast_object_list",
                "_all_gather_base", "_reduce_scatter_base")


class CommCounter:
    """Counts the bytes this rank contributes to every ``torch.distributed`` collective.

    A call's bytes are the sizes of the tensors it is given as input (``*_object`` calls
    count their pickled size as 0, but their calls are counted). The caller is the innermost
    frame outside torch: a DeepSpeed frame means ``zero``; otherwise the first project frame
    decides (``selection/`` -> selection, ``dattri_ds/`` -> capture, else loop).
    """

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.largest: dict[str, tuple[int, str]] = {}
        self.phase = "init"

    def install(self) -> CommCounter:
        import torch.distributed as dist
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            self._record(name, args, kwargs)
            return fn(*args, **kwargs)
        wrapped.__wrapped__ = fn
        return wrapped

    def _record(self, name, args, kwargs) -> None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if name in ("all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor",
                    "_reduce_scatter_base") and len(tensors) >= 2:
            tensors = tensors[1:2]  # (output, input): count the input
        elif name in ("all_gather", "gather") and tensors:
            tensors = tensors[-1:]  # the local tensor; the list output holds no new bytes
        n = sum(t.numel() * t.element_size() for t in tensors)
        key = f"{self.phase}:{_caller()}"
        self.bytes[key] = self.bytes.get(key, 0) + n
        self.calls[key] = self.calls.get(key, 0) + 1
        if n > self.largest.get(key, (-1, ""))[0]:
            shapes = "+".join(str(list(t.shape)) for t in tensors) or "object"
            self.largest[key] = (n, f"{name} {shapes} {tensors[0].dtype if tensors else ''}")

    def report(self) -> dict:
        return {k: {"bytes": self.bytes[k], "calls": self.calls[k],
                    "largest": self.largest[k][1], "largest_bytes": self.largest[k][0]}
                for k in sorted(self.bytes)}


def _caller() -> str:
    f = sys._getframe(3)
    project = []
    while f is not None:
        path = f.f_code.co_filename
        if "/deepspeed/" in path and not project:
            return "zero"  # DeepSpeed's own traffic (gathers, reductions), whoever ran forward
        if path.startswith(str(ROOT)) and "/benchmarks/" not in path:
            project.append(path[len(str(ROOT)) + 1:])
        f = f.f_back
    if any(p.startswith("selection/") for p in project):
        return "selection"
    if any(p.startswith("dattri_ds/") for p in project):
        return "capture"
    return "loop"


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _log(path: str | None, line: str) -> None:
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    print(f"{stamp} {line}", flush=True)
    if path:
        with open(path, "a") as f:
            f.write(f"{stamp} {line}\n")


def _setup_rank(rank: int, world: int, port: int) -> CommCounter:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    torch.set_num_threads(1)
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return CommCounter().install()


# ---- training: launch/train.py's main, timed per step ----------------------------------------
def train_worker(rank: int, world: int, port: int, argv: list[str], progress: str | None, q):
    try:
        counter = _setup_rank(rank, world, port)
        import dattri_ds.launch.train as launch
        from dattri_ds.launch.runlog import RunLog

        marks: list[tuple[float, float, int]] = []
        end_step = RunLog.end_step

        def timed_end_step(self, step, loss, *a, **kw):
            marks.append((time.process_time(), time.perf_counter(), _peak_rss()))
            if rank == 0:
                _log(progress, f"train step {step}: loss {loss:.4f}, cpu {marks[-1][0]:.0f} s, "
                               f"peak RSS rank0 {marks[-1][2] / 2**30:.2f} GiB")
            return end_step(self, step, loss, *a, **kw)

        RunLog.end_step = timed_end_step
        train = launch.train
        start: list[float] = []

        def timed_train(*a, **kw):
            counter.phase = "steps"
            start.extend([time.process_time(), time.perf_counter(), _peak_rss()])
            return train(*a, **kw)

        launch.train = timed_train
        summary = launch.main(argv)
        steps = len(marks)
        cpu = [b[0] - a[0] for a, b in zip([start[:3], *marks[:-1]], marks)]
        wall = [b[1] - a[1] for a, b in zip([start[:3], *marks[:-1]], marks)]
        q.put((rank, {"summary": summary, "steps": steps, "cpu_per_step": cpu,
                      "wall_per_step": wall, "peak_rss_before_steps": start[2],
                      "peak_rss": _peak_rss(), "cpu_total": time.process_time(),
                      "comm": counter.report()}))
    except BaseException as e:  # noqa: BLE001 - report to the parent
        import traceback
        q.put((rank, {"error": f"{e!r}\n{traceback.format_exc()}"}))


# ---- collect: tools/collect.py's collect_checkpoint on a ZeRO-3 engine -------------------------
def collect_worker(rank: int, world: int, port: int, opts: dict, progress: str | None, q):
    try:
        counter = _setup_rank(rank, world, port)
        q.put((rank, _collect(rank, world, opts, progress, counter)))
    except BaseException as e:  # noqa: BLE001
        import traceback
        q.put((rank, {"error": f"{e!r}\n{traceback.format_exc()}"}))


class _EngineRun:
    """What ``collect_checkpoint`` asks of a run, served by a restored ZeRO-3 engine."""

    def __init__(self, run, module) -> None:
        self.run, self.module = run, module

    def fingerprint(self) -> str:
        return self.run.fingerprint()

    def model(self, tag: str):
        return self.module.eval()


def _collect(rank: int, world: int, opts: dict, progress: str | None, counter) -> dict:
    import deepspeed

    from dattri_ds.launch.train import setup_distributed
    from dattri_ds.tools.collect import build_parser, collect_checkpoint
    from dattri_ds.tools.common import Run, load_texts

    setup_distributed()
    run_dir = Path(opts["run"])
    run = Run.open(run_dir)
    ds_cfg = json.loads((run_dir / "resolved_deepspeed_config.json").read_text())
    tok = run.tokenizer()
    data = load_texts(opts["data"], tok, run.seq_len, opts["n"])
    t0, w0 = time.process_time(), time.perf_counter()
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(ds_cfg)  # from_config builds under zero.Init: half per rank
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run_dir / "model"))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_cfg)
    del keep
    tag = run.tags("last")[-1]
    engine.load_checkpoint(str(run_dir / "checkpoints"), tag=tag,
                           load_lr_scheduler_states=False)
    load_cpu, load_wall, rss_loaded = time.process_time() - t0, time.perf_counter() - w0, \
        _peak_rss()
    if rank == 0:
        _log(progress, f"collect: engine restored from {tag} in {load_cpu:.0f} CPU s, "
                       f"peak RSS rank0 {rss_loaded / 2**30:.2f} GiB")
    args = build_parser().parse_args(
        ["--run", str(run_dir), "--out", opts["out"], "--projection", "kronecker",
         "--projection-dim", str(opts["k"]), "--batch-size", str(opts["batch"]),
         "--flush-every", "16"])
    counter.phase = "collect"
    t1, w1 = time.process_time(), time.perf_counter()
    added = collect_checkpoint(_EngineRun(run, engine.module), tag, data, args, rank, world)
    cpu, wall = time.process_time() - t1, time.perf_counter() - w1
    if rank == 0:
        _log(progress, f"collect: {added} examples on rank 0 in {cpu:.0f} CPU s "
                       f"({cpu / max(added, 1):.1f} CPU s/example), wall {wall:.0f} s, "
                       f"peak RSS rank0 {_peak_rss() / 2**30:.2f} GiB")
    return {"added": added, "cpu": cpu, "wall": wall, "load_cpu": load_cpu,
            "load_wall": load_wall, "peak_rss_loaded": rss_loaded, "peak_rss": _peak_rss(),
            "comm": counter.report(), "tag": tag}


def spawn(target, world: int, *args, timeout: float = 4 * 3600) -> list[dict]:
    """Run ``target(rank, world, port, *args, q)`` on ``world`` spawned ranks; their results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join()
    errors = [f"rank {r}: {v['error']}" for r, v in got.items() if "error" in v]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [got[r] for r in range(world)]


def long_docs(src: Path, dst: Path, tok, min_tokens: int, n: int) -> int:
    """Copy the first ``n`` documents of ``src`` with at least ``min_tokens`` tokens."""
    kept = 0
    with open(src) as fin, open(dst, "w") as fout:
        for line in fin:
            if len(tok.encode(json.loads(line)["text"])) >= min_tokens:
                fout.write(line)
                kept += 1
                if kept == n:
                    break
    return kept


def _comm_per_step(comm: dict, phase: str, steps: int) -> dict[str, tuple[float, str]]:
    out = {}
    for key, v in comm.items():
        ph, who = key.split(":")
        if ph == phase:
            out[who] = (v["bytes"] / max(steps, 1), v["largest"])
    return out


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _fmt_comm(title: str, per_step: dict[str, tuple[float, str]]) -> list[str]:
    return [f"  {title} {who:9s} {b / 1e6:12.3f} MB/step per rank; largest: {largest}"
            for who, (b, largest) in sorted(per_step.items())]


def large(args) -> dict:
    """The >= 1B run: train (capture + online selection), then collect from its checkpoint."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    avail = _mem_available()
    _log(args.progress, f"large run: MemAvailable {avail / 2**30:.1f} GiB, out {out}")
    if avail < args.min_free_gib * 2**30 and not args.force:
        raise SystemExit(f"only {avail / 2**30:.1f} GiB available, the run needs "
                         f"{args.min_free_gib} GiB: wait, shrink the model, or pass --force")
    phases = set(args.phases.split(","))
    result: dict = {"model_config": args.model_config, "ds_config": args.ds_config,
                    "seq_len": args.seq_len}
    if "train" in phases:
        argv = ["--deepspeed_config", args.ds_config, "--model-config", args.model_config,
                "--train-data", args.train_data, "--max-docs", str(args.max_docs),
                "--seq-len", str(args.seq_len), "--vocab-size", str(args.vocab_size),
                "--steps", str(args.steps), "--out", str(out / "run"), "--log-every", "1",
                "--capture", "--online-selection", "--target-data", args.target_data,
                "--target-max-docs", str(args.target_docs)]
        _log(args.progress, "train: " + " ".join(argv))
        ranks = spawn(train_worker, 2, argv, args.progress)
        result["train"] = ranks
        r0 = ranks[0]
        steady = sorted(r0["cpu_per_step"][1:] or r0["cpu_per_step"])
        _log(args.progress,
             f"train done: {r0['steps']} steps; CPU s/step rank0 first {r0['cpu_per_step'][0]:.0f}"
             f" (includes the target gradient), then median {steady[len(steady) // 2]:.0f}; "
             f"peak RSS per rank {[round(r['peak_rss'] / 2**30, 2) for r in ranks]} GiB")
        for line in _fmt_comm("train", _comm_per_step(r0["comm"], "steps", r0["steps"])):
            _log(args.progress, line)
        (out / "scale_large.json").write_text(json.dumps(result, indent=1, default=str))
    if "collect" in phases:
        from dattri_ds.data import Tokenizer
        tok = Tokenizer.load(out / "run" / "tokenizer.model")
        docs = out / "collect_docs.jsonl"
        kept = long_docs(Path(args.train_data), docs, tok, args.seq_len - 1, args.collect_n)
        if kept < args.collect_n:
            raise SystemExit(f"only {kept} documents of >= {args.seq_len - 1} tokens")
        opts = {"run": str(out / "run"), "data": str(docs), "n": args.collect_n,
                "out": str(out / "grads"), "k": args.k, "batch": args.collect_batch}
        ranks = spawn(collect_worker, 2, opts, args.progress)
        result["collect"] = ranks
        r0 = ranks[0]
        _log(args.progress,
             f"collect done: {sum(r['added'] for r in ranks)} sequences x {args.seq_len} tokens;"
             f" CPU s/example rank0 {r0['cpu'] / max(r0['added'], 1):.1f}, wall s/example "
             f"(both ranks) {r0['wall'] / max(sum(r['added'] for r in ranks), 1):.1f}; "
             f"peak RSS per rank {[round(r['peak_rss'] / 2**30, 2) for r in ranks]} GiB")
        for line in _fmt_comm("collect", _comm_per_step(r0["comm"], "collect", r0["added"])):
            _log(args.progress, line.replace("/step", "/example"))
        (out / "scale_large.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("large", help="the >= 1B ZeRO-3 run (train, then collect)")
    lg.add_argument("--out", default="runs/scale1b")
    lg.add_argument("--model-config", default=str(ROOT / "configs/model_llama_1b.json"))
    lg.add_argument("--ds-config", default=str(ROOT / "configs/zero3_cpu_large.json"))
    lg.add_argument("--train-data", default=str(ROOT / "data/corpus/train.jsonl"))
    lg.add_argument("--target-data", default=str(ROOT / "data/target/hamlet.jsonl"))
    lg.add_argument("--target-docs", type=int, default=2)
    lg.add_argument("--max-docs", type=int, default=400)
    lg.add_argument("--vocab-size", type=int, default=4096)
    lg.add_argument("--seq-len", type=int, default=256)
    lg.add_argument("--steps", type=int, default=5)
    lg.add_argument("--collect-n", type=int, default=128)
    lg.add_argument("--collect-batch", type=int, default=1)
    lg.add_argument("--k", type=int, default=256, help="Kronecker projection size per layer")
    lg.add_argument("--phases", default="train,collect")
    lg.add_argument("--progress", default=None, help="append progress lines to this file")
    lg.add_argument("--min-free-gib", type=float, default=16.0)
    lg.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "large":
        large(args)


if __name__ == "__main__":
    main()
