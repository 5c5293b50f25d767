"""The ``Backend`` interface every training engine implements, and its lookup by ``--backend``.

``train`` (launch/loop.py) drives a ``Backend``: it builds the model and optimizer, runs
forward and backward of one micro-batch, steps the optimizer, attaches capture, and saves /
loads its own checkpoint. Backends are looked up by ``--backend`` name (``engine.backend``)
in ``BACKENDS`` (launch/engine.py: ``"name": "module:Class"``, imported on use so that
DeepSpeed and Megatron stay optional): add one by writing a ``Backend`` subclass and one
line there. ``deepspeed`` (launch/deepspeed_backend.py), ``megatron``
(launch/megatron_backend.py) and ``torch`` (launch/torch_backend.py: one plain PyTorch
process, which the demo and the selection benchmarks run through
``train.train_in_process``); the two that step a torch optimizer themselves share
``TorchOptimized`` (launch/optimizer.py).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from dattri_ds.distributed import ParallelContext
from dattri_ds.errors import ConfigError
from dattri_ds.launch.config import RunConfig
from dattri_ds.launch.engine import BACKENDS

__all__ = ["Backend", "BACKENDS", "backend_class", "local_device"]


def backend_class(name: str) -> type[Backend]:
    """The Backend class registered as ``name``.

    Raises:
        ConfigError: an unknown name.
    """
    if name not in BACKENDS:
        raise ConfigError(f"--backend {name!r} is not known; use one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


class Backend(ABC):
    """One training engine driven by ``train``.

    ``setup`` runs before any model exists (checks, then the process groups); the constructor
    builds model and optimizer, writing nothing (a refused resume leaves the run as it was);
    ``write_model_config`` then writes ``<out>/model``. Attributes every backend sets:
    ``model`` (called like a Hugging Face causal LM: ``model(**batch).loss``; what capture,
    selection and evaluation use), ``ctx`` (data- and tensor-parallel groups), ``device``,
    ``micro`` (examples per micro-batch and rank) and ``gas`` (micro-batches per step).
    """

    #: Appended to the run fingerprint in stores (stores of two backends never mix).
    fingerprint_suffix: ClassVar[str] = ""
    #: ``backward_reused`` back-propagates a loss the selector computed from the candidates'
    #: forward (``selection.reuse_forward``); backends without it forward the chosen again.
    reuses_selection_forward: ClassVar[bool] = False
    #: The ZeRO stage of the engine (DeepSpeed sets it; recorded in checkpoints).
    zero_stage: int | None = None

    model: nn.Module
    ctx: ParallelContext
    device: torch.device
    micro: int
    gas: int

    @classmethod
    @abstractmethod
    def setup(cls, ds_config: dict, cfg: RunConfig) -> tuple[int, int]:
        """Check the settings (``cfg.engine``, the DeepSpeed JSON), start the process groups; return ``(global rank, world size)``."""

    @abstractmethod
    def __init__(self, ds_config: dict, cfg: RunConfig, tok, data) -> None:
        """Build model and optimizer on this rank (nothing written yet)."""

    def write_model_config(self, out: Path) -> None:
        """Rank 0: what the offline tools need to rebuild the model, in ``<out>/model``
        (default: the Hugging Face model's ``config.json``)."""
        self.model.config.save_pretrained(str(out / "model"))

    @property
    @abstractmethod
    def optimizer(self) -> Any:
        """The optimizer (read by ``--selection-precondition adam``)."""

    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""

    @abstractmethod
    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one micro-batch (``1 / gas`` of the step); its loss."""

    def backward_reused(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of one micro-batch whose forward the selector already ran; its loss."""
        raise NotImplementedError(f"{type(self).__name__} does not train on reused forwards")

    @abstractmethod
    def optimizer_step(self) -> None:
        """After the ``gas`` micro-batches of a step: synchronize, clip, step, zero."""

    @abstractmethod
    def attach_capture(self, cfg: RunConfig, callbacks: list, start_step: int):
        """An attached GradientCapture on ``model`` writing to ``callbacks``, its step count
        starting at ``start_step``."""

    @abstractmethod
    def save(self, ckpt_dir: Path, tag: str, meta: dict, data) -> None:
        """Write checkpoint ``ckpt_dir/tag`` (collective; ``tag`` is the temporary name of
        launch/save.py, renamed once every rank is done); ``meta`` has tag, step and lr.

        A file this rank fails to write is raised only after the save's own collectives
        (``launch.save.held_write_failures``, or an agreement in their place, as the
        Megatron save does), so no peer is left waiting in one; launch/save.py then tells
        every rank."""

    @abstractmethod
    def load(self, ckpt_dir: Path, tag: str) -> None:
        """Restore weights, optimizer and lr schedule from ``ckpt_dir/tag`` (collective).

        Raises:
            ConfigError: the checkpoint cannot be resumed by this run.
        """

    def check_selection(self) -> None:
        """Refuse, at start, an engine online selection cannot drive (default: accept)."""

    def selection_log(self, out: Path) -> Path | None:
        """Where this rank logs its selections (None: it does not)."""
        return out / "selection.jsonl"

    def store_writer(self) -> bool:
        """Whether this rank writes a store shard (ranks holding the same examples write one)."""
        return self.ctx.tp_rank == 0

    def layout(self) -> dict[str, int]:
        """The process layout a checkpoint of this run can be resumed with."""
        return {"dp": self.ctx.dp_world, "tp": self.ctx.tp_world}

    def load_resharded(self, ckpt_dir: Path, tag: str, saved: dict[str, int]) -> None:
        """Restore weights, optimizer and lr schedule from ``ckpt_dir/tag``, written with the
        process layout ``saved`` (another data-parallel world size: an elastic resume) or
        another ZeRO stage (``check_resume`` refuses what cannot be converted).

        Raises:
            ConfigError: this backend resumes only on the layout that wrote the checkpoint.
        """
        raise ConfigError(f"--resume {tag}: the checkpoint was written with the process "
                          f"layout {saved}, this run has {self.layout()}, and "
                          f"{type(self).__name__} resumes only on the layout that wrote it: "
                          f"resume with the same number of processes and parallel sizes "
                          f"(elastic resume onto another world size runs on --backend "
                          f"deepspeed)")

    def summary(self) -> dict:
        """Backend-specific fields of ``summary.json``."""
        return {}


def local_device() -> torch.device:
    """This process's CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
