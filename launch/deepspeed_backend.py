"""DeepSpeed backend of launch/train.py: a Hugging Face causal LM in a DeepSpeed engine (ZeRO 0-3).

The DeepSpeed JSON configures the engine (``"dattri_ds"`` removed first). Checkpoints are
DeepSpeed's own (``engine.save_checkpoint``: weights, optimizer and lr schedule, sharded as
the ZeRO stage shards them; ``client_state`` holds step and lr), which the offline tools
consolidate with ``zero_to_fp32``; a resume loads them with ``engine.load_checkpoint``. A
resume on another data-parallel world size (elastic, docs/multinode.md) converts the
checkpoint once to DeepSpeed's universal format (``ds_to_universal``, into
``checkpoints/<tag>/universal/``) and loads that, resharding weights and optimizer moments
over the new ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import ConfigError
from dattri_ds.launch.config import RunConfig
from dattri_ds.launch.backend import Backend
from dattri_ds.launch.save import held_write_failures

__all__ = ["DeepSpeedBackend", "setup_distributed", "build", "to_universal"]


def setup_distributed() -> tuple[int, int]:
    """Initialize torch.distributed through DeepSpeed (gloo on CPU); works single-process."""
    import importlib

    import deepspeed

    from dattri_ds.distributed import default_rendezvous_env

    default_rendezvous_env()
    cuda = torch.cuda.is_available()
    if not cuda:  # gloo needs no shm op; skip its JIT build
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def build(cfg: RunConfig, tok):
    """The Hugging Face causal LM of ``cfg.train`` (any ``AutoModelForCausalLM`` type):
    loaded from ``model_path`` or built from ``model_config`` (random init, seeded); with
    capture or online selection on, a model with a layer capture cannot read is refused."""
    from dattri_ds.models.causal_lm import build_model
    from dattri_ds.models.causal_lm import check_capturable, load_model_config

    if cfg.train.model_path:
        from transformers import AutoModelForCausalLM
        from dattri_ds.io.files import model_dir
        folder = model_dir(cfg.train.model_path, "--model-path")
        load_model_config(folder / "config.json")  # a causal LM, else one line naming it
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    else:
        model = build_model(cfg.train.model_config, tokenizer=tok, seed=cfg.train.seed)
    if cfg.capture_enabled or cfg.selection.enabled:
        check_capturable(model)
    return model


class DeepSpeedBackend(Backend):
    """``--backend deepspeed`` (the default)."""

    @classmethod
    def setup(cls, ds_config: dict, cfg: RunConfig) -> tuple[int, int]:
        return setup_distributed()  # parallel sizes other than 1: refused by EngineConfig

    def __init__(self, ds_config: dict, cfg: RunConfig, tok, data) -> None:
        import deepspeed

        from dattri_ds.launch.init_from import init_hf_weights

        model = build(cfg, tok)
        init_hf_weights(model, cfg)  # --init-checkpoint: an earlier run's weights
        # recorded in every checkpoint: what ds_to_universal needs to convert a ZeRO-1/2 one
        # (no tensor-parallel patterns: the model is whole on each rank)
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_VERSION_VALUE as version
        model.universal_checkpoint_info = {"universal_checkpoint_version": version}
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=ds_config)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.model = self.engine.module
        self.ctx = ParallelContext(dp_rank=rank, dp_world=world)
        self.device = self.engine.device
        self.micro = self.engine.train_micro_batch_size_per_gpu()
        self.gas = self.engine.gradient_accumulation_steps()
        self.zero_stage = int(self.engine.zero_optimization_stage())

    @property
    def optimizer(self):
        return self.engine.optimizer

    def lr(self) -> float:
        if self.engine.lr_scheduler is not None:
            return float(self.engine.get_lr()[0])
        return float(self.engine.optimizer.param_groups[0]["lr"])

    reuses_selection_forward = True

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.backward_reused(self.engine(**batch).loss)

    def backward_reused(self, loss: torch.Tensor) -> torch.Tensor:
        self.engine.backward(loss)
        self.engine.step()  # a real step only at the accumulation boundary
        return loss.detach()

    def optimizer_step(self) -> None:
        """Nothing: ``engine.step()`` of the last micro-batch stepped."""

    def attach_capture(self, cfg: RunConfig, callbacks: list, start_step: int):
        from dattri_ds import GradientCapture

        # the engine counts its own steps (restored by load_checkpoint)
        return GradientCapture.for_engine(self.engine, cfg.capture,
                                          callbacks=callbacks).attach()

    def check_selection(self) -> None:
        from dattri_ds.selection import check_engine_supported

        check_engine_supported(self.engine)

    def save(self, ckpt_dir: Path, tag: str, meta: dict, data) -> None:
        # ``latest`` is written by launch/save.py once the folder is complete and renamed;
        # a file this rank fails to write is raised after DeepSpeed's closing barrier
        with held_write_failures(self.engine.checkpoint_engine):
            self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=dict(meta),
                                        save_latest=False)

    def load_resharded(self, ckpt_dir: Path, tag: str, saved: dict[str, int]) -> None:
        """Elastic resume (or ZeRO stage 1 <-> 2): ``checkpoints/<tag>`` (written on
        ``saved["dp"]`` ranks) converted to a universal checkpoint by rank 0 (kept for later
        resumes), then loaded by every rank with ``checkpoint.load_universal`` (weights, fp32
        master copy, Adam moments and step, lr schedule; DeepSpeed reshards them over this
        run's ranks and stage)."""
        import torch.distributed as dist

        universal = ckpt_dir / tag / "universal"
        failed, reason = torch.zeros(1), ""
        if dist.get_rank() == 0 and not (universal / tag / "zero").is_dir():
            try:
                to_universal(ckpt_dir / tag, universal / tag)
            except Exception as err:  # noqa: BLE001 - every rank raises below
                failed += 1
                reason = f"{type(err).__name__}: {err}"
        dist.all_reduce(failed)
        if failed.item():
            raise ConfigError(
                f"--resume {tag}: the checkpoint was written on {saved['dp']} data-parallel "
                f"ranks and this run has {self.ctx.dp_world} (ZeRO stage {self.zero_stage}); "
                f"converting it to DeepSpeed's universal checkpoint failed"
                + (f" ({reason})" if dist.get_rank() == 0 else "")
                + "; a ZeRO-1/2 checkpoint written before dattri-ds recorded its "
                  "universal_checkpoint_info cannot be converted: resume with the number of "
                  "processes that wrote it")
        config = self.engine._config  # DeepSpeed reads the flag per call; no public setter
        config.load_universal_checkpoint = True
        try:
            self.load(universal, tag)
        finally:
            config.load_universal_checkpoint = False

    def load(self, ckpt_dir: Path, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(str(ckpt_dir), tag=tag)
        if path is None:
            raise ConfigError(f"DeepSpeed could not load checkpoint '{tag}' from {ckpt_dir}; "
                              f"resume with the configuration and number of processes that "
                              f"wrote it")


def to_universal(folder: Path, out: Path) -> None:
    """Convert the DeepSpeed checkpoint ``folder`` (any ZeRO stage) to a universal checkpoint
    in ``out`` (written beside, then renamed: a crash leaves no half folder under ``out``).
    DeepSpeed's converter prints its progress; it goes to the debug log."""
    import contextlib
    import io
    import logging
    import shutil
    import types

    from deepspeed.checkpoint.ds_to_universal import main as convert

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    args = types.SimpleNamespace(input_folder=str(folder), output_folder=str(tmp),
                                 num_extract_workers=1, num_merge_workers=1,
                                 keep_temp_folder=False, strict=True, inject_missing_state=False)
    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter):
        convert(args)
    logging.getLogger("dattri_ds.launch").debug("ds_to_universal %s:\n%s", folder,
                                                chatter.getvalue())
    tmp.replace(out)
