"""Kernel launches and host syncs per path, per model family: what a GPU step would wait on.

    python benchmarks/kernel_counts.py [--families gpt2 llama qwen2 olmo2] [--paths ...]
                                       [--breakdown] [--json FILE]

(Not ``benchmarks/kernels.py``: with ``benchmarks/`` on ``sys.path`` -- every script in it
run directly -- a ``kernels`` module shadows the hub's ``kernels`` package, which
transformers probes for on import, and every model import fails.)

A GPU step at small sizes is bound by fixed per-kernel and per-sync costs, and their number
does not depend on the device: ``dattri_ds.eval.kernels.KernelCounter`` counts them on the
CPU (its docstring defines both; docs/kernels.md). Every path is run once to warm up (cost
decisions, seeded projection matrices and factors are cached as in a long run), then counted.

Models: random-init tiny causal LMs built in code, hidden 64, 4 heads, vocabulary 256, no
dropout: GPT-2 4 layers, Llama 4 layers (2 KV heads), Qwen2 8 layers (2 KV heads, tied
embeddings), OLMo-2 4 layers; batches of B=4, T=32 (``input_ids``, ``labels``,
``attention_mask``), HF token-mean loss.

Decisions that depend on the device (ghost or dense routes, where stacking layers of one
shape pays) are taken with the CUDA roofline (``Roofline.default("cuda")``), as a GPU run
takes them. Each row: kernels, host syncs, the ratio of kernels to the path's reference,
and the extra kernels per captured layer over it (collect: over ``probe``). Paths:

* ``plain``: ``model(**batch).loss.backward()``.
* ``capture exact|kron|default``: the same inside ``GradientCapture`` (no projection,
  ``ProjectionConfig(kind="kronecker", dim=256)``, ``ProjectionConfig()``), then ``pop()``;
  against ``plain``.
* ``probe``: ``torch.autograd.grad`` of the loss to the captured layers' outputs (what
  collect's backward does, no capture): the floor of a collect pass.
* ``collect exact|kron|default|whitened``: one batch of ``collect(model, batches, config)``
  after its first (whitened: EK-FAC factors fitted once on the batch, ``whiten="ekfac"``,
  default projection); against ``plain`` (extra kernels: over ``probe``).
* ``bare [+capture]``: one step of a bare DeepSpeed loop (``engine(**batch).loss``,
  ``engine.backward``, ``engine.step``, the loss read; ``+capture``: inside the launch's
  ``GradientCapture.for_engine`` with its Kronecker k=256 capture, batches popped), ZeRO-3
  of configs/zero3_cpu.json with micro-batch B, one process.
* ``launch [+capture]``: one optimizer step of launch/train.py (``loop.train``, DeepSpeed
  backend) on the same model, config and data (``--capture``: the store's rows written
  too); against ``bare [+capture]``.
* ``select content|alignment``: the same launch step with ``--online-selection`` (the
  default content score; ``--selection-score alignment``) of 8 target texts; against
  ``launch``.

The launch paths count step ``WARM_STEPS`` of the loop (the tokenized examples count as host
memory) in a spawned process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dattri_ds.eval.kernels import KernelCounter  # noqa: E402

B, T, VOCAB, HIDDEN = 4, 32, 256, 64
#: The tiny model of each family (Hugging Face config fields).
FAMILIES: dict[str, dict] = {
    "gpt2": dict(model_type="gpt2", n_layer=4, n_head=4, n_embd=HIDDEN, n_positions=128,
                 activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, tie_word_embeddings=False),
    "llama": dict(model_type="llama", num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, hidden_size=HIDDEN, intermediate_size=160,
                  max_position_embeddings=128, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, hidden_size=HIDDEN, intermediate_size=160,
                  max_position_embeddings=128, tie_word_embeddings=True),
    "olmo2": dict(model_type="olmo2", num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, hidden_size=HIDDEN, intermediate_size=160,
                  max_position_embeddings=128, tie_word_embeddings=False),
}
CAPTURE_PATHS = ("plain", "capture exact", "capture kron", "capture default", "probe",
                 "collect exact", "collect kron", "collect default", "collect whitened")
LAUNCH_PATHS = ("bare", "launch", "bare +capture", "launch +capture", "select content",
                "select alignment")
PATHS = CAPTURE_PATHS + LAUNCH_PATHS


@dataclass(frozen=True)
class Count:
    """One counted path."""

    kernels: int
    syncs: int
    by_op: dict[str, int]
    sync_sites: dict[str, int]


def quiet() -> None:
    """No library warnings or info lines in the printed tables."""
    warnings.filterwarnings("ignore")
    for name in ("transformers", "dattri_ds", "DeepSpeed", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny model (random init, training mode)."""
    from dattri_ds.models.causal_lm import build_model

    return build_model(FAMILIES[family], vocab_size=VOCAB, seed=seed)


def batch(rows: int = B, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` random examples of T tokens (no padding)."""
    ids = torch.randint(4, VOCAB, (rows, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def count(fn: Callable[[], object], warmup: int = 1, where: bool = True) -> Count:
    """Kernels and host syncs of ``fn()`` after ``warmup`` uncounted calls."""
    for _ in range(warmup):
        fn()
    with KernelCounter(where=where) as kc:
        fn()
    return Count(kc.kernels, kc.syncs, dict(kc.kernels_by_op), dict(kc.sync_sites))


def _projection(name: str):
    from dattri_ds import ProjectionConfig

    return {"exact": None, "kron": ProjectionConfig(kind="kronecker", dim=256),
            "default": ProjectionConfig(), "whitened": ProjectionConfig()}[name]


def captured_layers(model: torch.nn.Module) -> int:
    """Layers the default capture records on ``model``."""
    from dattri_ds import GradientCapture

    cap = GradientCapture(model).attach()
    try:
        return len(cap.layers)
    finally:
        cap.close()


def gpu_cost():
    """The cost model a CUDA run decides with (``Roofline.default("cuda")``): ghost or dense
    routes and where stacking layers pays are taken as on a GPU, whatever runs the count."""
    from dattri_ds.ops.cost import CostModel, Roofline

    return CostModel(Roofline.default("cuda"))


def capture_paths(family: str, paths: tuple[str, ...]) -> dict[str, Count]:
    """Counts of the plain, capture, probe and collect paths of one family."""
    from dattri_ds import CaptureConfig, GradientCapture

    model, b = build(family), batch()
    out: dict[str, Count] = {}

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        model(**b).loss.backward()
    for path in paths:
        kind, _, variant = path.partition(" ")
        if path == "plain":
            out[path] = count(plain)
        elif kind == "capture":
            cap = GradientCapture(model, CaptureConfig(projection=_projection(variant)),
                                  cost=gpu_cost())
            with cap:
                out[path] = count(lambda: (plain(), cap.pop()))
        elif path == "probe":
            out[path] = count(lambda: _probe(model, b))
        elif kind == "collect":
            out[path] = _collect(model, b, variant)
    model.zero_grad(set_to_none=True)
    return out


def _collect(model: torch.nn.Module, b: dict, variant: str) -> Count:
    """One batch of a running ``collect`` (its second: the first made the projection's
    device matrices, as the first batch of a long collect does)."""
    from dattri_ds import CaptureConfig, collect

    cfg, factors = CaptureConfig(projection=_projection(variant)), None
    if variant == "whitened":
        cfg, factors = _whitening(model, b, cfg)
    batches = collect(model, iter(lambda: b, None), cfg, factors=factors, cost=gpu_cost())
    return count(lambda: next(batches))


def _probe(model: torch.nn.Module, b: dict) -> None:
    """collect's backward without the capture: the loss's gradient w.r.t. the outputs of
    the layers the capture records."""
    from dattri_ds import GradientCapture

    outs = []
    cap = GradientCapture(model).attach()
    hooks = [m.register_forward_hook(lambda mod, a, o: outs.append(o))
             for m, _ in cap.layers.values()]
    cap.close()
    try:
        loss = model(**b).loss
        torch.autograd.grad(loss, [o for o in outs if o.requires_grad])
    finally:
        for h in hooks:
            h.remove()


def _whitening(model, b, cfg):
    """EK-FAC factors of ``model`` fitted on ``b`` and the whitened collect config."""
    from dataclasses import replace

    from dattri_ds import CaptureConfig, collect, fit_factors

    factors = fit_factors(list(collect(model, [b], CaptureConfig())))
    return replace(cfg, whiten="ekfac"), factors


# ---- one step of launch/loop.py against a bare DeepSpeed step --------------------------
#: launch/train.py flags of each launch path (the selection paths' target: data/tiny).
LAUNCH_FLAGS = {
    "launch": [], "launch +capture": ["--capture"],
    "select content": ["--online-selection", "--target-data",
                       os.path.join(ROOT, "data/tiny/target.jsonl"), "--target-max-docs", "8"],
}
LAUNCH_FLAGS["select alignment"] = [*LAUNCH_FLAGS["select content"],
                                    "--selection-score", "alignment"]
#: Optimizer steps run before the counted one (the first builds optimizer state, caches).
WARM_STEPS = 2


def _run_files(family: str, out: str) -> tuple[str, list[str]]:
    """The DeepSpeed JSON (configs/zero3_cpu.json with micro-batch B, no accumulation) and
    the launch flags shared by every launch path of ``family``."""
    with open(os.path.join(ROOT, "configs/zero3_cpu.json")) as f:
        ds = json.load(f)
    ds.update(train_micro_batch_size_per_gpu=B, gradient_accumulation_steps=1)
    os.makedirs(out, exist_ok=True)
    ds_path, model = os.path.join(out, "ds.json"), os.path.join(out, "model.json")
    with open(ds_path, "w") as f:
        json.dump(ds, f)
    with open(model, "w") as f:
        json.dump(FAMILIES[family], f)
    return ds_path, ["--model-config", model, "--train-data",
                     os.path.join(ROOT, "data/tiny/train.jsonl"), "--max-docs", "64",
                     "--seq-len", str(T), "--vocab-size", str(VOCAB), "--steps",
                     str(WARM_STEPS + 1), "--log-every", "1000000", "--save-every", "0",
                     "--eval-every", "0", "--skip-memory-check"]


def _data_tensors(data) -> list[torch.Tensor]:
    """The tensors of the loop's tokenized examples: host memory in a GPU run."""
    return [v for v in vars(data).values() if isinstance(v, torch.Tensor)]


def _stream(n: int, seed: int) -> list[torch.Tensor]:
    """The loop's cached permutations of the example stream (``loop._epoch_order``): host
    tensors made before the counted step."""
    from dattri_ds.launch.loop import _epoch_order

    return [_epoch_order(n, seed, e) for e in (0, 1)]


def _count_launch(ds_path: str, common: list[str], flags: list[str], out: str) -> Count:
    """Kernels of step ``WARM_STEPS`` of launch/train.py's loop (``RunLog.end_step`` to
    ``end_step``: batching, selection, forward, backward, optimizer, the loss read)."""
    import dattri_ds.launch.train as launch
    from dattri_ds.launch.runlog import RunLog

    end_step, prepare = RunLog.end_step, launch.training_data
    seen: dict = {}

    def prepared(cfg, *a, **k):
        got = prepare(cfg, *a, **k)
        seen["host"] = _data_tensors(got[0]) + _stream(len(got[0]), cfg.train.seed)
        return got

    def counted(self, step, loss, lr, examples, save):
        end_step(self, step, loss, lr, examples, lambda *a: None)  # no checkpoint
        if step == WARM_STEPS - 1:
            seen["kc"] = KernelCounter(seen["host"], where=True).__enter__()
        elif step == WARM_STEPS:
            seen["kc"].__exit__(None, None, None)

    RunLog.end_step, launch.training_data = counted, prepared
    try:
        launch.main(["--deepspeed_config", ds_path, *common, "--out", out, "--force", *flags])
    finally:
        RunLog.end_step, launch.training_data = end_step, prepare
    kc = seen["kc"]
    return Count(kc.kernels, kc.syncs, dict(kc.kernels_by_op), dict(kc.sync_sites))


def _count_bare(ds_path: str, common: list[str], capture: bool, out: str) -> Count:
    """Kernels of one step of a bare DeepSpeed loop on the same model, config and data:
    ``engine(**batch).loss``, ``engine.backward``, ``engine.step`` (``capture``: inside the
    launch's ``GradientCapture.for_engine``, batches popped)."""
    import deepspeed

    from dattri_ds import GradientCapture
    from dattri_ds.models.causal_lm import build_model
    from dattri_ds.launch.args import load_run_config, parse_args
    from dattri_ds.launch.data import training_data
    from dattri_ds.launch.loop import micro_batch_indices

    args = parse_args(["--deepspeed_config", ds_path, *common])
    ds_config, cfg = load_run_config(ds_path, args.overrides)
    Path(out).mkdir(parents=True, exist_ok=True)
    data, tok = training_data(cfg, Path(out), 0)
    model = build_model(cfg.train.model_config, tokenizer=tok, seed=cfg.train.seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config)
    engine.train()
    cap = GradientCapture.for_engine(engine, cfg.capture).attach() if capture else None

    def step(i: int) -> None:
        idx = micro_batch_indices(len(data), i, B, 1, 0, 1, cfg.train.seed)
        batch = {k: v.to(engine.device) for k, v in data.batch(idx[0]).items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        float(loss)  # the loop reads its step's loss too
        if cap is not None:
            cap.pop()
    for i in range(WARM_STEPS):
        step(i)
    with KernelCounter(_data_tensors(data) + _stream(len(data), cfg.train.seed),
                       where=True) as kc:
        step(WARM_STEPS)
    if cap is not None:
        cap.close()
    return Count(kc.kernels, kc.syncs, dict(kc.kernels_by_op), dict(kc.sync_sites))


def _name_the_accelerator() -> None:
    """DeepSpeed's CPU accelerator calls its device ``"cpu"``, the name code uses for the
    host: here it is ``"cpu:0"`` (the same device to torch), so its moves to the accelerator
    read as they do on a GPU (``.to("cuda:0")``: none), not as copies to the host."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    acc.device_name = lambda device_index=None: "cpu:0"
    acc.current_device_name = lambda: "cpu:0"


def _launch_worker(port: int, family: str, paths: list[str], out: str, q) -> None:
    """The launch and bare paths of one family, in this (spawned) process: one rank."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    log = os.open(os.path.join(out, "launch.log"), os.O_WRONLY | os.O_CREAT)
    os.dup2(log, 1)  # the runs' own lines (DeepSpeed, the launch log) stay out of the table
    os.dup2(log, 2)
    quiet()
    from dattri_ds.ops import cost as cost_module

    cost_module._DEFAULT_MODELS["cpu"] = gpu_cost()  # the launch's capture decides as on a GPU
    from dattri_ds.launch.deepspeed_backend import setup_distributed

    try:
        setup_distributed()
        _name_the_accelerator()
        ds_path, common = _run_files(family, out)
        res = {}
        for path in paths:
            folder = os.path.join(out, path.replace(" ", "_").replace("+", ""))
            if path.startswith("bare"):
                res[path] = _count_bare(ds_path, common, "capture" in path, folder)
            else:
                res[path] = _count_launch(ds_path, common, LAUNCH_FLAGS[path], folder)
        q.put(res)
    except BaseException:  # noqa: BLE001 - handed to the parent, which raises it
        import traceback

        q.put(traceback.format_exc())


def launch_paths(family: str, paths: tuple[str, ...]) -> dict[str, Count]:
    """Counts of the launch, selection and bare DeepSpeed paths of one family (one spawned
    process: DeepSpeed initializes torch.distributed)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as out:
        proc = ctx.Process(target=_launch_worker, args=(port, family, list(paths), out, q))
        proc.start()
        try:
            res = q.get(timeout=1800)
        finally:
            proc.join(60)
    if isinstance(res, str):
        raise RuntimeError(f"the launch paths of {family} failed:\n{res}")
    return res


#: The path each path's ratio is taken against, and its extra kernels per captured layer
#: (collect: ratio to plain, extra over probe).
REFERENCE = {"launch": "bare", "bare +capture": "bare", "launch +capture": "bare +capture",
             "select content": "launch", "select alignment": "launch"}


def reference(path: str, counts: dict[str, Count]) -> tuple[str | None, str | None]:
    """``(ratio reference, extra-kernels reference)`` of ``path`` among ``counts``."""
    ref = REFERENCE.get(path, None if path in ("plain", "probe", "bare") else "plain")
    extra = "probe" if path.startswith("collect") else ref
    return (ref if ref in counts else None), (extra if extra in counts else None)


def ratios(counts: dict[str, Count], layers: int) -> list[list[object]]:
    """Table rows: path, kernels, syncs, ratio to its reference, extra kernels per layer."""
    rows = []
    for path, c in counts.items():
        ref, extra = reference(path, counts)
        ratio = f"{c.kernels / counts[ref].kernels:.2f} x {ref}" if ref else ""
        more = f"{(c.kernels - counts[extra].kernels) / layers:.1f}" if extra else ""
        rows.append([path, c.kernels, c.syncs, ratio, more])
    return rows


def breakdown(base: Count, other: Count, top: int = 25) -> str:
    """The ops ``other`` launches more (or fewer) than ``base``, largest first."""
    ops = set(base.by_op) | set(other.by_op)
    diff = sorted(((other.by_op.get(o, 0) - base.by_op.get(o, 0), o) for o in ops),
                  key=lambda d: -abs(d[0]))
    return ", ".join(f"{o} {d:+d}" for d, o in diff[:top] if d)


def main(argv: list[str] | None = None) -> None:
    from benchmarks._common import environment, table

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--paths", nargs="+", default=list(CAPTURE_PATHS), choices=list(PATHS))
    p.add_argument("--breakdown", action="store_true",
                   help="per path: the ops it launches beyond plain (probe for collect), and "
                        "where every host sync fires")
    p.add_argument("--json", help="write the counts here")
    args = p.parse_args(argv)
    quiet()
    torch.manual_seed(0)
    print(f"B={B}, T={T}, hidden {HIDDEN}, vocab {VOCAB}; {environment()}")
    record = {}
    for family in args.families:
        paths = tuple(args.paths)
        if any(x.startswith("collect") for x in paths) and "probe" not in paths:
            paths = paths + ("probe",)
        if "plain" not in paths:
            paths = ("plain",) + paths
        counts = capture_paths(family, tuple(x for x in paths if x in CAPTURE_PATHS))
        launch = tuple(x for x in paths if x in LAUNCH_PATHS)
        if launch:
            need = {REFERENCE.get(x, x) for x in launch} | set(launch)
            counts.update(launch_paths(family, tuple(x for x in LAUNCH_PATHS if x in need)))
        layers = captured_layers(build(family))
        print(f"\n{family}: {layers} captured layers")
        print(table(["path", "kernels", "host syncs", "ratio", "extra / layer"],
                    ratios(counts, layers)))
        if args.breakdown:
            for path, c in counts.items():
                _, extra = reference(path, counts)
                print(f"  {path}: {breakdown(counts[extra], c) if extra else ''}")
                for site, n in c.sync_sites.items():
                    print(f"    sync x{n}: {site}")
        record[family] = {k: {"kernels": c.kernels, "syncs": c.syncs}
                          for k, c in counts.items()} | {"layers": layers}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
