"""Launch step costs on one device: launch/train.py plain, --capture, content selection,
alignment selection, and a bare DeepSpeed loop, side by side, with MFU and the planner.

    python benchmarks/launch_steps.py --device cuda          # 1B Llama, ZeRO-3 bf16 (GPU)
    python benchmarks/launch_steps.py --dry-run              # tiny Llama on CPU (CI)

All variants run one after another in ONE spawned process (one rank, world 1; the start-up
of torch, CUDA and DeepSpeed is paid once) on the same model config, DeepSpeed JSON, data and
seed:

* ``plain`` / ``capture`` / ``content`` / ``alignment``: ``launch/train.py``'s ``main`` with
  no flag, ``--capture``, ``--online-selection`` (content score) and ``--online-selection
  --selection-score alignment`` (the gradient probe of 2x candidates);
* ``bare``: ``deepspeed.initialize`` on the same model (``build_model``, same seed), config
  (our block removed) and micro-batches (``loop.micro_batch_indices``), then
  ``engine(**batch).loss; engine.backward(loss); engine.step()`` -- no dattri-ds.

A variant's step time is the wall time from the end of step ``--warmup`` to the end of the
last step, divided by the steps between (the device is synchronized at those two marks
only, so the loop runs as it does in production). MFU is ``3 x forward FLOPs`` of the
trained examples per second over the device's peak (``dattri_ds.plan.DEVICES``). The
planner's prediction is printed beside each (``plan(...).times``: ``train_step`` for plain,
content and bare, ``step`` for capture and alignment). Writes ``launch_steps.md`` and
``launch_steps.json`` to ``--out``; exits non-zero when a variant fails (a ratio over its
target is reported as MISS, not a failure).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("plain", "capture", "content", "alignment", "bare")
#: Target ratio to ``plain`` (``bare``: plain / bare) from issue 34.
TARGETS = {"capture": 1.05, "content": 1.02, "alignment": 2.0, "bare": 1.1}
_FLAGS = {"plain": [], "capture": ["--capture"],
          "content": ["--online-selection", "--target-data",
                      str(ROOT / "data/tiny/target.jsonl"), "--target-max-docs", "4"]}
_FLAGS["alignment"] = [*_FLAGS["content"], "--selection-score", "alignment"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Marks:
    """Wall time at the end of step ``warmup`` and of the last step (device synchronized)."""

    def __init__(self, warmup: int, steps: int, dev: torch.device) -> None:
        self.warmup, self.steps, self.dev, self.t = warmup, steps, dev, {}

    def at(self, step: int) -> None:  # step: 0-based, called at its end
        if step + 1 in (self.warmup, self.steps):
            _sync(self.dev)
            self.t[step + 1] = time.perf_counter()

    def per_step(self) -> float:
        return (self.t[self.steps] - self.t[self.warmup]) / (self.steps - self.warmup)


def _launch(argv: list[str], marks: _Marks) -> dict:
    import dattri_ds.launch.train as launch
    from dattri_ds.launch.runlog import RunLog

    end_step = RunLog.end_step

    def timed(self, step, loss, lr, examples, save):
        marks.at(step)  # before the original; no checkpoint (a 1B ZeRO-3 one is ~12 GB)
        return end_step(self, step, loss, lr, examples, lambda *a: None)

    RunLog.end_step = timed
    try:
        return launch.main(argv)
    finally:
        RunLog.end_step = end_step


def _bare(ds_path: str, argv: list[str], marks: _Marks, out: Path) -> dict:
    """deepspeed.initialize + the same model, config and micro-batches; nothing else."""
    import deepspeed

    from dattri_ds.models.causal_lm import build_model
    from dattri_ds.launch.args import load_run_config, parse_args
    from dattri_ds.launch.loop import micro_batch_indices
    from dattri_ds.launch.data import training_data

    from dattri_ds.launch.deepspeed_backend import setup_distributed

    if not torch.distributed.is_initialized():  # bare alone: no launch ran before it
        setup_distributed()
    args = parse_args(["--deepspeed_config", ds_path, *argv])
    ds_config, cfg = load_run_config(ds_path, args.overrides)
    out.mkdir(parents=True, exist_ok=True)
    data, tok = training_data(cfg, out, 0)  # launch's own examples (prepared into out)
    model = build_model(cfg.train.model_config, tokenizer=tok, seed=cfg.train.seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    engine.train()
    loss = None
    for step in range(cfg.train.steps):
        idx = micro_batch_indices(len(data), step, micro, gas, 0, 1, cfg.train.seed)
        for mb in range(gas):
            batch = {k: v.to(engine.device) for k, v in data.batch(idx[mb]).items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
        marks.at(step)
    final = float(loss)
    del engine, model
    return {"final_loss": final}


def worker(port: int, opts: dict, q) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    dev = torch.device(opts["device"])
    results = {}
    for v in opts["variants"]:
        marks = _Marks(opts["warmup"], opts["steps"], dev)
        out = Path(opts["out"]) / f"launch_{v}"
        try:
            if v == "bare":
                info = _bare(opts["ds"], opts["common"], marks, out)
            else:
                info = _launch(["--deepspeed_config", opts["ds"], *opts["common"],
                                "--out", str(out), "--force", *_FLAGS[v]], marks)
            results[v] = {"step_s": marks.per_step(), "final_loss": info.get("final_loss")}
        except BaseException as e:  # noqa: BLE001 - the other variants still run
            import traceback
            results[v] = {"error": f"{e!r}\n{traceback.format_exc()[-3000:]}"}
        shutil.rmtree(out, ignore_errors=True)  # stores and caches: keep $OUT small
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    q.put(results)


def _predict(opts: dict, v: str) -> tuple[float, float]:
    """(planner seconds of variant ``v``, the device's peak flops/s)."""
    from dattri_ds.launch.args import load_run_config
    from dattri_ds.plan import DEVICES, ModelShape, RunSpec, plan

    ds, cfg = load_run_config(opts["ds"])
    zero = (ds.get("zero_optimization") or {}).get("stage", 0)
    bf16 = (ds.get("bf16") or {}).get("enabled", False)
    dev = DEVICES[opts["planner_device"]]
    shape = ModelShape.from_config(opts["model_config"], vocab_size=opts["vocab"])
    k = cfg.capture.projection.dim if cfg.capture.projection is not None else 256
    spec = RunSpec(world=1, seq_len=opts["seq_len"], micro_batch=opts["micro"],
                   zero_stage=zero, dtype="bfloat16" if bf16 else "float32",
                   capture=v == "capture", k=k,
                   method="selection" if v in ("content", "alignment") else "graddot",
                   selection_probe=v == "alignment", optimizer="adamw")
    t = plan(shape, dev, spec).times
    return (t["step"] if v in ("capture", "alignment") else t["train_step"]), dev.flops_per_s


def table(opts: dict, results: dict) -> tuple[str, bool, list[dict]]:
    """The Markdown table, whether every variant ran, and its rows as dicts."""
    from dattri_ds.plan import ModelShape

    shape = ModelShape.from_config(opts["model_config"], vocab_size=opts["vocab"])
    examples = opts["micro"] * opts["gas"]
    flops = 3 * shape.forward_flops(examples, opts["seq_len"])
    plain = results.get("plain", {}).get("step_s")
    head = ["variant", "s/step", "ex/s", "ratio", "target", "MFU", "planner s", "planner/meas"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ok, rows = True, []
    for v in opts["variants"]:
        r = results.get(v, {"error": "no result"})
        if "error" in r:
            ok = False
            lines.append(f"| {v} | FAILED: {r['error'].splitlines()[0][:80]} |" + " |" * 6)
            rows.append({"variant": v, "error": r["error"].splitlines()[0][:200]})
            continue
        s = r["step_s"]
        pred, peak = _predict(opts, v)
        ratio = (plain / s if v == "bare" else s / plain) if plain else float("nan")
        tgt = TARGETS.get(v)
        mark = "" if tgt is None else (f"<= {tgt} " + ("ok" if ratio <= tgt else "MISS"))
        what = "plain/bare" if v == "bare" else "x plain"
        rows.append({"variant": v, "step_s": s, "ex_s": examples / s, "ratio": ratio,
                     "ratio_of": what, "target": tgt, "mfu": flops / s / peak,
                     "planner_s": pred})
        lines.append(f"| {v} | {s:.4f} | {examples / s:.1f} | {ratio:.2f} {what} | {mark} | "
                     f"{flops / s / peak:.3f} | {pred:.4f} | {pred / s:.2f} |")
    head = (f"launch steps: {opts['model_config']} ({shape.num_params / 1e9:.2f} B params), "
            f"{opts['ds']}, micro-batch {opts['micro']} x gas {opts['gas']}, T={opts['seq_len']}"
            f", {opts['steps']} steps (timed after {opts['warmup']}), device {opts['device']}, "
            f"planner {opts['planner_device']}")
    return head + "\n" + "\n".join(lines), ok, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="tiny Llama, ZeRO-3 on CPU, 4 steps: checks the code, not the speed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--planner-device", default=None, help="default: h200 on CUDA, else cpu")
    p.add_argument("--model-config", default=str(ROOT / "configs/model_llama_1b.json"))
    p.add_argument("--ds-config", default=None,
                   help="DeepSpeed JSON (default: ZeRO-3 bf16, AdamW, written to --out)")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--train-data", default=str(ROOT / "data/corpus/train.jsonl"),
                   help="documents long enough to fill --seq-len (the tiny set is padding)")
    p.add_argument("--max-docs", type=int, default=400)
    p.add_argument("--out", default="runs/gpu_check")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.micro, args.seq_len, args.vocab_size = "cpu", 2, 32, 512
        args.steps, args.warmup = 4, 2
        args.train_data, args.max_docs = str(ROOT / "data/tiny/train.jsonl"), 64
        args.model_config = str(ROOT / "configs/model_llama_tiny.json")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ds = args.ds_config or str(_default_ds(out, args))
    cfg = json.loads(Path(ds).read_text())
    opts = {"device": args.device, "ds": ds, "model_config": args.model_config,
            "micro": cfg.get("train_micro_batch_size_per_gpu", args.micro),
            "gas": cfg.get("gradient_accumulation_steps", 1), "seq_len": args.seq_len,
            "vocab": args.vocab_size, "steps": args.steps, "warmup": args.warmup,
            "variants": args.variants.split(","), "out": str(out),
            "planner_device": args.planner_device or ("h200" if args.device.startswith("cuda")
                                                      else "cpu"),
            "common": ["--model-config", args.model_config, "--train-data", args.train_data,
                       "--max-docs", str(args.max_docs), "--seq-len",
                       str(args.seq_len), "--vocab-size", str(args.vocab_size), "--steps",
                       str(args.steps), "--log-every", "1000000", "--save-every", "0",
                       "--skip-memory-check"]}
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=worker, args=(port, opts, q))
    proc.start()
    results = q.get(timeout=3600)
    proc.join()
    text, ok, rows = table(opts, results)
    print(text)
    (out / "launch_steps.md").write_text(text + "\n")
    record = {"opts": opts, "results": results, "rows": rows, "title": text.split("\n")[0]}
    (out / "launch_steps.json").write_text(json.dumps(record, indent=1))
    for v, r in results.items():
        if "error" in r:
            print(f"{v} failed:\n{r['error']}", file=sys.stderr)
    return 0 if ok else 1


def _default_ds(out: Path, args) -> Path:
    """ZeRO-3 (bf16 on CUDA, fp32 on CPU), AdamW (torch's: no DeepSpeed ops are built on the
    GPU image), no clipping sync beyond DeepSpeed's own, Kronecker k=256."""
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "steps_per_print": 1_000_000_000,
           "dattri_ds": {"capture": {"projection": {"kind": "kronecker", "dim": 256}}}}
    if args.device.startswith("cuda"):
        cfg["bf16"] = {"enabled": True}
        cfg["dattri_ds"]["capture"]["dtype"] = "bfloat16"
    path = out / "launch_ds.json"
    path.write_text(json.dumps(cfg))
    return path


if __name__ == "__main__":
    sys.exit(main())
