"""The guard: refuse at start a run that cannot fit on this machine (launch and the tools)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dattri_ds.errors import ConfigError
from dattri_ds.ops.projection import KINDS
from dattri_ds.plan.devices import DEVICES, GB, available_memory
from dattri_ds.plan.estimate import Plan, _plan_fixed
from dattri_ds.plan.shapes import ModelShape
from dattri_ds.plan.spec import RunSpec


# ---- the guard: refuse at start what cannot fit on this machine ------------------------------

#: Which RunSpec fields (and ``model``: the model's size, with its vocabulary) each memory
#: term grows with: the knobs a refusal names.
_TERM_KNOBS = {"activations": ("seq_len", "micro_batch", "candidate_multiple", "vocab"),
               "factors": ("seq_len", "micro_batch", "candidate_multiple"),
               "projections": ("k",), "kfac": ("model", "vocab"),
               "params": ("model", "vocab"), "master": ("model", "vocab"),
               "grads": ("model", "vocab"), "optimizer": ("model", "vocab"),
               "gathered": ("model",), "grad_bucket": ("model",), "init_model": ("model",),
               "optimizer_tmp": ("model",)}


@dataclass(frozen=True)
class Knob:
    """A setting the guard may name: the RunSpec field (or ``model`` / ``vocab``) it sets,
    its JSON key and flag, its value and its default (how far it moved from it ranks it)."""

    field: str
    key: str
    flag: str | None
    value: Any
    default: Any = None

    def text(self) -> str:
        flag = f" ({self.flag})" if self.flag else ""
        return f"{self.key}{flag} = {self.value}"

    def ratio(self) -> float:
        try:
            return float(self.value) / float(self.default)
        except (TypeError, ValueError, ZeroDivisionError):
            return 1.0


def check_fits(model: ModelShape, spec: RunSpec, knobs: list[Knob], *,
               device: str = "cpu", local_ranks: int = 1,
               override: str = "--skip-memory-check") -> Plan:
    """Refuse a run the planner predicts cannot fit in this machine's memory.

    The need is the plan's per-rank total (on CPU plus what is offloaded, times the
    ``local_ranks`` sharing the host); the limit is :func:`available_memory`. Only a need
    above the limit is refused (the plan's terms are upper estimates).

    Args:
        model, spec: what runs (``spec.k`` must be set: no recommendation here).
        knobs: the settings the user gave, named in the message when their terms dominate.
        device: ``cpu`` or ``cuda[:i]``.
        local_ranks: ranks of this run sharing this host's memory (CPU).
        override: the flag (and key) that skips the check, named in the message.

    Returns:
        The plan (it fits).

    Raises:
        DoesNotFitError: naming the largest term, the knobs it grows with, the need and the
            limit, and ``override``.
    """
    from dattri_ds.errors import DoesNotFitError

    cuda = device.startswith("cuda")
    base = DEVICES["h200" if cuda else "cpu"]
    limit, source = available_memory(device)
    result = _plan_fixed(model, replace(base, memory_bytes=limit), spec)
    ranks = 1 if cuda else max(local_ranks, 1)
    terms = dict(result.memory) if cuda else {**result.memory, **result.host}
    need = sum(terms.values()) * ranks
    if need <= limit:
        return result
    top = max((k for k in terms if k in _TERM_KNOBS), key=terms.get, default="activations")
    named = sorted((k for k in knobs if k.field in _TERM_KNOBS[top]), key=lambda k: -k.ratio())
    grows = ", ".join(k.text() for k in named) or "the model's size"
    per = f" ({ranks} ranks on this host)" if ranks > 1 else ""
    raise DoesNotFitError(
        f"this run needs about {need / GB:.1f} GB{per} but {limit / GB:.1f} GB is available "
        f"({source}); the largest part, {top} ({terms[top] * ranks / GB:.1f} GB), grows with "
        f"{grows}. Fix: lower {named[0].key if named else 'the model size'}, or pass "
        f"{override} to run anyway (dattri-ds plan shows every term)")


def check_tool(root: str | os.PathLike, args: Any, *, seq_len: int, examples: int,
               method: str = "graddot") -> Plan | None:
    """:func:`check_fits` for an offline tool (collect, fit, attribute) on the model in
    ``root`` (a run's ``model/config.json`` or a Hugging Face folder's ``config.json``),
    from the tool's flags: ``--batch-size`` (capped at the examples), ``--seq-len``,
    ``--projection`` / ``--projection-dim``; ``--skip-memory-check`` skips it. A model the
    planner does not know (e.g. a Megatron config) is not checked.

    Raises:
        DoesNotFitError: naming the flag, the need and the limit.
    """
    if getattr(args, "skip_memory_check", False):
        return None
    root = Path(root)
    config = root / "model/config.json" if (root / "model/config.json").is_file() \
        else root / "config.json"
    try:
        model = ModelShape.from_config(config)
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None
    batch = max(1, min(int(getattr(args, "batch_size", None) or 8), max(examples, 1)))
    k = int(getattr(args, "projection_dim", None) or 0)
    kind = getattr(args, "projection", None) or "kronecker"
    try:
        spec = RunSpec(seq_len=seq_len, micro_batch=batch, zero_stage=0, dtype="float32",
                       train=False, capture=True, projection=kind if kind in KINDS
                       else "kronecker", k=k, method=method, zero_init=True)
    except ConfigError:
        return None
    knobs = [Knob("seq_len", "--seq-len", None, seq_len, 512),
             Knob("micro_batch", "--batch-size", None, batch, 8),
             Knob("k", "--projection-dim", None, k or None, 4096)]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return check_fits(model, spec, [kn for kn in knobs if kn.value], local_ranks=local,
                      device="cpu", override="--skip-memory-check")
