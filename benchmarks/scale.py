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
import math
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
    _COUNTER[:] = [CommCounter().install()]
    return _COUNTER[0]


_COUNTER: list[CommCounter] = []  # this process's counter (progress lines read it)


# ---- training: launch/train.py's main, timed per step ----------------------------------------
def release_after_probes() -> None:
    """Free ZeRO-3's gathered weights after every probe pass of this process.

    DeepSpeed releases a module's gathered parameters in that module's backward hooks; a
    probe pass (``torch.autograd.grad`` to layer outputs, no weight gradients) or a no-grad
    forward leaves some or all of them gathered until the next training step: at 1B
    parameters that is up to 4 GB more per rank. ``engine.empty_partition_cache()``
    (DeepSpeed's API for this, used after evaluation passes) releases them.
    """
    import deepspeed

    from dattri_ds.capture.hooks import GradientCapture

    engines = []
    initialize = deepspeed.initialize

    def tracked(*a, **kw):
        out = initialize(*a, **kw)
        engines.append(out[0])
        return out

    deepspeed.initialize = tracked
    probe = GradientCapture.probe

    def probe_and_release(self, forward):
        try:
            return probe(self, forward)
        finally:
            for eng in engines:
                if eng.zero_optimization_partition_weights():
                    eng.empty_partition_cache()

    GradientCapture.probe = probe_and_release
    counted = GradientCapture.probe
    seen = {"n": 0, "t0": 0.0}

    def probe_logged(self, forward):  # progress of long runs, rank 0
        if seen["n"] == 0:
            seen["t0"] = time.process_time()
        out = counted(self, forward)
        seen["n"] += 1
        path = os.environ.get("SCALE_PROGRESS")
        if path and os.environ.get("RANK") == "0" and (seen["n"] <= 8 or seen["n"] % 8 == 0):
            cpu = time.process_time() - seen["t0"]
            comm = "; ".join(f"{k} {v['bytes'] / 1e6:.1f} MB (largest {v['largest']})"
                             for k, v in _COUNTER[0].report().items() if _COUNTER
                             and not k.endswith(":zero")) if _COUNTER else ""
            _log(path, f"  probe passes so far on rank 0: {seen['n']}, {cpu:.0f} CPU s "
                       f"({cpu / seen['n']:.1f} per pass), peak RSS "
                       f"{_peak_rss() / 2**30:.2f} GiB; non-ZeRO collectives: {comm or 'none'}")
        return out

    GradientCapture.probe = probe_logged


def _zero_init_build(ds_path: str):
    """``launch.deepspeed_backend.build`` that builds the model partitioned (``zero.Init`` through
    ``HfDeepSpeedConfig``): no rank ever holds the whole model (launch/train.py builds it
    whole on every rank first, 4 bytes per parameter, before DeepSpeed partitions it)."""
    def build(cfg, tok):
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        from dattri_ds.models.causal_lm import build_model
        from dattri_ds.launch.args import load_run_config
        with torch.device("meta"):  # the exact HF config build_model makes, no weights
            shell = build_model(cfg.train.model_config, tokenizer=tok, seed=None)
        keep = HfDeepSpeedConfig(load_run_config(ds_path)[0])
        torch.manual_seed(cfg.train.seed)
        model = AutoModelForCausalLM.from_config(shell.config)
        del keep
        if getattr(model, "loss_type", "") is None:
            model.loss_type = "ForCausalLM"
        return model
    return build


def train_worker(rank: int, world: int, port: int, argv: list[str], progress: str | None, q,
                 zero_init: bool = False):
    try:
        counter = _setup_rank(rank, world, port)
        import dattri_ds.launch.deepspeed_backend as ds_backend
        import dattri_ds.launch.train as launch
        from dattri_ds.launch.runlog import RunLog

        if zero_init:
            ds_backend.build = _zero_init_build(argv[argv.index("--deepspeed_config") + 1])
            release_after_probes()

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
        release_after_probes()
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

    @property
    def run_id(self) -> str | None:
        return self.run.run_id

    def model(self, tag: str):
        return self.module.eval()


def _collect(rank: int, world: int, opts: dict, progress: str | None, counter) -> dict:
    import deepspeed

    from dattri_ds.launch.deepspeed_backend import setup_distributed
    from dattri_ds.tools.collect import build_parser, collect_checkpoint
    from dattri_ds.tools.sources import Run
    from dattri_ds.tools.texts import load_texts

    setup_distributed()
    run_dir = Path(opts["run"])
    run = Run.open(run_dir)
    ds_cfg = json.loads((run_dir / "resolved_deepspeed_config.json").read_text())
    tok = run.tokenizer()
    data = load_texts(opts["data"], tok, opts["seq_len"], opts["n"])
    t0, w0 = time.process_time(), time.perf_counter()
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    ds_cfg = {k: v for k, v in ds_cfg.items()  # no optimizer: no gradient partitions
              if k not in ("optimizer", "scheduler", "zero_allow_untested_optimizer",
                           "gradient_clipping")}
    keep = HfDeepSpeedConfig(ds_cfg)  # from_config builds under zero.Init: half per rank
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run_dir / "model"))
    engine, *_ = deepspeed.initialize(model=model, config=ds_cfg)
    del keep
    tag = run.tags("last")[-1]
    load_zero3_partition(engine.module, run_dir / "checkpoints" / tag, rank, world)
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


def load_zero3_partition(module, folder: Path, rank: int, world: int) -> None:
    """Fill this rank's ZeRO-3 parameter partitions from its own checkpoint file.

    ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds rank r's fp32 partitions, one
    flat vector per parameter group: each parameter (in the order of ``param_shapes`` in the
    model-states file) contributes its ``ceil(numel / world)``-element partition
    (DeepSpeed's ``zero_to_fp32`` reads the same layout). Same model, same world size only.
    """
    from deepspeed.checkpoint.constants import (
        FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, PARAM_SHAPES,
    )
    shapes = torch.load(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)[PARAM_SHAPES]
    state = torch.load(folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                       map_location="cpu", weights_only=False, mmap=True)
    groups = state[OPTIMIZER_STATE_DICT][FP32_FLAT_GROUPS]
    flat = torch.cat([g.flatten() for g in groups]) if len(groups) > 1 else groups[0]
    params = dict(module.named_parameters())
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            p = params[name]
            n = math.ceil(math.prod(shape) / world)
            if p.ds_tensor.numel() != n or tuple(p.ds_shape) != tuple(shape):
                raise RuntimeError(f"{name}: checkpoint partition {n} of {tuple(shape)} does not "
                                   f"match the engine's {p.ds_tensor.numel()} of "
                                   f"{tuple(p.ds_shape)}")
            p.ds_tensor.data.copy_(flat.narrow(0, offset, n).to(p.ds_tensor.dtype))
            offset += n
    if offset != flat.numel():
        raise RuntimeError(f"read {offset} of {flat.numel()} partition elements")


def spawn(target, world: int, *args, timeout: float = 4 * 3600, **kwargs) -> list[dict]:
    """Run ``target(rank, world, port, *args, q, **kwargs)`` on ``world`` spawned ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q), kwargs=kwargs)
             for r in range(world)]
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
    if args.progress:
        os.environ["SCALE_PROGRESS"] = str(Path(args.progress).resolve())
    if args.mmap_threshold:  # freed blocks >= this go back to the OS (glibc keeps them else)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    result: dict = {"model_config": args.model_config, "ds_config": args.ds_config,
                    "seq_len": args.seq_len}
    if "train" in phases:
        argv = ["--deepspeed_config", args.ds_config, "--model-config", args.model_config,
                "--train-data", args.train_data, "--max-docs", str(args.max_docs),
                "--seq-len", str(args.train_seq_len), "--vocab-size", str(args.vocab_size),
                "--steps", str(args.steps), "--out", str(out / "run"), "--log-every", "1",
                "--capture", "--online-selection", "--target-data", args.target_data,
                "--target-max-docs", str(args.target_docs)]
        _log(args.progress, "train: " + " ".join(argv))
        ranks = spawn(train_worker, 2, argv, args.progress, zero_init=True)
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
                "out": str(out / "grads"), "k": args.k, "batch": args.collect_batch,
                "seq_len": args.seq_len}
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


# ---- the planner against measured runs ---------------------------------------------------------
LADDER = {  # Llama-style, vocab 4096 (the tokenizer's): about 12M, 48M, 82M, 190M parameters
    "12m": {"num_hidden_layers": 6, "hidden_size": 384, "intermediate_size": 1024,
            "num_attention_heads": 6, "num_key_value_heads": 2},
    "48m": {"num_hidden_layers": 10, "hidden_size": 640, "intermediate_size": 1728,
            "num_attention_heads": 10, "num_key_value_heads": 2},
    "82m": {"num_hidden_layers": 12, "hidden_size": 768, "intermediate_size": 2048,
            "num_attention_heads": 12, "num_key_value_heads": 4},
    "190m": {"num_hidden_layers": 16, "hidden_size": 1024, "intermediate_size": 2816,
             "num_attention_heads": 16, "num_key_value_heads": 4},
}
_LLAMA_BASE = {"model_type": "llama", "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
               "hidden_act": "silu", "attention_dropout": 0.0, "tie_word_embeddings": False}


def _ladder_ds_config(micro: int, k: int) -> dict:
    cfg = json.loads((ROOT / "configs/zero3_cpu_large.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    cfg.pop("zero_allow_untested_optimizer")
    cfg["dattri_ds"]["capture"]["projection"]["dim"] = k
    cfg["dattri_ds"]["selection"]["projection"]["dim"] = k
    return cfg


def _spec_of(ds_cfg: dict, seq_len: int, examples: int, **kw):
    """The planner's RunSpec of a launch/train.py run with this DeepSpeed config."""
    from dattri_ds.plan import RunSpec
    opt = ds_cfg.get("optimizer", {}).get("type", "sgd").lower()
    z = ds_cfg["zero_optimization"]
    knobs = {"reduce_bucket": z.get("reduce_bucket_size", 5e8),
             "max_live_params": z.get("stage3_max_live_parameters", 1e9),
             "prefetch_bucket": z.get("stage3_prefetch_bucket_size", 5e7),
             "sub_group_size": z.get("sub_group_size", 1e9)}
    spec = dict(world=2, seq_len=seq_len, micro_batch=ds_cfg["train_micro_batch_size_per_gpu"],
                zero_stage=z["stage"],
                dtype="bfloat16" if ds_cfg.get("bf16", {}).get("enabled") else "float32",
                optimizer="adamw" if opt.startswith("adam") else "sgd", capture=True,
                k=ds_cfg["dattri_ds"]["capture"]["projection"]["dim"], method="selection",
                candidate_multiple=2.0, examples=examples, **knobs,
                # the config's selection score probes (alignment): plan its probe pass
                selection_probe=ds_cfg["dattri_ds"]["selection"].get("score") != "content")
    spec.update(kw)
    return RunSpec(**spec)


def _measured_row(name: str, model_cfg, ds_cfg: dict, seq_len: int, ranks: list[dict],
                  vocab: int) -> dict:
    from dattri_ds.plan import ModelShape, plan
    shape = ModelShape.from_config(model_cfg, vocab_size=vocab)
    p = plan(shape, "cpu", _spec_of(ds_cfg, seq_len, 0))
    steps = [sorted(r["cpu_per_step"][1:])[len(r["cpu_per_step"][1:]) // 2] for r in ranks]
    return {"name": name, "params": shape.num_params, "model": model_cfg, "ds": ds_cfg,
            "seq_len": seq_len, "vocab": vocab,
            "pred_rss": p.peak, "meas_rss": max(r["peak_rss"] for r in ranks),
            "pred_step": p.times["step"], "meas_step": max(steps),
            "pred_terms": p.memory, "ranks": [{k: v for k, v in r.items() if k != "comm"}
                                             for r in ranks]}


def replan(rows: list[dict]) -> list[dict]:
    """The same measured rows with the current planner's predictions."""
    from dattri_ds.plan import ModelShape, plan
    out = []
    for r in rows:
        shape = ModelShape.from_config(r["model"], vocab_size=r["vocab"])
        p = plan(shape, "cpu", _spec_of(r["ds"], r["seq_len"], 0))
        out.append({**r, "pred_rss": p.peak, "pred_step": p.times["step"],
                    "pred_terms": p.memory})
    return out


def ladder(args) -> list[dict]:
    """Train each ladder size for a few steps (capture + selection) and compare with plan."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    old = json.loads((out / "ladder.json").read_text()) if (out / "ladder.json").exists() else []
    if args.replan:  # no runs: the stored measurements against the current planner
        rows = replan(old)
        print(_ladder_table(rows))
        return rows
    rows = [r for r in old if r["name"] not in args.sizes.split(",")]
    for name in args.sizes.split(","):
        model_cfg = {**_LLAMA_BASE, **LADDER[name]}
        mpath, dpath = out / f"model_{name}.json", out / f"ds_{name}.json"
        mpath.write_text(json.dumps(model_cfg))
        ds_cfg = _ladder_ds_config(args.micro, args.k)
        dpath.write_text(json.dumps(ds_cfg))
        argv = ["--deepspeed_config", str(dpath), "--model-config", str(mpath),
                "--train-data", args.train_data, "--max-docs", "200", "--seq-len",
                str(args.seq_len), "--vocab-size", str(args.vocab_size), "--steps",
                str(args.steps), "--out", str(out / name), "--log-every", "1", "--capture",
                "--online-selection", "--target-data", args.target_data,
                "--target-max-docs", "4"]
        ranks = spawn(train_worker, 2, argv, None)
        row = _measured_row(name, model_cfg, ds_cfg, args.seq_len, ranks, args.vocab_size)
        rows.append(row)
        _log(args.progress, _row_text(row))
        (out / "ladder.json").write_text(json.dumps(rows, indent=1))
    rows.sort(key=lambda r: r["params"])
    print(_ladder_table(rows))
    (out / "ladder.json").write_text(json.dumps(rows, indent=1))
    return rows


def _row_text(r: dict) -> str:
    return (f"{r['name']}: {r['params'] / 1e6:.0f}M params; peak RSS/rank predicted "
            f"{r['pred_rss'] / 2**30:.2f} GiB, measured {r['meas_rss'] / 2**30:.2f} GiB "
            f"(ratio {r['pred_rss'] / r['meas_rss']:.2f}); CPU s/step predicted "
            f"{r['pred_step']:.2f}, measured {r['meas_step']:.2f} "
            f"(ratio {r['pred_step'] / r['meas_step']:.2f})")


def _ladder_table(rows: list[dict]) -> str:
    head = (f"{'size':>6} {'params':>8} {'RSS pred GiB':>13} {'RSS meas GiB':>13} {'ratio':>6} "
            f"{'step pred s':>12} {'step meas CPU s':>16} {'ratio':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['name']:>6} {r['params'] / 1e6:>7.0f}M {r['pred_rss'] / 2**30:>13.2f} "
                     f"{r['meas_rss'] / 2**30:>13.2f} {r['pred_rss'] / r['meas_rss']:>6.2f} "
                     f"{r['pred_step']:>12.2f} {r['meas_step']:>16.2f} "
                     f"{r['pred_step'] / r['meas_step']:>6.2f}")
    return "\n".join(lines)


def paper(args) -> None:
    """The planner on the paper's setting: a 110B Qwen-1.5-like model, 4 x H200, T = 512."""
    from dataclasses import replace

    from dattri_ds.plan import ModelShape, RunSpec, plan
    shape = ModelShape.from_config(ROOT / "configs/model_qwen_110b.json")
    collect = RunSpec(world=4, seq_len=512, micro_batch=4, zero_stage=3, k=0, train=False,
                      zero_init=True, method="graddot", examples=100_000)
    train = RunSpec(world=4, seq_len=512, micro_batch=1, zero_stage=3, k=0, zero_init=True,
                    method="graddot", examples=100_000)
    runs = {"collect: frozen bf16 weights, ZeRO-3, micro-batch 4 (the planner's advice "
            "follows)": collect,
            "collect as advised: micro-batch 2": replace(collect, micro_batch=2),
            "training with capture: AdamW, bf16, ZeRO-3 (advice follows)": train,
            "training as advised: parameters and optimizer offloaded": replace(train,
                                                                                offload="all")}
    for title, spec in runs.items():
        print(f"=== {title}")
        print(plan(shape, "h200", spec).table(), "\n")


# ---- accelerator throughput at a Qwen-like size ladder (tools/gpu_check.sh) ---------------------
QWEN = {"0.5b": "configs/model_qwen_0.5b.json", "1.5b": "configs/model_qwen_1.5b.json",
        "7b": "configs/model_qwen_7b.json", "tiny": "configs/model_llama_tiny.json"}


def _build_hf(path: Path, dev: torch.device, dtype: torch.dtype):
    import transformers
    d = json.loads(path.read_text())
    if d["model_type"] == "llama" and "vocab_size" not in d:
        d["vocab_size"] = 512
    cfg = transformers.AutoConfig.for_model(**d)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model, d


def _timed(fn, dev: torch.device, reps: int) -> list[float]:
    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    fn()
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def throughput(args) -> list[dict]:
    """Per size: plain forward+backward (a training step's compute) and projected per-example
    gradients by probe passes (what ``collect`` runs), examples/s, peak memory, planner."""
    from dattri_ds import CaptureConfig, GradientCapture, ProjectionConfig
    from dattri_ds.plan import DEVICES, ModelShape, RunSpec, plan

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.sizes.split(","):
        model, d = _build_hf(ROOT / QWEN[name], dev, dtype)
        model.train()
        B, T = args.batch, args.seq_len
        ids = torch.randint(0, d["vocab_size"], (B, T), device=dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)

        def train_pass():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        cap = GradientCapture(model, CaptureConfig(
            projection=ProjectionConfig(kind="kronecker", dim=args.k)), probe_only=True)
        cap.attach()

        def collect_pass():
            got = cap.probe(lambda: model(input_ids=ids, labels=ids).loss)
            assert got is not None and all(torch.isfinite(lg.data.values).all()
                                           for lg in got.layers.values())

        t_train = sorted(_timed(train_pass, dev, args.reps))[args.reps // 2]
        t_collect = sorted(_timed(collect_pass, dev, args.reps))[args.reps // 2]
        cap.detach()
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else _peak_rss()
        shape = ModelShape.from_config(d)
        key = args.gpu_name if dev.type == "cuda" else "cpu"
        ladder = dict(world=1, seq_len=T, micro_batch=B, zero_stage=0, k=args.k,
                      dtype="bfloat16" if dev.type == "cuda" else "float32")
        p = plan(shape, DEVICES[key], RunSpec(**ladder, train=False))
        p_train = plan(shape, DEVICES[key], RunSpec(**ladder, capture=False, optimizer="sgd"))
        flops = 3 * shape.forward_flops(B, T)
        rows.append({"size": name, "params": shape.num_params, "B": B, "T": T,
                     "train_s": t_train, "train_ex_s": B / t_train,
                     "mfu": flops / t_train / DEVICES[key].flops_per_s,
                     "collect_s": t_collect, "collect_ex_s": B / t_collect,
                     "pred_collect_s": p.times["collect_per_example"] * B,
                     "pred_train_s": p_train.times["train_step"],
                     "collect_ratio": t_collect / t_train,
                     "peak_gb": peak / 1e9})
        print(json.dumps(rows[-1]), flush=True)
        del model, cap
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    head = ["size", "params (B)", "B x T", "fwd+bwd s", "planner fwd+bwd s", "train ex/s",
            "MFU", "collect s", "planner collect s", "collect / fwd+bwd", "collect ex/s",
            "peak GB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['size']} | {r['params'] / 1e9:.2f} | {r['B']} x {r['T']} | "
                     f"{r['train_s']:.3f} | {r['pred_train_s']:.3f} | {r['train_ex_s']:.1f} | "
                     f"{r['mfu']:.2f} | {r['collect_s']:.3f} | {r['pred_collect_s']:.3f} | "
                     f"{r['collect_ratio']:.2f} | {r['collect_ex_s']:.1f} | "
                     f"{r['peak_gb']:.1f} |")
    text = (f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}),"
            f" {dtype}, Kronecker k={args.k} per layer, {args.reps} timed reps (median)\n"
            + "\n".join(lines))
    print(text)
    (out / "throughput.md").write_text(text + "\n")
    (out / "throughput.json").write_text(json.dumps(rows, indent=1))
    return rows


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
    lg.add_argument("--seq-len", type=int, default=256, help="tokens per collected sequence")
    lg.add_argument("--train-seq-len", type=int, default=128, help="tokens per trained sequence")
    lg.add_argument("--steps", type=int, default=5)
    lg.add_argument("--collect-n", type=int, default=128)
    lg.add_argument("--collect-batch", type=int, default=1)
    lg.add_argument("--k", type=int, default=256, help="Kronecker projection size per layer")
    lg.add_argument("--phases", default="train,collect")
    lg.add_argument("--progress", default=None, help="append progress lines to this file")
    lg.add_argument("--min-free-gib", type=float, default=16.0)
    lg.add_argument("--force", action="store_true")
    lg.add_argument("--mmap-threshold", type=int, default=1 << 20,
                    help="MALLOC_MMAP_THRESHOLD_ of the ranks (0: glibc's dynamic default)")
    ld = sub.add_parser("ladder", help="planner vs measured at 3 sizes (2 ranks, ZeRO-3)")
    ld.add_argument("--out", default="runs/scale_ladder")
    ld.add_argument("--sizes", default="12m,48m,190m")
    ld.add_argument("--train-data", default=str(ROOT / "data/corpus/train.jsonl"))
    ld.add_argument("--target-data", default=str(ROOT / "data/target/hamlet.jsonl"))
    ld.add_argument("--vocab-size", type=int, default=4096)
    ld.add_argument("--seq-len", type=int, default=128)
    ld.add_argument("--micro", type=int, default=2)
    ld.add_argument("--k", type=int, default=256)
    ld.add_argument("--steps", type=int, default=4)
    ld.add_argument("--progress", default=None)
    ld.add_argument("--replan", action="store_true",
                    help="no runs: compare the stored measurements with the current planner")
    sub.add_parser("paper", help="the planner's prediction for 110B on 4 x H200, T=512")
    tp = sub.add_parser("throughput", help="examples/s at a Qwen-like size ladder (GPU)")
    tp.add_argument("--sizes", default="0.5b,1.5b,7b", help=f"comma list of {sorted(QWEN)}")
    tp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    tp.add_argument("--gpu-name", default="h200", help="planner device for the prediction")
    tp.add_argument("--batch", type=int, default=4)
    tp.add_argument("--seq-len", type=int, default=512)
    tp.add_argument("--k", type=int, default=256)
    tp.add_argument("--reps", type=int, default=3)
    tp.add_argument("--out", default="runs/gpu_check")
    args = p.parse_args(argv)
    {"large": large, "ladder": ladder, "paper": paper, "throughput": throughput}[args.cmd](args)


if __name__ == "__main__":
    main()
