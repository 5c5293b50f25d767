"""Megatron-core backend of launch/train.py: a GPTModel trained with tensor (and data) parallelism.

    torchrun --standalone --nproc_per_node 2 launch/train.py --backend megatron \
        --tensor-model-parallel-size 2 [--sequence-parallel] \
        --deepspeed_config configs/zero1_cpu.json --capture

The DeepSpeed JSON is still the run's config: its ``"dattri_ds"`` block, the micro-batch
size, gradient accumulation, gradient clipping, the optimizer (``AdamW``/``Adam``/``SGD``,
as a torch optimizer) and the scheduler (a DeepSpeed ``lr_schedules`` class driving the torch
optimizer) are used; every other DeepSpeed key (ZeRO, precision, ...) is ignored, with a
logged note. Ranks form ``world = TP x DP`` groups (Megatron's ``parallel_state``); pipeline
parallelism is refused. TP ranks of one DP group train the same examples, in the data order
of the DeepSpeed path (``micro_batch_indices`` with the DP rank and size). Gradients are
synchronized by Megatron's own ``DistributedDataParallel`` (grad buffers, ``main_grad``)
and ``finalize_model_grads``: replicas averaged over the DP group, sequence-parallel
parameters (the norms) summed over the TP group. It runs on CPU too (gloo, with the
``cpu_workarounds``). The optimizer: on CUDA Megatron's own (``get_megatron_optimizer``,
fp32, with its global-norm clipping); on CPU, where Megatron's optimizer needs CUDA
(SETUP.md s.5), the torch optimizer of the DeepSpeed JSON on ``main_grad`` with a global-
norm clip summed over the TP group.

The model is ``MegatronLM``: a ``GPTModel`` (``integrations.megatron.gpt_block_spec``:
Megatron's local layer spec with torch norms that allow sequence parallelism; learned
absolute positions, untied output layer) called like a Hugging Face model,
``lm(input_ids=, labels=).loss`` being the token mean over ``labels[:, 1:] != -100`` (so
captures use the default ``label_shift=1``).

Artifacts (besides those of the DeepSpeed path: resolved configs, tokenizer, trajectory.json
with the lr of every step, summary.json, grad_store/, selection.jsonl):

* ``<out>/model/config.json``: ``{"backend": "megatron", "transformer_config": {...},
  "vocab_size", "max_position_embeddings", "trained_tensor_model_parallel_size", ...}``;
  ``transformer_config`` holds the TransformerConfig kwargs of the TP=1 model.
* ``<out>/checkpoints/<tag>/megatron_consolidated.pt``: ``torch.save`` of a plain
  ``{name: tensor}`` dict, the GPTModel's full (TP=1-equivalent) state dict: every
  tensor-parallel parameter is all-gathered along its ``partition_dim`` over the TP group,
  then global rank 0 writes. ``GPTModel(TransformerConfig(**transformer_config), ...)
  .load_state_dict(state, strict=False)`` (only ``_extra_state`` keys missing) rebuilds it.
* ``<out>/checkpoints/<tag>/megatron_consolidated.json``: format, step, lr, the model config
  above, and ``check``: per-example losses of the first training examples computed by the
  live (sharded) model, so a reload can be verified.

The optimizer state is not saved: these checkpoints serve attribution, not resuming.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from dattri_ds.errors import ConfigError
from dattri_ds.integrations.megatron import MegatronLM, build_gpt, cpu_workarounds
from dattri_ds.launch.config import RunConfig, dump_json
from dattri_ds.launch.runlog import RunLog

__all__ = ["MegatronLM", "transformer_kwargs", "consolidated_state", "load_consolidated",
           "run", "CONSOLIDATED", "CONSOLIDATED_META"]

logger = logging.getLogger("dattri_ds.launch")
CONSOLIDATED = "megatron_consolidated.pt"
CONSOLIDATED_META = "megatron_consolidated.json"
FORMAT = "dattri_ds.megatron_consolidated"
#: DeepSpeed keys this backend reads; any other key of the JSON is ignored (and logged).
USED_DS_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "optimizer", "scheduler", "train_batch_size")
CHECK_EXAMPLES = 4


# ---- model config ---------------------------------------------------------------------------
def transformer_kwargs(model_config: str | Path | dict, tp: int,
                       sequence_parallel: bool = False) -> tuple[dict, int]:
    """TransformerConfig kwargs (CPU-safe: no fusions, no dropout) and the context length.

    A GPT-2 style JSON (configs/model_gpt2_tiny.json) maps ``n_layer -> num_layers``,
    ``n_embd -> hidden_size``, ``n_head -> num_attention_heads``, ``n_inner`` (default
    ``4 n_embd``) ``-> ffn_hidden_size``, ``n_positions`` -> the context length.

    Raises:
        ConfigError: another ``model_type``, a size the TP size does not divide, or
            sequence parallelism at TP 1.
    """
    d = model_config if isinstance(model_config, dict) else json.loads(
        Path(model_config).read_text())
    if d.get("model_type", "gpt2") != "gpt2":
        raise ConfigError(f"--backend megatron builds GPT-2 style models only; the model config "
                          f"has model_type='{d.get('model_type')}'. Use configs/"
                          f"model_gpt2_tiny.json (or --backend deepspeed)")
    hidden = int(d.get("n_embd", 768))
    kw = dict(num_layers=int(d.get("n_layer", 12)), hidden_size=hidden,
              num_attention_heads=int(d.get("n_head", 12)),
              ffn_hidden_size=int(d.get("n_inner") or 4 * hidden),
              layernorm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
              tensor_model_parallel_size=tp, use_cpu_initialization=True,
              perform_initialization=True, gradient_accumulation_fusion=False,
              masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
              persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
              sequence_parallel=bool(sequence_parallel))
    if sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    for what in ("hidden_size", "num_attention_heads", "ffn_hidden_size"):
        if kw[what] % tp:
            raise ConfigError(f"{what}={kw[what]} is not divisible by the tensor-parallel size "
                              f"{tp}: pick --tensor-model-parallel-size dividing hidden size, "
                              f"heads and FFN size (or change the model config)")
    return kw, int(d.get("n_positions", 1024))


def padded_vocab(vocab: int, tp: int, multiple: int = 64) -> int:
    """The vocabulary rounded up to a multiple of ``multiple * tp`` (Megatron's padding)."""
    m = multiple * tp
    return -(-vocab // m) * m


# ---- consolidated checkpoints ---------------------------------------------------------------
def _is_tp(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def consolidated_state(gpt: nn.Module) -> dict[str, torch.Tensor]:
    """The full (TP=1) state dict: TP-sharded parameters all-gathered on their partition dim.

    Collective over the tensor-parallel group (every TP rank must call it).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    params = dict(gpt.named_parameters())
    out = {}
    for name, t in gpt.state_dict().items():
        if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
            continue
        p = params.get(name)
        if p is not None and _is_tp(p) and tp > 1:
            parts = [torch.empty_like(p.data) for _ in range(tp)]
            dist.all_gather(parts, p.data.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.detach().cpu().clone()
    return out


def load_consolidated(gpt: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a consolidated state into a GPTModel of any TP size (slicing sharded params)."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    params = dict(gpt.named_parameters())
    local = {}
    for name, t in state.items():
        p = params.get(name)
        if p is not None and _is_tp(p) and tp > 1:
            t = t.chunk(tp, dim=p.partition_dim)[rank]
        local[name] = t
    missing, unexpected = gpt.load_state_dict(local, strict=False)
    bad = [m for m in missing if not m.endswith("_extra_state")]
    if bad or unexpected:
        raise ConfigError(f"Consolidated Megatron state does not match the model: missing "
                          f"{bad[:5]}, unexpected {unexpected[:5]}")


def _check_losses(lm: MegatronLM, data) -> list[float]:
    rows = torch.arange(min(CHECK_EXAMPLES, len(data)))
    device = next(lm.parameters()).device
    b = {k: v.to(device) for k, v in data.batch(rows).items()}
    was = lm.training
    lm.eval()
    with torch.no_grad():
        out = lm(input_ids=b["input_ids"], labels=b["labels"])
    lm.train(was)
    n = (b["labels"][:, 1:] != -100).sum(1).clamp_min(1)
    return (out.token_losses.sum(1) / n).cpu().tolist()


def save_checkpoint(lm: MegatronLM, path: Path, meta: dict, data, verify: bool) -> None:
    """Gather, write (global rank 0), and with ``verify`` reload and compare on every rank."""
    import torch.distributed as dist

    state = consolidated_state(lm.model)
    meta = {**meta, "format": FORMAT, "format_version": 1,
            "check": {"rows": list(range(min(CHECK_EXAMPLES, len(data)))),
                      "example_loss": _check_losses(lm, data)}}
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / (CONSOLIDATED + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path / CONSOLIDATED)
        dump_json(path / CONSOLIDATED_META, meta)
    dist.barrier()
    if verify:
        _verify(lm.model, torch.load(path / CONSOLIDATED, map_location="cpu",
                                     weights_only=True), path)


def _verify(gpt: nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """Every rank: its live shard equals the matching slice of the saved full tensor."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for name, p in gpt.named_parameters():
        full = saved[name]
        mine = full.chunk(tp, dim=p.partition_dim)[rank] if _is_tp(p) and tp > 1 else full
        if not torch.equal(mine, p.detach().cpu()):
            raise RuntimeError(f"Consolidated checkpoint {path} differs from the live TP rank "
                               f"{rank} shard of '{name}'")


# ---- optimization ---------------------------------------------------------------------------
_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def _optimizer_spec(ds_config: dict) -> tuple[str, dict]:
    """``(kind, params)`` of the JSON's optimizer: kind in ``_OPTIMIZERS``, DeepSpeed-only
    params (``torch_adam``, ``adam_w_mode``) dropped.

    Raises:
        ConfigError: another optimizer type.
    """
    spec = ds_config.get("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
    kind, p = spec.get("type", "AdamW").lower(), dict(spec.get("params", {}))
    if kind not in _OPTIMIZERS:
        raise ConfigError(f"optimizer.type '{spec.get('type')}' is not supported by --backend "
                          f"megatron; use one of AdamW, Adam, SGD")
    p.pop("torch_adam", None)
    p.pop("adam_w_mode", None)
    return kind, p


def make_optimizer(ds_config: dict, params):
    """A torch optimizer and (optionally) a DeepSpeed lr schedule from the DeepSpeed JSON."""
    kind, p = _optimizer_spec(ds_config)
    opt = _OPTIMIZERS[kind](params, **p)
    return opt, make_schedule(ds_config, opt)


def make_schedule(ds_config: dict, opt):
    """The DeepSpeed ``lr_schedules`` class of the JSON driving a torch optimizer, or None."""
    if "scheduler" not in ds_config:
        return None
    from deepspeed.runtime import lr_schedules

    s = ds_config["scheduler"]
    return getattr(lr_schedules, s["type"])(opt, **s.get("params", {}))


def wrap_ddp(gpt: nn.Module) -> nn.Module:
    """Megatron's ``DistributedDataParallel`` around the GPTModel (grad buffers; no overlap).

    Parameter gradients accumulate into ``param.main_grad``; ``finalize_model_grads``
    averages them over the DP group and sums sequence-parallel ones over TP. The GPTModel
    itself stays the module that is called and captured (same layer names as at TP=1).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False),
        gpt)


def megatron_optimizer(ds_config: dict, ddp: nn.Module, clip: float):
    """CUDA: Megatron's optimizer (fp32 params, clipping inside) from the DeepSpeed JSON."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    kind, p = _optimizer_spec(ds_config)
    betas = p.get("betas", (0.9, 0.999))
    cfg = OptimizerConfig(
        optimizer="sgd" if kind == "sgd" else "adam", lr=float(p.get("lr", 1e-3)),
        weight_decay=float(p.get("weight_decay", 0.0)), adam_beta1=float(betas[0]),
        adam_beta2=float(betas[1]), adam_eps=float(p.get("eps", 1e-8)),
        sgd_momentum=float(p.get("momentum", 0.0)), clip_grad=float(clip), bf16=False,
        fp16=False, params_dtype=torch.float32, use_distributed_optimizer=False)
    return get_megatron_optimizer(cfg, [ddp])


def _main_grads_to_grad(model: nn.Module) -> None:
    """Point ``param.grad`` at the synchronized ``main_grad`` (torch optimizer on CPU)."""
    for p in model.parameters():
        mg = getattr(p, "main_grad", None)
        if mg is not None:
            p.grad = mg if mg.dtype == p.dtype else mg.to(p.dtype)


def _clip(model: nn.Module, max_norm: float, ctx) -> float:
    """Clip by the global norm: sharded parameters' squares summed over the TP group."""
    import torch.distributed as dist

    grads = [(p.grad, _is_tp(p)) for p in model.parameters() if p.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    sq = torch.zeros(2, dtype=torch.float64, device=device)
    for g, sharded in grads:
        sq[int(sharded)] += g.detach().double().pow(2).sum()
    if ctx.tp_world > 1:
        part = sq[1:].clone()
        dist.all_reduce(part, group=ctx.tp_group)
        sq[1] = part[0]
    norm = float(sq.sum().sqrt())
    if max_norm > 0 and norm > max_norm:
        for g, _ in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


# ---- setup ----------------------------------------------------------------------------------
def setup_parallel(tp: int, pp: int) -> tuple[int, int]:
    """torch.distributed (gloo on CPU) + Megatron groups; refuses PP > 1 and bad TP sizes."""
    import torch.distributed as dist

    if pp != 1:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} is not supported by dattri-ds: "
                          f"per-example losses live on the last stage only. Use tensor and "
                          f"data parallelism (--tensor-model-parallel-size)")
    from dattri_ds.distributed import default_rendezvous_env

    default_rendezvous_env()
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} must divide the number of "
                          f"processes ({world}); e.g. torchrun --nproc_per_node {max(tp, 1)}")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    if cuda:
        from megatron.core import tensor_parallel
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:
        cpu_workarounds()
    return dist.get_rank(), world


def _note_ignored(ds_config: dict) -> None:
    ignored = sorted(set(ds_config) - set(USED_DS_KEYS))
    if ignored:
        logger.info("--backend megatron ignores these DeepSpeed keys: %s (used: micro-batch "
                    "size, gradient accumulation, clipping, optimizer, scheduler)", ignored)


# ---- the run --------------------------------------------------------------------------------
def run(args, ds_config: dict, cfg: RunConfig) -> dict:
    """Train ``cfg`` with Megatron-core (``--backend megatron``); return the summary."""
    import torch.distributed as dist

    from dattri_ds.integrations.megatron import megatron_parallel_context, prepare_model
    from dattri_ds.launch.train import make_evaluator, make_selector, prepare_data

    tc, tp = cfg.train, args.tensor_model_parallel_size
    if tc.model_path:
        raise ConfigError("--model-path loads a Hugging Face model: --backend megatron builds a "
                          "GPTModel from --model-config; drop --model-path or use --backend "
                          "deepspeed")
    kw, context = transformer_kwargs(tc.model_config, tp, args.sequence_parallel)  # before any
    if args.sequence_parallel and tc.seq_len % tp:  # process group: errors at start
        raise ConfigError(f"--sequence-parallel splits the sequence over the {tp} tensor-"
                          f"parallel ranks: --seq-len {tc.seq_len} must be divisible by {tp}")
    rank, world = setup_parallel(tp, args.pipeline_model_parallel_size)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if rank == 0:
        _note_ignored(ds_config)
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    _, tok, data = prepare_data(cfg, out, rank)
    if data.seq_len > context:
        raise ConfigError(f"--seq-len {data.seq_len} exceeds the model context {context} "
                          f"(n_positions of {tc.model_config})")
    vocab = padded_vocab(tok.vocab_size, tp)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    lm = MegatronLM(build_gpt(kw, vocab, context, tc.seed)).to(device)
    prepare_model(lm)
    ctx = megatron_parallel_context()
    model_cfg = {"backend": "megatron", "transformer_config": {**kw,
                 "tensor_model_parallel_size": 1, "sequence_parallel": False},
                 "vocab_size": vocab, "trained_sequence_parallel": bool(args.sequence_parallel),
                 "tokenizer_vocab_size": tok.vocab_size, "max_position_embeddings": context,
                 "trained_tensor_model_parallel_size": tp, "tokenizer_fingerprint": tok.fingerprint}
    if rank == 0:
        dump_json(out / "resolved_deepspeed_config.json", ds_config)
        dump_json(out / "resolved_dattri_ds_config.json", cfg)
        (out / "model").mkdir(exist_ok=True)
        dump_json(out / "model" / "config.json", model_cfg)
        logger.info("megatron: TP=%d%s DP=%d, %d layers, hidden %d, vocab %d (padded from %d)",
                    ctx.tp_world, " (sequence parallel)" if args.sequence_parallel else "",
                    ctx.dp_world, kw["num_layers"], kw["hidden_size"], vocab,
                    tok.vocab_size)
    ddp = wrap_ddp(lm.model)
    clip = float(ds_config.get("gradient_clipping", 0.0))
    if torch.cuda.is_available():
        opt = megatron_optimizer(ds_config, ddp, clip)
        sched = make_schedule(ds_config, opt.optimizer)
    else:
        opt, sched = make_optimizer(ds_config, lm.parameters())
    loop = SimpleNamespace(
        lm=lm, ddp=ddp, opt=opt, sched=sched, megatron_opt=torch.cuda.is_available(),
        ctx=ctx, device=device, model_cfg=model_cfg,
        micro=int(ds_config.get("train_micro_batch_size_per_gpu", 1)),
        gas=int(ds_config.get("gradient_accumulation_steps", 1)),
        clip=clip, verify=bool(getattr(args, "verify_checkpoints", False)))
    selector = make_selector(lm, cfg, data, tok, ctx, device,
                             lambda: float(loop.opt.param_groups[0]["lr"]),
                             out / "selection.jsonl" if ctx.tp_rank == 0 else None,
                             optimizer=loop.opt)
    evaluator = make_evaluator(lm, cfg, tok, data.seq_len, ctx, device)
    summary = train(loop, cfg, data, out, tok, selector, evaluator)
    summary.update(backend="megatron", tensor_model_parallel_size=ctx.tp_world,
                   data_parallel_size=ctx.dp_world)
    if rank == 0:
        dump_json(out / "summary.json", summary)
        logger.info("done: %s", json.dumps(summary))
    return summary


def _capture(loop, cfg: RunConfig, out: Path, tok, run_id: str | None = None):
    """Capture on every rank (projections all-reduce over TP); TP rank 0 writes the store."""
    if not cfg.capture_enabled:
        return None
    from dattri_ds.integrations.megatron import MegatronAdapter, megatron_capture
    from dattri_ds.launch.train import fingerprint
    from dattri_ds.store import StoreCallback

    if cfg.capture.projection is None:
        raise ConfigError("--capture stores projected gradients: set dattri_ds.capture."
                          "projection in the DeepSpeed JSON (e.g. {\"dim\": 256})")
    ctx, cbs = loop.ctx, []
    if ctx.tp_rank == 0:  # TP ranks hold the same examples: one shard per DP rank
        cbs.append(StoreCallback(cfg.store_config(out), projection=cfg.capture.projection,
                                 fingerprint=f"{fingerprint(cfg, tok)}:megatron",
                                 rank=ctx.dp_rank, world=ctx.dp_world, capture=cfg.capture,
                                 run_id=run_id))
    adapter = MegatronAdapter(loop.lm, backward_scale=1.0 / loop.gas)
    return megatron_capture(loop.lm, cfg.capture, callbacks=cbs, adapter=adapter).attach()


def _optimizer_step(loop) -> None:
    """Synchronize (Megatron DDP), clip, step, zero the grad buffers, advance the schedule."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([loop.ddp])
    if loop.megatron_opt:
        loop.opt.step()  # clips by the global norm itself
    else:
        _main_grads_to_grad(loop.lm)
        if loop.clip > 0:
            _clip(loop.lm, loop.clip, loop.ctx)
        loop.opt.step()
    loop.opt.zero_grad(set_to_none=True)
    loop.ddp.zero_grad_buffer()
    if loop.sched is not None:
        loop.sched.step()


def train(loop, cfg: RunConfig, data, out: Path, tok, selector=None, evaluator=None) -> dict:
    """The loop of launch/train.py with a torch optimizer; hooks and the selector do the rest."""
    import torch.distributed as dist

    from dattri_ds.launch.runlog import make_run_id
    from dattri_ds.launch.train import fingerprint, micro_batch_indices, seal_captured_store

    tc, lm, ctx, micro, gas = cfg.train, loop.lm, loop.ctx, loop.micro, loop.gas
    rank = dist.get_rank()
    run_id = make_run_id(f"{fingerprint(cfg, tok)}:megatron", out)
    capture = _capture(loop, cfg, out, tok, run_id)
    n_cand = selector.num_candidates(micro) if selector is not None else micro
    ckpt_dir = out / "checkpoints"
    log = RunLog(tc, out, rank, evaluator, run_id=run_id)

    def save(tag: str, step: int, lr: float) -> None:
        save_checkpoint(lm, ckpt_dir / tag, {"tag": tag, "step": step, "lr": lr,
                                             "model": loop.model_cfg}, data, loop.verify)

    lm.train()
    for step in range(tc.steps):
        idx = micro_batch_indices(len(data), step, n_cand, gas, ctx.dp_rank, ctx.dp_world,
                                  tc.seed)
        lr = float(loop.opt.param_groups[0]["lr"])  # the lr this step uses
        step_loss = torch.zeros((), dtype=torch.float64, device=loop.device)
        for mb in range(gas):
            batch = {k: v.to(loop.device) for k, v in data.batch(idx[mb]).items()}
            doc_ids = [data.docs[i].id for i in idx[mb].tolist()]
            if selector is not None:
                sel = selector.select(batch, micro, step, user_ids=doc_ids)
                batch = sel.batch
                doc_ids = [c.split("#")[0] for c in sel.chosen_ids]
            if capture is not None:  # stored ids: "<doc id>@<step>#<content hash>"
                capture.tag([f"{d}@{step}" for d in doc_ids])
            loss = lm(**batch).loss
            (loss / gas).backward()
            step_loss += float(loss.detach()) / gas
        _optimizer_step(loop)
        if capture is not None:
            capture.adapter.step_done()
        if ctx.dp_world > 1:
            dist.all_reduce(step_loss, group=ctx.dp_group)
        log.end_step(step, float(step_loss) / ctx.dp_world, lr, micro * gas * ctx.dp_world, save)
    if capture is not None:
        capture.close()
    summary = log.summary(world=dist.get_world_size(), captured=bool(capture))
    if capture is not None:  # examples dropped for a NaN/inf gradient, over the DP ranks
        from dattri_ds.distributed import all_reduce_sum

        dropped = torch.tensor([float(capture.skipped_examples)], device=loop.device)
        all_reduce_sum(dropped, ctx.dp_group, ctx.dp_world)
        summary["capture_dropped_examples"] = int(dropped.item())
    if selector is not None:
        summary["selection"] = selector.summary()
        selector.close()
    dist.barrier()
    if capture is not None:
        seal_captured_store(cfg.store_config(out).path, rank)
    return summary
