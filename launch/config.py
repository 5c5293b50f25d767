"""The run's settings: the ``"dattri_ds"`` block of a DeepSpeed JSON as frozen dataclasses.

The DeepSpeed JSON in configs/ stays valid DeepSpeed: launch pops our block before
``deepspeed.initialize``. The block is parsed by :mod:`dattri_ds.io.schema` from the dataclasses
below (strict types, ranges, unknown keys refused at every level); the flags are generated
from the same dataclasses, and launch/args.py reads the JSON and merges the flags into it
(``load_run_config``). ``dump_json`` writes the resolved settings.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from dattri_ds.io import schema
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.errors import ConfigError
from dattri_ds.launch.engine import EngineConfig
from dattri_ds.io.outputs import write_atomic
from dattri_ds.selection import SelectionConfig
from dattri_ds.store import StoreConfig

__all__ = ["BLOCK", "TrainConfig", "RunConfig", "dump_json"]

BLOCK = "dattri_ds"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What launch/train.py trains on (flags override these)."""

    model_config: str = "configs/model_gpt2_tiny.json"
    """JSON model config (random init), ignored when ``model_path`` is set."""

    model_path: str | None = None
    """A local Hugging Face model directory to start from (never downloaded)."""

    train_data: tuple[str, ...] | None = field(default=None, metadata=schema.bounds(min_items=1))
    """Corpus files, folders or quoted globs (jsonl, .gz, .zst, parquet, Arrow: what
    ``dattri-ds prepare`` reads), prepared once into ``<out>/data/`` and trained on
    memory-mapped; null with ``data_path`` unset = data/corpus/train.jsonl."""

    data_path: tuple[str, ...] | None = field(default=None, metadata=schema.bounds(min_items=1))
    """Prepared corpora (``dattri-ds prepare`` prefixes or Megatron-LM .bin/.idx prefixes),
    or Megatron's blend form ``0.7 A 0.3 B``, trained on as they are."""

    packing: Literal["windows", "documents"] = "windows"
    """Examples: ``seq_len`` windows over the packed documents, or each document cut into
    ``seq_len`` chunks (no token is dropped either way)."""

    tokenizer: str | None = None
    """A Hugging Face tokenizer folder or a SentencePiece .model (default: the ``model_path``
    folder's, else the ``init_from`` run's, else one trained once on ``train_data``)."""

    max_docs: int | None = field(default=None, metadata=schema.bounds(ge=1, le=10**9))
    """Prepare and train on only the first N documents of ``train_data`` (read no further);
    null = all."""

    seq_len: int = field(default=128, metadata=schema.bounds(ge=2, le=2**20))
    """Tokens per example (at most 2^20, and the planner refuses at start what does not fit
    in memory)."""

    vocab_size: int = field(default=1024, metadata=schema.bounds(ge=8, le=2**21))
    """Vocabulary of the SentencePiece model trained on ``train_data`` when no tokenizer is
    named (``tokenizer``, ``model_path``, ``init_from`` or a prepared ``data_path``)."""

    steps: int = field(default=200, metadata=schema.bounds(ge=1, le=10**9))
    """Optimizer steps."""

    seed: int = field(default=0, metadata=schema.bounds(ge=-2**53, le=2**53))
    """Seed of model init and data order (any integer, negative ones included)."""

    save_every: int = field(default=0, metadata=schema.bounds(ge=0, le=10**9))
    """Save a DeepSpeed checkpoint every N steps (0 = only at the end)."""

    log_every: int = field(default=10, metadata=schema.bounds(ge=1, le=10**9))
    """Log loss and examples/s every N steps."""

    eval_data: str | None = None
    """jsonl of held-out texts whose loss is tracked (None = selection.target_data)."""

    eval_skip: int = field(default=64, metadata=schema.bounds(ge=0, le=10**9))
    """Skip the first N eval documents (by default those are the selection target set)."""

    eval_max_docs: int = field(default=64, metadata=schema.bounds(ge=1, le=10**9))
    """Evaluate on at most N documents."""

    eval_every: int = field(default=0, metadata=schema.bounds(ge=0, le=10**9))
    """Evaluate the held-out loss every N steps (0 = never)."""

    allow_eval_overlap: bool = False
    """Evaluate on held-out texts even when some are also training documents (same text;
    refused by default: the loss would measure texts the run trains on)."""

    max_nonfinite_steps: int = field(default=3, metadata=schema.bounds(ge=0, le=10**9))
    """Fail the run (non-zero exit, ``summary.json`` says why) after this many consecutive
    optimizer steps with a NaN/inf loss; 0 = never fail (non-finite steps are only counted
    and warned about)."""

    general_eval_data: str | None = None
    """jsonl of held-out *general* texts (never trained on) evaluated alongside the target
    (``general_loss``): what selection costs on everything else. None = not tracked."""

    init_from: str | None = None
    """Start from an earlier launch/train.py run (its ``--out``): tokenize with its
    tokenizer (the copy it keeps: ``tokenizer.model`` or ``model/``), so this model reads
    text exactly as that run's did (e.g. train on a subset ``dattri-ds curate`` chose with
    that run). Weights: ``init_checkpoint``. null = as ``tokenizer`` says."""

    init_checkpoint: str | None = None
    """With ``init_from``: start from the weights of this checkpoint of that run (a tag such
    as ``step120``, or ``latest``); the model config must equal that run's, and optimizer,
    schedule and step start fresh. null = random init (seeded by ``seed``)."""

    resume: str | None = None
    """Continue this run (the same ``--out``) from its checkpoint ``checkpoints/<tag>``
    (``latest``: the newest one in ``trajectory.json``): weights, optimizer and lr-schedule
    state, step, data position, RNG and the record (losses, lrs, evaluations) of the steps
    before it; the run then trains up to ``steps``. null = start at step 0."""

    def __post_init__(self) -> None:
        schema.check(self, f"{BLOCK}.train")
        if self.train_data is not None and self.data_path is not None:
            raise ConfigError(f"--train-data {' '.join(self.train_data)} and --data-path "
                              f"{' '.join(self.data_path)} both name the training data: pass one")
        if self.data_path is not None and self.max_docs is not None:
            raise ConfigError(f"--max-docs {self.max_docs} reads the first documents of "
                              f"--train-data; a prepared --data-path is trained whole. Fix: "
                              f"prepare the subset (dattri-ds prepare --max-docs "
                              f"{self.max_docs}), or drop --max-docs")
        if self.train_data is None and self.data_path is None:
            object.__setattr__(self, "train_data", ("data/corpus/train.jsonl",))
        if self.init_checkpoint is not None and self.init_from is None:
            raise ConfigError(f"--init-checkpoint {self.init_checkpoint} names a checkpoint of "
                              f"the run given by --init-from, which is not set: pass "
                              f"--init-from RUN_DIR (the --out of that run)")
        if self.init_from is not None and self.tokenizer is not None:
            raise ConfigError(f"--init-from {self.init_from} tokenizes with that run's "
                              f"tokenizer, and --tokenizer {self.tokenizer} names another: "
                              f"pass one")
        if self.init_from is not None and self.model_path is not None:
            raise ConfigError(f"--init-from {self.init_from} and --model-path "
                              f"{self.model_path} both give the starting model: pass one")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything in the ``"dattri_ds"`` block."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Model, data and schedule."""

    capture: CaptureConfig = field(default_factory=CaptureConfig)
    """Per-example gradient capture during training (enabled by ``--capture``)."""

    store: dict[str, Any] = field(default_factory=dict, metadata=schema.partial(StoreConfig))
    """StoreConfig fields (each checked as in StoreConfig); ``path`` defaults to
    ``<out>/grad_store``."""

    capture_enabled: bool = False
    """Capture per-example gradients of the training stream into the store."""

    selection: SelectionConfig = field(default_factory=SelectionConfig)
    """Online data selection (enabled by ``--online-selection``)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    """The training engine and its parallel sizes (``--backend``, ``--tensor-model-parallel-
    size``, ...; launch/engine.py)."""

    force: bool = False
    """Start a fresh run in an ``--out`` that holds an earlier run (its checkpoints,
    trajectory and summary are overwritten); without it that is refused at start (pass
    ``--resume latest`` to continue the earlier run instead)."""

    skip_memory_check: bool = False
    """Run even when the planner (dattri_ds/plan/) predicts that the run needs more memory
    than this machine has available (for experts who know better)."""

    def __post_init__(self) -> None:
        schema.check(self, BLOCK)
        self.store_config(Path("runs"))  # cross-field checks of the store block, now

    @classmethod
    def from_dict(cls, d: Any) -> RunConfig:
        """Parse the ``"dattri_ds"`` block; errors name ``dattri_ds.<key path>``."""
        return schema.parse(cls, d, BLOCK)

    def store_config(self, out: Path) -> StoreConfig:
        try:
            return StoreConfig(**{"path": str(out / "grad_store"), **self.store})
        except ConfigError as e:
            raise ConfigError(f"{BLOCK}.store: {e}") from None



def dump_json(path: Path, obj: Any) -> None:
    """Write a config (dataclasses included) as indented JSON, atomically (a run killed while
    writing leaves the previous file, never a torn one)."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=asdict) + "\n")
