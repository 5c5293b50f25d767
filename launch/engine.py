"""Which engine trains, on how many ranks, with which batch: ``BACKENDS``, ``EngineConfig``.

``BACKENDS`` maps a ``--backend`` name to ``"module:Class"`` of its ``Backend``
(launch/backend.py), imported on use so that DeepSpeed and Megatron stay optional: a new
backend is one ``Backend`` subclass in its own file and one line here. ``EngineConfig``'s
fields are the ``"engine"`` keys of the ``"dattri_ds"`` block and, unprefixed, flags
(``--backend``, ``--tensor-model-parallel-size``, ...; launch/args.py).
``data_parallel_world`` is the data-parallel size of a launch before any process group, and
``resolve_batch`` DeepSpeed's batch rule every backend trains by (checked at start by
launch/checks.py ``check_deepspeed_json``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from dattri_ds.io import schema
from dattri_ds.errors import ConfigError

__all__ = ["BACKENDS", "EngineConfig", "data_parallel_world", "BATCH_KEYS", "resolve_batch"]

#: ``--backend`` name -> ``"module:Class"`` of its Backend (imported on use).
BACKENDS: dict[str, str] = {
    "deepspeed": "dattri_ds.launch.deepspeed_backend:DeepSpeedBackend",
    "megatron": "dattri_ds.launch.megatron_backend:MegatronBackend",
    "torch": "dattri_ds.launch.torch_backend:TorchBackend",
}

_WHERE = "dattri_ds.engine"


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The training engine of launch/train.py and its parallel layout."""

    backend: str = "deepspeed"
    """deepspeed: a DeepSpeed engine on a Hugging Face model (ZeRO 0-3); megatron: a
    Megatron-core GPTModel with tensor parallelism and a torch optimizer; torch: one plain
    PyTorch process, no DeepSpeed engine (the DeepSpeed JSON still gives the dattri_ds block,
    batch sizes, clipping, optimizer and scheduler)."""

    tensor_model_parallel_size: int = field(default=1, metadata=schema.bounds(ge=1))
    """megatron: tensor-parallel size (must divide the number of processes, hidden size,
    heads and FFN size)."""

    sequence_parallel: bool = False
    """megatron: Megatron sequence parallelism (needs TP > 1 and a sequence length divisible
    by it)."""

    pipeline_model_parallel_size: int = field(default=1, metadata=schema.bounds(ge=1))
    """megatron: only 1 is supported (refused otherwise)."""

    verify_checkpoints: bool = False
    """megatron: reload each consolidated checkpoint on every rank and check it equals the
    live tensor-parallel shards."""

    def __post_init__(self) -> None:
        schema.check(self, _WHERE)
        if self.backend not in BACKENDS:
            raise ConfigError(f"{_WHERE}.backend (--backend) = {self.backend!r} is not known; "
                              f"use one of {sorted(BACKENDS)}")
        if self.backend != "megatron" and (self.tensor_model_parallel_size != 1
                                           or self.pipeline_model_parallel_size != 1
                                           or self.sequence_parallel
                                           or self.verify_checkpoints):
            raise ConfigError(f"--tensor-model-parallel-size "
                              f"{self.tensor_model_parallel_size}, "
                              f"--pipeline-model-parallel-size "
                              f"{self.pipeline_model_parallel_size}, --sequence-parallel "
                              f"{str(self.sequence_parallel).lower()} and "
                              f"--verify-checkpoints {str(self.verify_checkpoints).lower()} "
                              f"({_WHERE}.*) need --backend megatron (got --backend "
                              f"{self.backend}); drop them or pass --backend megatron")


def data_parallel_world(ec: EngineConfig) -> int:
    """The data-parallel ranks of this launch, before any process group: ``WORLD_SIZE`` (set by
    every launcher; 1 without one) over the tensor-parallel size.

    Raises:
        ConfigError: ``--backend torch`` under a launcher, or a tensor-parallel size that
            does not divide the processes.
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if ec.backend == "torch" and world != 1:
        raise ConfigError(f"--backend torch trains in one process, but WORLD_SIZE={world}: "
                          f"run `python launch/train.py --backend torch ...` (no torchrun or "
                          f"deepspeed launcher), or use --backend deepspeed")
    if world % ec.tensor_model_parallel_size:
        raise ConfigError(f"--tensor-model-parallel-size {ec.tensor_model_parallel_size} must "
                          f"divide the number of processes ({world}); e.g. torchrun "
                          f"--nproc_per_node {ec.tensor_model_parallel_size}")
    return world // ec.tensor_model_parallel_size


#: DeepSpeed's three batch keys, in the order of its rule train = micro x accumulation x world.
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_batch(ds: dict[str, Any], world: int, source: str) -> tuple[int, int, int]:
    """``(train_batch_size, micro-batch, accumulation)`` of the DeepSpeed JSON ``ds`` on
    ``world`` data-parallel ranks, by DeepSpeed's own rule (``DeepSpeedConfig.
    _set_batch_related_parameters`` then ``_batch_assertion``, branch for branch): the keys
    left out are derived from the ones given (accumulation = train // micro // world; micro =
    train // world // accumulation; train = micro x accumulation x world; with train alone,
    accumulation 1; with micro alone, accumulation 1), then train = micro x accumulation x
    world must hold with every value >= 1. Every backend trains by it.

    Raises:
        ConfigError: one line naming ``source``, the three keys and their values (derived
            ones marked), the world size and the fix.
    """
    given = {k: ds.get(k) for k in BATCH_KEYS}
    for k, v in given.items():
        if v is not None and (type(v) is not int or v < 1):
            raise ConfigError(f"{source}: {k} = {json.dumps(v)} is not allowed: expected a "
                              f"positive integer (or leave it out and DeepSpeed derives it). "
                              f"Fix: e.g. \"{k}\": {4 if 'micro' in k else 1 if 'acc' in k else 8}")
    train, micro, gas = given.values()
    if train is not None and micro is not None and gas is None:
        gas = train // micro // world
    elif train is not None and gas is not None and micro is None:
        micro = train // world // gas
    elif micro is not None and gas is not None and train is None:
        train = micro * gas * world
    elif train is not None and micro is None and gas is None:
        micro, gas = train // world, 1
    elif micro is not None and train is None:
        train, gas = micro * world, 1
    elif train is None:
        raise ConfigError(f"{source} sets neither train_batch_size nor "
                          f"train_micro_batch_size_per_gpu; DeepSpeed needs one of them. Fix: "
                          f"add e.g. \"train_micro_batch_size_per_gpu\": 4 (examples per rank "
                          f"and micro-batch)")
    if micro >= 1 and gas >= 1 and train == micro * gas * world:
        return train, micro, gas
    shown = ", ".join(f"{k} {v}" + ("" if given[k] is not None else " (derived)")
                      for k, v in zip(BATCH_KEYS, (train, micro, gas)))
    step = (micro if given["train_micro_batch_size_per_gpu"] is not None else 1) * \
        (gas if given["gradient_accumulation_steps"] is not None else 1) * world
    fix = (f"set train_batch_size to {micro * gas * world}, or leave one of the three keys "
           f"out and DeepSpeed derives it" if None not in given.values() else
           f"make train_batch_size a multiple of {step} "
           f"(e.g. {max(1, round(train / step)) * step})")
    raise ConfigError(f"{source}: the batch keys do not fit {world} data-parallel rank(s): "
                      f"{shown}; DeepSpeed needs train_batch_size = "
                      f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world "
                      f"size, each >= 1 ({micro} x {gas} x {world} = {micro * gas * world}). "
                      f"Fix: {fix}, or run on another number of processes")
