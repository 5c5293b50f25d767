"""ParallelContext: explicit data/tensor-parallel groups and reductions that no-op at world 1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import os
import socket

import torch
import torch.distributed as dist

__all__ = ["ParallelContext", "all_reduce_sum", "all_gather_object", "default_rendezvous_env"]


@dataclass(frozen=True)
class ParallelContext:
    """Which processes share what.

    Attributes:
        dp_rank / dp_world: this process's index and the size of its data-parallel group
            (processes holding different examples).
        dp_group: the data-parallel process group (None = default group or single process).
        tp_rank / tp_world / tp_group: tensor-parallel group (processes holding shards of
            the same layers); world 1 when layers are not sharded.
    """

    dp_rank: int = 0
    dp_world: int = 1
    dp_group: Any = None
    tp_rank: int = 0
    tp_world: int = 1
    tp_group: Any = None

    @staticmethod
    def from_default_group() -> ParallelContext:
        """Data parallel over every process of the default group (or a single process)."""
        if dist.is_available() and dist.is_initialized():
            return ParallelContext(dp_rank=dist.get_rank(), dp_world=dist.get_world_size())
        return ParallelContext()


def all_reduce_sum(t: torch.Tensor, group: Any = None, world: int = 1) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place and return it; nothing happens at world 1."""
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_object(obj: Any, group: Any = None, world: int = 1) -> list[Any]:
    """Every rank's ``obj`` in rank order (``[obj]`` at world 1)."""
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def default_rendezvous_env() -> None:
    """Fill RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for a single process (a free
    loopback port) where no launcher set them, so ``init_process_group`` works alike under
    ``deepspeed``, ``torchrun`` and plain ``python``."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
