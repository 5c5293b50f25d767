"""Adam second moments from saved checkpoints, by parameter name: DeepSpeed ZeRO-1/2/3 and
Megatron (``read_adam_state``: full, parameter-shaped fp32 ``exp_avg_sq`` with ``beta2``,
``eps`` and the step, for LESS's optimizer-aware score). How each layout is reassembled:
docs/integrations.md, "Adam moments of a checkpoint". A checkpoint without Adam moments, or
whose layout does not match the model, is a ConfigError naming the file."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dattri_ds.errors import ConfigError
from dattri_ds.io.files import check_checkpoint, load_torch, read_by

__all__ = ["AdamState", "read_adam_state", "read_deepspeed_adam", "read_megatron_adam",
           "has_adam_state"]

_FIX = "pass a checkpoint of a complete run, or copy the checkpoint again"
#: The files read here: DeepSpeed's model and optimizer states, Megatron's optimizer states.
_STATE_FILES = ("*_model_states.pt", "*_optim_states.pt", "megatron_optimizer.rank*.pt")
_NO_ADAM = ("the optimizer keeps no Adam second moments (exp_avg_sq); use --method cosine, "
            "or a checkpoint trained with Adam/AdamW")


@dataclass(frozen=True)
class AdamState:
    """Adam's second moments of one checkpoint, full and parameter-shaped.

    Attributes:
        exp_avg_sq: parameter name -> ``v`` (fp32, the parameter's shape).
        beta2, eps: the optimizer's hyper-parameters (first param group).
        step: optimizer steps taken (the bias correction's ``t``).
        source: what it was read from (``deepspeed-zero3``, ``megatron-tp2``, ...).
    """

    exp_avg_sq: dict[str, torch.Tensor]
    beta2: float
    eps: float
    step: int
    source: str


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def has_adam_state(folder: str | Path) -> bool:
    """Whether ``folder`` holds optimizer files :func:`read_adam_state` reads."""
    f = Path(folder)
    return any(f.glob("*_optim_states.pt")) or any(f.glob("megatron_optimizer.rank*.pt"))


def read_adam_state(folder: str | Path, model: nn.Module | None = None) -> AdamState:
    """The Adam moments of a checkpoint tag folder (DeepSpeed ZeRO or Megatron).

    Args:
        folder: the tag folder (``<run>/checkpoints/<tag>``).
        model: the model the tools rebuilt from that checkpoint (needed for Megatron: its
            parameter order and tensor-parallel attributes).

    Raises:
        ConfigError: no optimizer files there, no Adam moments, or a layout mismatch.
    """
    f = check_checkpoint(folder, "checkpoint", _FIX, only=_STATE_FILES)  # cut files named
    if any(f.glob("*_optim_states.pt")):
        return read_deepspeed_adam(f)
    if any(f.glob("megatron_optimizer.rank*.pt")):
        if model is None:
            raise ConfigError(f"{f}: reading Megatron optimizer state needs the model")
        return read_megatron_adam(f, model)
    raise ConfigError(f"{f} holds no optimizer state this reader knows (DeepSpeed "
                      f"*_optim_states.pt or megatron_optimizer.rank*.pt)")


def _hyper(inner: dict, path: Path) -> tuple[float, float, int]:
    groups = inner.get("param_groups") or []
    state = inner.get("state") or {}
    if not groups or "betas" not in groups[0] or not state:
        raise ConfigError(f"{path}: {_NO_ADAM}")
    first = next(iter(state.values()))
    if "exp_avg_sq" not in first:
        raise ConfigError(f"{path}: {_NO_ADAM}")
    step = first.get("step", groups[0].get("step", 0))
    return float(groups[0]["betas"][1]), float(groups[0]["eps"]), int(step)


def _load(path: Path):
    """A checkpoint's optimizer (or model) state file, through the file door (a cut or
    damaged file is named); DeepSpeed's and Megatron's states hold Python objects."""
    return load_torch(path, "optimizer state", fix=_FIX, trusted="a checkpoint tag folder",
                      mmap=True)


# ---- DeepSpeed ZeRO ----
def read_deepspeed_adam(folder: str | Path) -> AdamState:
    """Moments of a DeepSpeed ZeRO-1/2/3 tag folder (every rank's optimizer file)."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE, FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, PARTITION_COUNT,
        SINGLE_PARTITION_OF_FP32_GROUPS, ZERO_STAGE,
    )
    from deepspeed.utils import zero_to_fp32 as z

    folder = Path(folder)
    optim_files = sorted(folder.glob("*_optim_states.pt"), key=_natural)
    model_files = sorted(folder.glob("*_model_states.pt"), key=_natural)
    if not model_files:
        raise ConfigError(f"{folder}: optimizer files but no *_model_states.pt (parameter "
                          f"names and shapes): pass a complete DeepSpeed tag folder")
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), read_by(
            "DeepSpeed's zero_to_fp32", folder, "DeepSpeed checkpoint", _FIX):
        model_states = z.parse_model_states(model_files)
    moments, stage, world, hyper, paddings = [], None, None, None, None
    for path in optim_files:
        osd = _load(path)[OPTIMIZER_STATE_DICT]
        if ZERO_STAGE not in osd:
            raise ConfigError(f"{path}: not a ZeRO optimizer state (no {ZERO_STAGE})")
        stage = int(osd[ZERO_STAGE])
        count = osd[PARTITION_COUNT]
        world = max(count) if isinstance(count, (list, tuple)) else int(count)
        flats = osd[FP32_FLAT_GROUPS if stage == 3 else SINGLE_PARTITION_OF_FP32_GROUPS]
        # ZeRO-3: the inner optimizer's state_dict; ZeRO-1/2: its state_dict, or (elastic
        # checkpoints) one padding-free state per group
        inner = osd[OPTIMIZER_STATE_DICT if stage == 3 else BASE_OPTIMIZER_STATE]
        states = inner if isinstance(inner, list) else [
            (inner.get("state") or {}).get(i) for i in range(len(flats))]
        if hyper is None:
            hyper = _zero_hyper(inner, states, osd, model_files[0], path)
        rank_v = []
        for i, flat in enumerate(flats):
            st = states[i] if i < len(states) else None
            v = None if not st else st.get("exp_avg_sq")
            if v is None or v.numel() < flat.numel():
                raise ConfigError(f"{path}: sub-group {i} has no exp_avg_sq covering its "
                                  f"{flat.numel()} partition entries: {_NO_ADAM}")
            rank_v.append(v.reshape(-1)[:flat.numel()].float())  # alignment padding dropped
        moments.append(rank_v)
        paddings = osd.get("param_alignment_paddings")
    if world != len(optim_files):
        raise ConfigError(f"{folder}: {len(optim_files)} optimizer files, the checkpoint was "
                          f"written by {world} ranks: a rank's file is missing")
    if stage == 3:
        v = _zero3_merge(moments, model_states[0].param_shapes, world, folder)
    else:
        with read_by("DeepSpeed's zero_to_fp32 (the partitions do not match the model "
                     "states)", folder, "DeepSpeed checkpoint", _FIX):
            v = _zero2_merge(z, moments, model_states, world, paddings)
    for alias, name in model_states[0].shared_params:
        if name in v:
            v[alias] = v[name]
    beta2, eps, step = hyper
    return AdamState(v, beta2, eps, step, f"deepspeed-zero{stage}")


def _zero_hyper(inner, states: list, osd: dict, model_file: Path,
                path: Path) -> tuple[float, float, int]:
    """(beta2, eps, step) of a ZeRO optimizer file: its inner param groups, else (elastic
    ZeRO-1/2 files keep none) the DeepSpeed config saved with the model states."""
    if isinstance(inner, dict) and inner.get("param_groups"):
        return _hyper(inner, path)
    first = next((st for st in states if st), None)
    if first is None or "exp_avg_sq" not in first:
        raise ConfigError(f"{path}: {_NO_ADAM}")
    step = osd.get("base_optimizer_state_step", first.get("step", 0))
    cfg = (_load(model_file).get("ds_config") or {}).get("optimizer") or {}
    params = cfg.get("params") or {}
    betas = params.get("betas", (0.9, 0.999))
    return float(betas[1]), float(params.get("eps", 1e-8)), int(step)


def _zero3_merge(moments: list[list[torch.Tensor]], param_shapes, world: int,
                 folder: Path) -> dict[str, torch.Tensor]:
    """Per parameter (``param_shapes`` order), each rank's ``ceil(numel / world)`` entries
    at the same offset of its concatenated sub-groups, joined in rank order and trimmed."""
    shapes = {k: s for d in param_shapes for k, s in d.items()}
    flat = [torch.cat([t.reshape(-1) for t in rank]) for rank in moments]
    out, off = {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if off + part > flat[0].numel():
            raise ConfigError(f"{folder}: the optimizer partitions hold {flat[0].numel()} "
                              f"entries per rank, fewer than the parameters need")
        out[name] = torch.cat([r[off:off + part] for r in flat])[:numel].reshape(shape)
        off += part
    if off != flat[0].numel():
        raise ConfigError(f"{folder}: {flat[0].numel() - off} optimizer entries per rank "
                          f"left over: the model states do not describe these partitions")
    return out


def _zero2_merge(z, moments, model_states, world: int, paddings) -> dict[str, torch.Tensor]:
    """ZeRO-1/2: DeepSpeed's own reassembly of ``single_partition_of_fp32_groups``, fed the
    moments in place of the master weights."""
    import contextlib
    import inspect
    import io
    from collections import OrderedDict

    state: dict = OrderedDict()
    kw = {"param_alignment_paddings": paddings} if "param_alignment_paddings" in \
        inspect.signature(z._zero2_merge_trainable_params).parameters else {}
    with contextlib.redirect_stdout(io.StringIO()):
        z._zero2_merge_trainable_params(state, world, moments, model_states, **kw)
    return {k: v.clone() for k, v in state.items()}


# ---- Megatron ----
def read_megatron_adam(folder: str | Path, model: nn.Module) -> AdamState:
    """Moments of a ``launch/train.py --backend megatron`` tag folder, in ``model``'s
    parameter names (the TP=1 model the tools rebuild); TP shards concatenated."""
    from dattri_ds.integrations.megatron_checkpoint import is_tp

    folder = Path(folder)
    files = sorted(folder.glob("megatron_optimizer.rank*.pt"), key=_natural)
    first = _load(files[0])
    tp = int(first.get("layout", {}).get("tp", 1))
    if len(files) < tp:
        raise ConfigError(f"{folder}: {len(files)} optimizer files, fewer than the "
                          f"tensor-parallel size {tp} that wrote them")
    shards = [first["optimizer"]] + [_load(f)["optimizer"] for f in files[1:tp]]
    named = list(model.named_parameters())
    for r, sd in enumerate(shards):
        groups = sd.get("param_groups") if isinstance(sd, dict) else None
        if not groups or "state" not in sd:
            raise ConfigError(f"{files[r]}: not a torch optimizer state_dict (Megatron's own "
                              f"GPU optimizer state is not read); use --method cosine")
        n = sum(len(g["params"]) for g in groups)
        if n != len(named):
            raise ConfigError(f"{files[r]}: the optimizer has {n} parameters, the model "
                              f"{len(named)}: pass the run it was saved by")
    beta2, eps, step = _hyper(shards[0], files[0])
    order = [i for g in shards[0]["param_groups"] for i in g["params"]]
    out = {}
    for idx, (name, p) in zip(order, named):
        parts = [sd["state"].get(idx, {}).get("exp_avg_sq") for sd in shards]
        if any(v is None for v in parts):
            continue  # no gradient yet (or frozen): no preconditioning of this parameter
        v = torch.cat(parts, dim=int(p.partition_dim)) if tp > 1 and is_tp(p) else parts[0]
        if tuple(v.shape) != tuple(p.shape):
            raise ConfigError(f"{folder}: Adam moments of '{name}' have shape "
                              f"{tuple(v.shape)}, the model's parameter {tuple(p.shape)}")
        out[name] = v.float()
    return AdamState(out, beta2, eps, step, f"megatron-tp{tp}")
