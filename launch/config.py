"""The ``"dattri_ds"`` block of a DeepSpeed JSON: parsed, validated, merged with flags, dumped.

The DeepSpeed JSON in configs/ stays valid DeepSpeed: launch pops our block before
``deepspeed.initialize``. Unknown keys are errors that list the allowed ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any

from dattri_ds.config import CaptureConfig, from_dict
from dattri_ds.errors import ConfigError
from dattri_ds.selection import SelectionConfig
from dattri_ds.store import StoreConfig

__all__ = ["TrainConfig", "RunConfig", "load_run_config", "dump_json"]

BLOCK = "dattri_ds"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What launch/train.py trains on (flags override these)."""

    model_config: str = "configs/model_gpt2_tiny.json"
    """JSON model config (random init), ignored when ``model_path`` is set."""

    model_path: str | None = None
    """A local Hugging Face model directory to start from (never downloaded)."""

    train_data: tuple[str, ...] = ("data/corpus/train.jsonl",)
    """jsonl files with a ``text`` field."""

    max_docs: int | None = None
    """Use only the first N documents (the corpus order is already mixed)."""

    seq_len: int = 128
    """Tokens per example (documents are truncated or padded)."""

    vocab_size: int = 1024
    """SentencePiece vocabulary trained on the training texts (cached)."""

    steps: int = 200
    """Optimizer steps."""

    seed: int = 0
    """Seed of model init and data order."""

    save_every: int = 0
    """Save a DeepSpeed checkpoint every N steps (0 = only at the end)."""

    log_every: int = 10
    """Log loss and examples/s every N steps."""

    eval_data: str | None = None
    """jsonl of held-out texts whose loss is tracked (None = selection.target_data)."""

    eval_skip: int = 64
    """Skip the first N eval documents (by default those are the selection target set)."""

    eval_max_docs: int = 64
    """Evaluate on at most N documents."""

    eval_every: int = 0
    """Evaluate the held-out loss every N steps (0 = never)."""

    max_nonfinite_steps: int = 3
    """Fail the run (non-zero exit, ``summary.json`` says why) after this many consecutive
    optimizer steps with a NaN/inf loss; 0 = never fail (non-finite steps are only counted
    and warned about)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_data", tuple(self.train_data) if not isinstance(
            self.train_data, str) else (self.train_data,))
        for name in ("seq_len", "vocab_size", "steps", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.save_every < 0:
            raise ConfigError(f"train.save_every must be >= 0, got {self.save_every}")
        if isinstance(self.max_nonfinite_steps, bool) or not isinstance(
                self.max_nonfinite_steps, int) or self.max_nonfinite_steps < 0:
            raise ConfigError(f"train.max_nonfinite_steps must be an integer >= 0 (0 = never "
                              f"fail), got {self.max_nonfinite_steps!r}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything in the ``"dattri_ds"`` block."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Model, data and schedule."""

    capture: CaptureConfig = field(default_factory=CaptureConfig)
    """Per-example gradient capture during training (enabled by ``--capture``)."""

    store: dict[str, Any] = field(default_factory=dict)
    """StoreConfig fields; ``path`` defaults to ``<out>/grad_store``."""

    capture_enabled: bool = False
    """Capture per-example gradients of the training stream into the store."""

    selection: SelectionConfig = field(default_factory=SelectionConfig)
    """Online data selection (enabled by ``--online-selection``)."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        d = dict(d)
        allowed = ("train", "capture", "store", "capture_enabled", "selection")
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise ConfigError(f"Unknown key(s) {unknown} in the '{BLOCK}' block; allowed keys: "
                              f"{list(allowed)}")
        train = from_dict(TrainConfig, d.get("train", {}), f"{BLOCK}.train")
        capture = CaptureConfig.from_dict(d.get("capture", {}))
        store = dict(d.get("store", {}))
        StoreConfig.from_dict({"path": "x", **store})  # validate keys and values now
        selection = SelectionConfig.from_dict(d.get("selection", {}))
        return cls(train=train, capture=capture, store=store,
                   capture_enabled=bool(d.get("capture_enabled", False)), selection=selection)

    def store_config(self, out: Path) -> StoreConfig:
        return StoreConfig.from_dict({"path": str(out / "grad_store"), **self.store})

    def with_selection(self, **changes: Any) -> RunConfig:
        changes = {k: v for k, v in changes.items() if v is not None}
        return replace(self, selection=replace(self.selection, **changes)) if changes else self

    def with_train(self, **changes: Any) -> RunConfig:
        changes = {k: v for k, v in changes.items() if v is not None}
        return replace(self, train=replace(self.train, **changes)) if changes else self


def load_run_config(path: str | Path) -> tuple[dict[str, Any], RunConfig]:
    """Read a DeepSpeed JSON; return (DeepSpeed config without our block, our RunConfig)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"DeepSpeed config '{p}' does not exist; pass --deepspeed_config "
                          f"configs/zero3_cpu.json (or another file in configs/)")
    ds = json.loads(p.read_text())
    block = ds.pop(BLOCK, {})
    if not isinstance(block, dict):
        raise ConfigError(f"'{BLOCK}' in {p} must be an object, got {type(block).__name__}")
    return ds, RunConfig.from_dict(block)


def _plain(obj: Any) -> Any:
    if is_dataclass(obj):
        return {k: _plain(v) for k, v in asdict(obj).items()}
    if isinstance(obj, (tuple, list)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def dump_json(path: Path, obj: Any) -> None:
    """Write a config (dataclasses included) as indented JSON."""
    path.write_text(json.dumps(_plain(obj), indent=2, sort_keys=True) + "\n")
