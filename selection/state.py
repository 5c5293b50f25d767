"""Selector state in checkpoints, restored by ``--resume`` so a resumed run chooses what the
uninterrupted one would (docs/training.md: what is saved and why).

``selector_state`` holds one ``state_dict()`` per stateful component
(``OnlineSelector.components``, and the rank stages), plain data for
``torch.load(weights_only=True)``; cached target rows are saved, not recomputed. The log is
continued (``log_lines_before``); a resume under another selection config is refused
(``config_difference``)."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.gradient import Dense, GradBatch, LayerGrad, ShardInfo
from dattri_ds.layers import get_kind
from dattri_ds.io.outputs import write_atomic

__all__ = ["FORMAT_VERSION", "grad_batch_state", "grad_batch_from_state", "selector_state",
           "load_selector_state", "config_difference", "log_lines_before",
           "SelectionCheckpoint"]

FORMAT_VERSION = 2
"""Version of the state layout (a checkpoint of another version is refused)."""


# ---- cached gradients ---------------------------------------------------------------------

def grad_batch_state(batch: GradBatch | None) -> dict | None:
    """A dense GradBatch (a target's cached rows) as plain data; None stays None."""
    if batch is None:
        return None
    layers = []
    for name, lg in batch.layers.items():
        if not isinstance(lg.data, Dense):
            raise TypeError(f"Layer '{name}': only dense target rows are saved, got "
                            f"{type(lg.data).__name__}")
        sh = lg.shard
        layers.append({
            "name": name, "kind": lg.kind_name, "shape": list(lg.shape),
            "projection": lg.projection, "values": lg.data.values.detach().clone(),
            "shard": None if sh is None else {"dim": sh.dim, "rank": sh.rank,
                                              "world": sh.world,
                                              "full_shape": list(sh.full_shape),
                                              "offset": sh.offset}})
    device = str(next(iter(batch.layers.values())).device) if batch.layers else "cpu"
    return {"step": batch.step, "sample_ids": list(batch.sample_ids),
            "micro_batch": batch.micro_batch, "device": device, "layers": layers}


def grad_batch_from_state(state: dict | None,
                          layers: Mapping[str, tuple[Any, Any]] | None = None
                          ) -> GradBatch | None:
    """The GradBatch ``grad_batch_state`` wrote, on the device it was on.

    ``layers`` (a capture's ``name -> (module, kind)``) gives sharded layers their process
    group back (``kind.shard_info(module)``); without it a shard has no group.
    """
    if state is None:
        return None
    device = state["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    out = {}
    for d in state["layers"]:
        shard = None
        if d["shard"] is not None:
            s = d["shard"]
            shard = ShardInfo(s["dim"], s["rank"], s["world"], tuple(s["full_shape"]),
                              s["offset"])
            if layers is not None and d["name"] in layers:
                module, kind = layers[d["name"]]
                shard = kind.shard_info(module) or shard
        out[d["name"]] = LayerGrad(d["name"], get_kind(d["kind"]), Dense(d["values"].to(device)),
                                   tuple(d["shape"]), d["projection"], shard)
    return GradBatch(step=int(state["step"]), sample_ids=tuple(state["sample_ids"]),
                     layers=out, micro_batch=int(state["micro_batch"]))


# ---- the selector --------------------------------------------------------------------------

def _component_state(obj: Any) -> Any:
    """``obj.state_dict()``; else its ``prior`` and ``stats`` (a score or a shortlist that
    keeps a content prior); None for no object."""
    if obj is None:
        return None
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    out = {}
    if hasattr(getattr(obj, "prior", None), "state_dict"):
        out["prior"] = obj.prior.state_dict()
    if isinstance(getattr(obj, "stats", None), dict):
        out["stats"] = dict(obj.stats)
    return out


def _load_component(obj: Any, state: Any, name: str) -> None:
    if obj is None or state is None:
        if (obj is None) != (state is None):
            have = "has" if obj is not None else "has no"
            raise ConfigError(f"The checkpoint's selection state does not fit this selector: "
                              f"this run {have} a '{name}' stage and the checkpoint the "
                              f"opposite; resume with the selection settings that wrote it")
        return
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
        return
    if "prior" in state:
        obj.prior.load_state_dict(state["prior"])
    if "stats" in state:
        obj.stats.clear()
        obj.stats.update(state["stats"])


def selector_state(selector: Any) -> dict:
    """``OnlineSelector.state_dict()``: every component's state.

    Flushes the selector's log to disk, so the log holds every step the checkpoint has.
    """
    selector.log.flush()
    state = {"format": FORMAT_VERSION,
             "rankers": [_component_state(r) for r in selector.rankers]}
    for name, obj in selector.components().items():
        state[name] = _component_state(obj)
    return state


def load_selector_state(selector: Any, state: dict, log: Sequence[str] = ()) -> None:
    """``OnlineSelector.load_state_dict``: restore every component and continue the log
    with ``log`` (the lines of the steps before the resumed one).

    Raises:
        ConfigError: a state of another format, or one that does not fit the selector's
            stages (written under other selection settings).
    """
    if state.get("format") != FORMAT_VERSION:
        raise ConfigError(f"The checkpoint's selection state has format "
                          f"{state.get('format')}, this dattri-ds reads {FORMAT_VERSION}: "
                          f"resume with the dattri-ds that wrote it or start a fresh run")
    ranks = selector.rankers
    if len(state["rankers"]) != len(ranks):
        raise ConfigError(f"The checkpoint's selection state has {len(state['rankers'])} rank "
                          f"stage(s), this selector {len(ranks)}: resume with the selection "
                          f"settings that wrote it")
    for name, obj in selector.components().items():
        _load_component(obj, state.get(name), name)
    for stage, s in zip(ranks, state["rankers"]):
        _load_component(stage, s, type(stage).__name__)
    selector.log.resume(log)


# ---- the checkpoint files ------------------------------------------------------------------

def config_difference(saved: Mapping, now: Mapping, prefix: str = "selection") -> \
        tuple[str, Any, Any] | None:
    """The first key (dotted, sorted order) whose value differs between two resolved
    configs: ``(key, saved value, value now)``; None when they are equal."""
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "<unset>"), now.get(key, "<unset>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            got = config_difference(a, b, f"{prefix}.{key}")
            if got is not None:
                return got
        elif a != b:
            return f"{prefix}.{key}", a, b
    return None


def log_lines_before(path: Path | None, step: int) -> list[str]:
    """The lines of a selection log whose records are of steps before ``step`` (the records
    a resumed run keeps; a torn last line is dropped). Missing file: ``[]``."""
    if path is None:
        return []
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except FileNotFoundError:
        return []
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        if int(rec["step"]) < step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


@dataclass(frozen=True)
class SelectionCheckpoint:
    """The selector's part of a checkpoint, one per rank (``selection_state.rank<R>.pt``),
    plus the resolved selection config (``selection_config.json``, rank 0).

    Attributes:
        state: ``OnlineSelector.state_dict()`` of this rank.
        log: this rank's selection-log lines of the steps before the resumed one (read
            before the resumed selector rewrites its log).
    """

    state: dict
    log: tuple[str, ...] = field(default=())

    FILE: ClassVar[str] = "selection_state.rank{rank:05d}.pt"
    CONFIG: ClassVar[str] = "selection_config.json"

    @classmethod
    def write(cls, folder: Path, rank: int, state: dict, config: dict | None = None) -> None:
        """Write this rank's ``state`` (and, given, the resolved selection ``config``)."""
        buf = io.BytesIO()
        torch.save(state, buf)
        write_atomic(folder / cls.FILE.format(rank=rank), buf.getvalue())
        if config is not None:
            write_atomic(folder / cls.CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def config_of(cls, folder: Path) -> dict | None:
        """The resolved selection config a checkpoint was written with (None: written
        without online selection)."""
        path = folder / cls.CONFIG
        if not path.exists():
            return None
        from dattri_ds.io.files import read_json

        return read_json(path, "checkpoint selection config", flag="train.resume")

    @classmethod
    def read(cls, folder: Path, rank: int, log: Sequence[str] = ()) -> SelectionCheckpoint:
        """This rank's selector state of a checkpoint written with selection.

        Raises:
            ConfigError: this rank's state is missing, truncated or damaged.
        """
        from dattri_ds.io.files import load_torch

        path = folder / cls.FILE.format(rank=rank)
        if not path.exists():
            raise ConfigError(f"{folder} has no selection state of rank {rank} ({path.name}) "
                              f"although it was written with online selection: resume with "
                              f"the number of processes that wrote it")
        state = load_torch(path, "selection state", fix="resume from a checkpoint written "
                           "by a complete save (--resume <an earlier tag>)")
        return cls(state=state, log=tuple(log))
