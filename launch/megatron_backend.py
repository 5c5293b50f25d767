"""Megatron-core backend of launch/train.py: a GPTModel trained with tensor (and data) parallelism.

    torchrun --standalone --nproc_per_node 2 launch/train.py --backend megatron \
        --tensor-model-parallel-size 2 [--sequence-parallel] \
        --deepspeed_config configs/zero1_cpu.json --capture

What it reads of the DeepSpeed JSON (the rest is ignored, with a logged note), how gradients
are synchronized (Megatron's ``DistributedDataParallel`` and ``finalize_model_grads``) and
which optimizer steps (Megatron's on CUDA, the JSON's torch optimizer with a TP-aware
global-norm clip on CPU): docs/training.md. Ranks form ``world = TP x DP`` groups (pipeline
parallelism is refused); the TP ranks of one DP group train the same examples, in the data
order of the other backends. The model is ``MegatronLM`` (dattri_ds/models/megatron_gpt.py),
called like a Hugging Face model (token-mean loss over ``labels[:, 1:] != -100``).

Artifacts besides the other backends': ``<out>/model/config.json`` (``{"backend":
"megatron", "transformer_config": {...}}`` of the TP=1 model, ``vocab_size``,
``max_position_embeddings``, ``trained_tensor_model_parallel_size``, ...) and
``<out>/checkpoints/<tag>/`` in the consolidated format of
dattri_ds/integrations/megatron_checkpoint.py (TP=1-equivalent weights the offline tools
read at any TP size, and every rank's optimizer and lr-schedule state for ``--resume``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from dattri_ds.errors import ConfigError
from dattri_ds.integrations import megatron_checkpoint as ckpt
from dattri_ds.integrations.megatron_checkpoint import is_tp
from dattri_ds.launch.backend import local_device
from dattri_ds.launch.config import RunConfig, dump_json
from dattri_ds.launch.optimizer import (
    TorchOptimized, make_optimizer, make_schedule, optimizer_spec,
)
from dattri_ds.models.megatron_gpt import MegatronLM, build_gpt, cpu_workarounds

__all__ = ["MegatronBackend", "transformer_kwargs", "padded_vocab", "setup_parallel"]

logger = logging.getLogger("dattri_ds.launch")


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
    from dattri_ds.io.files import read_json
    d = model_config if isinstance(model_config, dict) else read_json(
        model_config, "model config", flag="--model-config")
    if d.get("model_type", "gpt2") != "gpt2":
        raise ConfigError(f"--backend megatron builds its own GPTModel from GPT-2 style "
                          f"configs only (model_type 'gpt2'); the model config has model_type="
                          f"'{d.get('model_type')}'. Train it with --backend deepspeed or "
                          f"--backend torch, or pass a GPT-2 config (configs/"
                          f"model_gpt2_tiny.json)")
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


# ---- optimization (the torch optimizer and schedule: launch/optimizer.py) -----------------
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

    kind, p = optimizer_spec(ds_config)
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

    grads = [(p.grad, is_tp(p)) for p in model.parameters() if p.grad is not None]
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


# ---- the backend ----------------------------------------------------------------------------
class MegatronBackend(TorchOptimized):
    """``--backend megatron``: a ``MegatronLM`` under Megatron DDP with TP x DP groups."""

    fingerprint_suffix = ":megatron"

    @classmethod
    def setup(cls, ds_config: dict, cfg: RunConfig) -> tuple[int, int]:
        tc, ec = cfg.train, cfg.engine
        tp = ec.tensor_model_parallel_size
        if tc.model_path:
            raise ConfigError("--model-path loads a Hugging Face model: --backend megatron "
                              "builds a GPTModel from --model-config; drop --model-path or use "
                              "--backend deepspeed")
        transformer_kwargs(tc.model_config, tp, ec.sequence_parallel)  # before any process
        # group: errors at start (--seq-len vs --sequence-parallel: checks.check_seq_len)
        return setup_parallel(tp, ec.pipeline_model_parallel_size)

    def __init__(self, ds_config: dict, cfg: RunConfig, tok, data) -> None:
        from dattri_ds.integrations.megatron import megatron_parallel_context, prepare_model
        from dattri_ds.launch.init_from import init_megatron_weights

        tc, tp, sp = cfg.train, cfg.engine.tensor_model_parallel_size, \
            cfg.engine.sequence_parallel
        kw, context = transformer_kwargs(tc.model_config, tp, sp)
        if data.seq_len > context:
            raise ConfigError(f"--seq-len {data.seq_len} exceeds the model context {context} "
                              f"(n_positions of {tc.model_config})")
        vocab = padded_vocab(tok.vocab_size, tp)
        self.device = local_device()
        self.model = MegatronLM(build_gpt(kw, vocab, context, tc.seed)).to(self.device)
        prepare_model(self.model)
        self.ctx = megatron_parallel_context()
        self.model_cfg = {
            "backend": "megatron", "transformer_config": {
                **kw, "tensor_model_parallel_size": 1, "sequence_parallel": False},
            "vocab_size": vocab, "trained_sequence_parallel": bool(sp),
            "tokenizer_vocab_size": tok.vocab_size, "max_position_embeddings": context,
            "trained_tensor_model_parallel_size": tp, "tokenizer_fingerprint": tok.fingerprint}
        init_megatron_weights(self.model.model, self.model_cfg, cfg)  # --init-checkpoint
        self._from_json(ds_config, "megatron")
        logger.info("megatron: TP=%d%s DP=%d, %d layers, hidden %d, vocab %d (padded from %d)",
                    self.ctx.tp_world, " (sequence parallel)" if sp else "", self.ctx.dp_world,
                    kw["num_layers"], kw["hidden_size"], vocab, tok.vocab_size)
        self.ddp = wrap_ddp(self.model.model)
        self.megatron_opt = torch.cuda.is_available()
        if self.megatron_opt:
            self._opt = megatron_optimizer(ds_config, self.ddp, self.clip)
            self.sched = make_schedule(ds_config, self._opt.optimizer)
        else:
            self._opt, self.sched = make_optimizer(ds_config, self.model.parameters())
        self.verify = cfg.engine.verify_checkpoints
        self.adapter = None  # the capture's MegatronAdapter, told of every optimizer step

    def write_model_config(self, out: Path) -> None:
        (out / "model").mkdir(exist_ok=True)
        dump_json(out / "model" / "config.json", self.model_cfg)

    def optimizer_step(self) -> None:
        """Synchronize (Megatron DDP), clip, step, zero the grad buffers, advance the schedule;
        then tell the capture a step ended."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        if not self.megatron_opt:
            _main_grads_to_grad(self.model)
            if self.clip > 0:
                _clip(self.model, self.clip, self.ctx)
        self._opt.step()  # Megatron's optimizer clips by the global norm itself
        self._opt.zero_grad(set_to_none=True)
        self.ddp.zero_grad_buffer()
        if self.sched is not None:
            self.sched.step()
        if self.adapter is not None:
            self.adapter.step_done()

    def attach_capture(self, cfg: RunConfig, callbacks: list, start_step: int):
        """Capture on every rank (projections all-reduce over TP); a rank that writes no
        store shard (TP rank > 0: TP rank 0 stores the same rows) drops its batches."""
        from dattri_ds.capture.callbacks import DropBatches
        from dattri_ds.integrations.megatron import MegatronAdapter, megatron_capture

        self.adapter = MegatronAdapter(self.model, backward_scale=1.0 / self.gas,
                                       start_step=start_step)
        return megatron_capture(self.model, cfg.capture, callbacks=callbacks or [DropBatches()],
                                adapter=self.adapter).attach()

    def selection_log(self, out: Path) -> Path | None:
        return out / "selection.jsonl" if self.ctx.tp_rank == 0 else None

    def save(self, ckpt_dir: Path, tag: str, meta: dict, data) -> None:
        import torch.distributed as dist

        ckpt.save_checkpoint(self.model, ckpt_dir / tag, {**meta, "model": self.model_cfg},
                             data, self.verify)
        ckpt.save_optimizer_state(ckpt_dir / tag, dist.get_rank(), self.layout(), self._opt,
                                  self.sched)

    def load(self, ckpt_dir: Path, tag: str) -> None:
        import torch.distributed as dist

        ckpt.load_consolidated(self.model.model, ckpt.read_consolidated(ckpt_dir / tag))
        ckpt.load_optimizer_state(ckpt_dir / tag, dist.get_rank(), self.layout(), self._opt,
                                  self.sched)

    def summary(self) -> dict:
        return {"backend": "megatron", "tensor_model_parallel_size": self.ctx.tp_world,
                "data_parallel_size": self.ctx.dp_world}
