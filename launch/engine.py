"""Which engine trains: the backend registry and ``EngineConfig`` (``dattri_ds.engine``).

``BACKENDS`` maps a ``--backend`` name to ``"module:Class"`` of its ``Backend``
(launch/backend.py), imported on use so that DeepSpeed and Megatron stay optional: a new
backend is one ``Backend`` subclass in its own file and one line here. ``EngineConfig``'s
fields are the ``"engine"`` keys of the ``"dattri_ds"`` block and, unprefixed, flags
(``--backend``, ``--tensor-model-parallel-size``, ...; launch/args.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dattri_ds.io import schema
from dattri_ds.errors import ConfigError

__all__ = ["BACKENDS", "EngineConfig"]

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
