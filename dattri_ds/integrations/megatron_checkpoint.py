"""The consolidated Megatron checkpoint format: written by ``launch/train.py --backend
megatron``, read by the offline tools (any TP size) and by a resumed run. Files
(``megatron_consolidated.pt`` / ``.json``, ``megatron_optimizer.rank<R>.pt``) and versions:
docs/integrations.md, "Megatron checkpoints"."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dattri_ds.distributed import all_gather_object
from dattri_ds.errors import CheckpointMismatchError, ConfigError
from dattri_ds.io.files import load_torch, read_json
from dattri_ds.io.outputs import write_failure

__all__ = ["CONSOLIDATED", "CONSOLIDATED_META", "FORMAT", "is_consolidated",
           "consolidated_state", "load_consolidated", "read_consolidated", "read_meta",
           "save_checkpoint", "save_optimizer_state", "load_optimizer_state"]

CONSOLIDATED = "megatron_consolidated.pt"
CONSOLIDATED_META = "megatron_consolidated.json"
FORMAT = "dattri_ds.megatron_consolidated"
FORMAT_VERSION = 2
CHECK_EXAMPLES = 4


def _optimizer_file(rank: int) -> str:
    return f"megatron_optimizer.rank{rank:05d}.pt"


def is_tp(p: torch.Tensor) -> bool:
    """Whether ``p`` is a tensor-parallel shard (Megatron marks it ``tensor_model_parallel``)."""
    return bool(getattr(p, "tensor_model_parallel", False))


def _tp() -> tuple[Any, int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank())


def is_consolidated(folder: str | Path) -> bool:
    """Whether ``folder`` is a checkpoint of this format."""
    return (Path(folder) / CONSOLIDATED).exists()


def consolidated_state(gpt: nn.Module) -> dict[str, torch.Tensor]:
    """The full (TP=1) state dict: TP-sharded parameters all-gathered on their partition dim.

    Collective over the tensor-parallel group (every TP rank must call it).
    """
    import torch.distributed as dist

    group, tp, _ = _tp()
    params = dict(gpt.named_parameters())
    out = {}
    for name, t in gpt.state_dict().items():
        if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
            continue
        p = params.get(name)
        if p is not None and is_tp(p) and tp > 1:
            parts = [torch.empty_like(p.data) for _ in range(tp)]
            dist.all_gather(parts, p.data.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.detach().cpu().clone()
    return out


def load_consolidated(gpt: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a consolidated state into a GPTModel of any TP size (slicing sharded params).

    Raises:
        ConfigError: names missing from the state (other than ``_extra_state``) or extra ones.
    """
    _, tp, rank = _tp()
    params = dict(gpt.named_parameters())
    local = {}
    for name, t in state.items():
        p = params.get(name)
        if p is not None and is_tp(p) and tp > 1:
            t = t.chunk(tp, dim=p.partition_dim)[rank]
        local[name] = t
    missing, unexpected = gpt.load_state_dict(local, strict=False)
    bad = [m for m in missing if not m.endswith("_extra_state")]
    if bad or unexpected:
        raise ConfigError(f"Consolidated Megatron state does not match the model: missing "
                          f"{bad[:5]}, unexpected {unexpected[:5]}")


def read_consolidated(folder: str | Path) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` full state of checkpoint ``folder`` (on the CPU).

    Raises:
        ConfigError: the folder holds no consolidated Megatron checkpoint.
    """
    path = Path(folder) / CONSOLIDATED
    if not path.exists():
        raise ConfigError(f"'{folder}' holds no {CONSOLIDATED}: pass a checkpoints/<tag> folder "
                          f"of a launch/train.py --backend megatron run")
    return load_torch(path, "Megatron consolidated weights",
                      fix="pass another checkpoint of the run (an earlier tag)")


def read_meta(folder: str | Path) -> dict:
    """The ``megatron_consolidated.json`` of checkpoint ``folder`` (read through the file
    door: a damaged file is named)."""
    return read_json(Path(folder) / CONSOLIDATED_META, "Megatron checkpoint record",
                     fix="pass another checkpoint of the run (an earlier tag)")


def _check_losses(lm: nn.Module, batch_fn: Callable[[list[int]], dict], rows: list[int]
                  ) -> list[float]:
    """Per-example mean token losses of ``rows`` (``lm`` returns ``token_losses``)."""
    device = next(lm.parameters()).device
    b = {k: v.to(device) for k, v in batch_fn(rows).items()}
    was = lm.training
    lm.eval()
    with torch.no_grad():
        out = lm(input_ids=b["input_ids"], labels=b["labels"])
    lm.train(was)
    n = (b["labels"][:, 1:] != -100).sum(1).clamp_min(1)
    return (out.token_losses.sum(1) / n).cpu().tolist()


def save_checkpoint(lm: nn.Module, path: Path, meta: dict, data, verify: bool) -> None:
    """Gather, write (global rank 0), and with ``verify`` reload and compare on every rank.

    Args:
        lm: a ``MegatronLM`` (its ``.model`` is the GPTModel).
        path: the tag folder.
        meta: recorded in ``megatron_consolidated.json``.
        data: the training examples (``len`` and ``batch(rows)``): the first
            ``CHECK_EXAMPLES`` give the recorded check losses.
        verify: every rank reloads the file and compares it with its live shard.
    """
    import torch.distributed as dist

    state = consolidated_state(lm.model)
    rows = list(range(min(CHECK_EXAMPLES, len(data))))
    meta = {**meta, "format": FORMAT, "format_version": FORMAT_VERSION,
            "check": {"rows": rows, "example_loss": _check_losses(lm, data.batch, rows)}}
    failed = None
    if dist.get_rank() == 0:  # into a folder launch/save.py renames once it is complete
        try:
            path.mkdir(parents=True, exist_ok=True)
            torch.save(state, path / CONSOLIDATED)
            (path / CONSOLIDATED_META).write_text(json.dumps(meta, indent=2, sort_keys=True)
                                                  + "\n")
        except Exception as err:  # noqa: BLE001 - a failed write is shared below
            cause = write_failure(err, path / CONSOLIDATED)
            if cause is None:
                raise
            failed = (cause.errno, cause.strerror, str(cause.filename or path / CONSOLIDATED))
    # in place of a barrier: every rank learns whether rank 0's write failed (and raises it,
    # so no rank waits for one that has given up)
    failed = all_gather_object(failed, world=dist.get_world_size())[0]
    if failed is not None:
        raise OSError(*failed)
    if verify:
        _verify(lm.model, read_consolidated(path), path)


def _verify(gpt: nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    """Every rank: its live shard equals the matching slice of the saved full tensor."""
    _, tp, rank = _tp()
    for name, p in gpt.named_parameters():
        full = saved[name]
        mine = full.chunk(tp, dim=p.partition_dim)[rank] if is_tp(p) and tp > 1 else full
        if not torch.equal(mine, p.detach().cpu()):
            raise CheckpointMismatchError(
                f"Consolidated checkpoint {path} differs from the live TP rank {rank} shard of "
                f"'{name}' right after it was written: another run wrote the same folder, or "
                f"the write was incomplete (disk full?); rerun with a fresh output folder")


def save_optimizer_state(path: Path, rank: int, layout: dict[str, int], optimizer,
                         scheduler=None) -> None:
    """Write this rank's optimizer (and lr schedule) state into tag folder ``path``.

    Args:
        rank: the global rank (one file each).
        layout: ``{"tp": ..., "dp": ...}`` of the run; a resume must match it.
        optimizer: anything with ``state_dict()`` (a torch or Megatron optimizer).
        scheduler: the lr schedule (``state_dict()``) or None.
    """
    path.mkdir(parents=True, exist_ok=True)
    state = {"layout": dict(layout), "optimizer": optimizer.state_dict(),
             "scheduler": None if scheduler is None else scheduler.state_dict()}
    torch.save(state, path / _optimizer_file(rank))


def load_optimizer_state(path: Path, rank: int, layout: dict[str, int], optimizer,
                         scheduler=None) -> None:
    """Restore what ``save_optimizer_state`` wrote for this rank.

    Raises:
        ConfigError: the folder has no optimizer state for this rank (a format-1 checkpoint,
            or one written by fewer ranks) or it was written with another TP x DP layout.
    """
    file = Path(path) / _optimizer_file(rank)
    if not file.exists():
        raise ConfigError(f"{path} has no optimizer state of rank {rank} ({file.name}): it was "
                          f"written by an older dattri-ds (weights only) or by fewer ranks; "
                          f"resume with the layout that wrote it, or start a new run from "
                          f"its weights")
    # our own file; Megatron's optimizers keep plain Python objects in their param groups
    state = load_torch(file, "Megatron optimizer state", fix="resume from an earlier "
                       "checkpoint (--resume <tag>)", trusted="a --backend megatron checkpoint")
    if state["layout"] != dict(layout):
        raise ConfigError(f"{path} was written by a run with layout {state['layout']}, this run "
                          f"has {dict(layout)}: resume with the same --tensor-model-parallel-"
                          f"size and number of processes")
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
