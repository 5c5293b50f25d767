"""RunSpec: what a planned run does, one field per ``dattri-ds plan`` flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dattri_ds.errors import ConfigError
from dattri_ds.io import schema
from dattri_ds.ops.projection import PROJECTION_KINDS, ProjectionConfig, ProjectionKind


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What the run does: one field per ``dattri-ds plan`` flag, its docstring the flag's help."""

    world: int = field(default=1, metadata=schema.bounds(ge=1))
    """data-parallel ranks."""
    seq_len: int = field(default=512, metadata=schema.bounds(ge=1))
    """tokens per example (T)."""
    micro_batch: int = field(default=1, metadata=schema.bounds(ge=1))
    """examples per rank per forward (B)."""
    zero_stage: Literal[0, 1, 2, 3] = 3
    """DeepSpeed ZeRO stage 0-3."""
    offload: Literal["none", "optimizer", "all"] = "none"
    """``none``, ``optimizer`` or ``all`` (optimizer and parameters) to the host."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """weight dtype (``float32`` or ``bfloat16``)."""
    optimizer: Literal["adamw", "adam", "sgd", "sgd_momentum"] = "adamw"
    """``adamw``, ``sgd`` or ``sgd_momentum``."""
    capture: bool = True
    """per-example gradients are captured during training."""
    projection: str = "kronecker"
    """a projection kind (``kronecker``, ``dense``, ``sparse`` or ``auto``: per layer by
    ``ops.cost.choose_projection``)."""
    k: int = field(default=0, metadata=schema.bounds(ge=0))
    """projected size per layer (0 = recommend one)."""
    projection_cache_bytes: int = field(default=ProjectionConfig().cache_bytes,
                                        metadata=schema.bounds(ge=0))
    """the projection matrices kept per process (``ProjectionConfig.cache_bytes``); the rest
    is regenerated on use, one block at a time."""
    method: Literal["graddot", "tracin", "kfac", "ekfac", "selection"] = "graddot"
    """what the gradients feed (``graddot``/``tracin``: inner products; ``kfac``/``ekfac``:
    curvature factors; ``selection``: online selection)."""
    candidate_multiple: float = 2.0
    """candidates scored per trained example by online selection."""
    selection_probe: bool = False
    """the selection's scoring rule reads the candidates' gradients (``alignment``, ``step``: every
    candidate is forwarded and back-propagated, so their activations, capture buffers and that
    pass's time are planned); False (``content``, the default for target documents) scores their
    text only, so a step plans like a plain one."""
    examples: int = 10_000
    """rows written to the store (for its size)."""
    store_dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    """the store's element type."""
    train: bool = True
    """the run trains (optimizer, gradients); False plans a ``collect`` / attribution pass over
    frozen weights (parameters only)."""
    zero_init: bool = False
    """the model is built partitioned (``deepspeed.zero.Init``); False builds it whole in fp32 on
    every rank first (what ``launch/train.py`` does)."""
    store_budget_gb: float = 100.0
    """the store size ``k = 0`` may recommend up to."""
    reduce_bucket: float = 5e8
    """DeepSpeed's ``reduce_bucket_size`` (elements)."""
    max_live_params: float = 1e9
    """DeepSpeed's ``stage3_max_live_parameters`` (elements)."""
    prefetch_bucket: float = 5e7
    """DeepSpeed's ``stage3_prefetch_bucket_size`` (elements)."""
    sub_group_size: float = 1e9
    """DeepSpeed's ``sub_group_size`` (elements)."""

    def __post_init__(self) -> None:
        schema.check(self, "plan")
        if self.offload == "all" and self.zero_stage != 3:
            raise ConfigError("offloading parameters needs zero_stage 3")
        kind = PROJECTION_KINDS.get(self.projection)
        if kind is None or type(kind).matrix_bytes is ProjectionKind.matrix_bytes:
            raise ConfigError(f"projection must be a registered kind that sizes its matrices "
                              f"(ProjectionKind.matrix_bytes), one of "
                              f"{PROJECTION_KINDS.names()}, got '{self.projection}'")

    @property
    def weight_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def probes(self) -> bool:
        """Online selection that forwards and back-propagates every candidate (the probe)."""
        return self.method == "selection" and self.selection_probe
