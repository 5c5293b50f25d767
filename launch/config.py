"""The ``"dattri_ds"`` block of a DeepSpeed JSON: parsed, validated, merged with flags, dumped.

The DeepSpeed JSON in configs/ stays valid DeepSpeed: launch pops our block before
``deepspeed.initialize``. The block is parsed by :mod:`dattri_ds.io.schema` from the dataclasses
below (strict types, ranges, unknown keys refused at every level); flags generated from the
same dataclasses (launch/args.py) override it. Unknown top-level DeepSpeed keys are warned
about by name.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dattri_ds.io import schema
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.errors import ConfigError
from dattri_ds.launch.engine import EngineConfig
from dattri_ds.io.outputs import write_atomic
from dattri_ds.selection import SelectionConfig
from dattri_ds.store import StoreConfig

__all__ = ["TrainConfig", "RunConfig", "load_run_config", "dump_json", "check_memory",
           "check_outputs", "check_seq_len", "model_positions"]

BLOCK = "dattri_ds"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What launch/train.py trains on (flags override these)."""

    model_config: str = "configs/model_gpt2_tiny.json"
    """JSON model config (random init), ignored when ``model_path`` is set."""

    model_path: str | None = None
    """A local Hugging Face model directory to start from (never downloaded)."""

    train_data: tuple[str, ...] = field(default=("data/corpus/train.jsonl",),
                                        metadata=schema.bounds(min_items=1))
    """jsonl files with a ``text`` field (one path alone means a list of one)."""

    max_docs: int | None = field(default=None, metadata=schema.bounds(ge=1, le=10**9))
    """Use only the first N documents (the corpus order is already mixed); null = all."""

    seq_len: int = field(default=128, metadata=schema.bounds(ge=2, le=2**20))
    """Tokens per example (documents are truncated or padded; at most 2^20, and the planner
    refuses at start what does not fit in memory)."""

    vocab_size: int = field(default=1024, metadata=schema.bounds(ge=8, le=2**21))
    """SentencePiece vocabulary trained on the training texts (cached); not used with
    ``init_from`` (that run's tokenizer has its own)."""

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

    max_nonfinite_steps: int = field(default=3, metadata=schema.bounds(ge=0, le=10**9))
    """Fail the run (non-zero exit, ``summary.json`` says why) after this many consecutive
    optimizer steps with a NaN/inf loss; 0 = never fail (non-finite steps are only counted
    and warned about)."""

    general_eval_data: str | None = None
    """jsonl of held-out *general* texts (never trained on) evaluated alongside the target
    (``general_loss``): what selection costs on everything else. None = not tracked."""

    init_from: str | None = None
    """Start from an earlier launch/train.py run (its ``--out``): reuse its tokenizer
    (``tokenizer.model``; none is trained and ``vocab_size`` is not used), so this model
    reads text exactly as that run's did (e.g. train on a subset ``dattri-ds select`` chose
    with that run). Weights: ``init_checkpoint``. null = train a tokenizer on the texts."""

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
        if self.init_checkpoint is not None and self.init_from is None:
            raise ConfigError(f"--init-checkpoint {self.init_checkpoint} names a checkpoint of "
                              f"the run given by --init-from, which is not set: pass "
                              f"--init-from RUN_DIR (the --out of that run)")
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


def load_run_config(path: str | Path, overrides: dict[tuple[str, ...], Any] | None = None
                    ) -> tuple[dict[str, Any], RunConfig]:
    """Read a DeepSpeed JSON; return (DeepSpeed config without our block, our RunConfig).

    Args:
        path: the DeepSpeed JSON (``--deepspeed_config``).
        overrides: ``{key path: value}`` from the generated flags (launch/args.py); they
            replace the JSON's values before the block is parsed.

    Raises:
        ConfigError: the file is missing, not UTF-8, not JSON (file:line:column), or a value
            of the block is invalid (its key path named).
    """
    p = Path(path)
    ds = schema.read_json(p, "--deepspeed_config")
    if not isinstance(ds, dict):
        raise ConfigError(f"{p}: a DeepSpeed config must be a JSON object, got "
                          f"{type(ds).__name__}. Fix: pass a file like configs/zero3_cpu.json")
    block = ds.pop(BLOCK, {})
    if not isinstance(block, dict):
        raise ConfigError(f"{BLOCK} = {json.dumps(block)[:60]} in {p} is not allowed: expected "
                          f"an object with keys {', '.join(RunConfig.__dataclass_fields__)}")
    warn_unknown_deepspeed_keys(ds, p)
    for key, value in (overrides or {}).items():
        _set(block, key, value)
    cfg = RunConfig.from_dict(block)
    check_seq_len(cfg)  # a length the model cannot take: named before the planner's verdict
    check_memory(ds, cfg)
    return ds, cfg


#: The planner's knobs in launch: RunSpec field -> (JSON key, flag, default).
_KNOBS = {"seq_len": (f"{BLOCK}.train.seq_len", "--seq-len", 128),
          "micro_batch": ("train_micro_batch_size_per_gpu", "in the DeepSpeed JSON", 4),
          "candidate_multiple": (f"{BLOCK}.selection.candidate_multiple",
                                 "--candidate-multiple", 2.0),
          "vocab": (f"{BLOCK}.train.vocab_size", "--vocab-size", 1024),
          "k": (f"{BLOCK}.capture.projection.dim", "--capture-projection-dim", 4096),
          "model": (f"{BLOCK}.train.model_config", "--model-config", None)}


#: Config keys holding a model's number of positions, in the order Hugging Face reads them.
_POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length")


def model_positions(cfg: RunConfig) -> tuple[int, str, Path] | None:
    """``(positions, key, file)`` of the run's model config, None when it names none or
    cannot be read (the model's own error follows later). A GPT-2 config without
    ``n_positions`` has Hugging Face's default, 1024."""
    from dattri_ds.io.files import read_json

    tc = cfg.train
    path = Path(tc.model_path) / "config.json" if tc.model_path else Path(tc.model_config)
    try:
        d = read_json(path, "model config")
    except ConfigError:
        return None
    if not isinstance(d, dict):
        return None
    for key in _POSITION_KEYS:
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
            return d[key], key, path
    if d.get("model_type") == "gpt2":
        return 1024, "n_positions (default)", path
    return None


def check_seq_len(cfg: RunConfig) -> None:
    """Raises: ConfigError: ``--seq-len`` exceeds the model's positions (both named)."""
    found = model_positions(cfg)
    if found is None or cfg.train.seq_len <= found[0]:
        return
    n, key, path = found
    raise ConfigError(f"--seq-len {cfg.train.seq_len} is longer than the model's {n} positions "
                      f"({key} in {path}). Fix: pass --seq-len {n} or less, or a model "
                      f"config with more positions")


def check_memory(ds: dict[str, Any], cfg: RunConfig) -> None:
    """Ask the planner (dattri_ds/plan/) whether the resolved run fits this machine's
    memory (RAM from /proc/meminfo, or free GPU memory on CUDA); skipped with
    ``skip_memory_check`` or when the model config cannot be read (its own error follows).

    Raises:
        DoesNotFitError: naming the knob (JSON key and flag), the need and the limit.
    """
    if cfg.skip_memory_check:
        return
    from dattri_ds.plan import Knob, ModelShape, RunSpec, check_fits
    from dattri_ds.selection.scorer import SCORES

    tc = cfg.train
    src = Path(tc.model_path) / "config.json" if tc.model_path else Path(tc.model_config)
    try:
        model = ModelShape.from_config(src, vocab_size=None if tc.model_path else
                                       _init_vocab(tc) or tc.vocab_size)
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", 0) if zero.get("stage", 0) in (0, 1, 2, 3) else 0
    offload = "none"
    if isinstance(zero.get("offload_optimizer"), dict) and \
            zero["offload_optimizer"].get("device") == "cpu":
        offload = "all" if stage == 3 and isinstance(zero.get("offload_param"), dict) and \
            zero["offload_param"].get("device") == "cpu" else "optimizer"
    micro = ds.get("train_micro_batch_size_per_gpu", 1)
    micro = micro if type(micro) is int and micro >= 1 else 1
    bf16 = any(isinstance(ds.get(k), dict) and ds[k].get("enabled") is True
               for k in ("bf16", "fp16"))
    opt = ds.get("optimizer", {}).get("type", "adamw") if isinstance(ds.get("optimizer"),
                                                                     dict) else "adamw"
    proj = cfg.capture.projection
    sel = cfg.selection
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    try:
        spec = RunSpec(world=world, seq_len=tc.seq_len, micro_batch=micro, zero_stage=stage,
                       offload=offload, dtype="bfloat16" if bf16 else "float32",
                       optimizer="sgd_momentum" if str(opt).lower() == "sgd" else "adamw",
                       capture=cfg.capture_enabled,
                       projection=proj.kind if proj is not None else "kronecker",
                       k=proj.dim if proj is not None and cfg.capture_enabled else 0,
                       projection_cache_bytes=RunSpec.projection_cache_bytes
                       if proj is None else proj.cache_bytes,
                       method="selection" if sel.enabled else "graddot",
                       candidate_multiple=float(sel.candidate_multiple),
                       selection_probe=SCORES.lookup(sel.score).needs_probe)
    except ConfigError:  # a projection kind the planner does not model: nothing to check
        return
    values = {"seq_len": tc.seq_len, "micro_batch": micro,
              "candidate_multiple": sel.candidate_multiple if spec.probes else None,
              "vocab": None if tc.model_path or tc.init_from else tc.vocab_size,
              "k": spec.k or None, "model": tc.model_path or tc.model_config}
    knobs = [Knob(f, key, flag, values[f], default)
             for f, (key, flag, default) in _KNOBS.items() if values[f] is not None]
    import torch

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or 1)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0') or 0)}" if cuda else "cpu"
    check_fits(model, spec, knobs, device=device, local_ranks=local,
               override=f"--skip-memory-check ({BLOCK}.skip_memory_check)")


def _init_vocab(tc: TrainConfig) -> int | None:
    """The vocabulary of the ``--init-from`` run's model (its tokenizer's), None if unknown."""
    if not tc.init_from:
        return None
    try:
        d = json.loads((Path(tc.init_from) / "model" / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None  # check_init_from names what is wrong with the folder
    got = d.get("vocab_size") if isinstance(d, dict) else None
    return got if isinstance(got, int) and not isinstance(got, bool) and got > 0 else None


def check_outputs(out: Path, cfg: RunConfig) -> None:
    """The output door of launch (dattri_ds/io/outputs.py), at start: ``--out`` is a folder that
    can be written and holds no earlier run unless resumed or forced; the store path
    (``--capture``) is a folder too.

    Raises:
        OutputError: naming the path, the flag and the fix.
    """
    from dattri_ds.io.outputs import check_dir

    check_dir(out, flag="--out", force=cfg.force or cfg.train.resume is not None,
              overwrites=("trajectory.json", "summary.json", "checkpoints"),
              what="an earlier run", fix=f"pass --resume latest to continue it, --force "
                                         f"({BLOCK}.force) to start over, or another --out")
    if cfg.capture_enabled:
        check_dir(cfg.store_config(out).path, flag=f"{BLOCK}.store.path (--store-path)")


def _set(block: dict[str, Any], key: tuple[str, ...], value: Any) -> None:
    """Put a flag's value at ``key`` in the raw block (creating parent objects; a parent that
    is not an object is left for the schema to report)."""
    node = block
    for k in key[:-1]:
        if node.get(k) is None:
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            return
    node[key[-1]] = value


@functools.cache
def _deepspeed_keys() -> frozenset[str] | None:
    """Top-level keys DeepSpeed knows: the string constants its config module imports (from
    deepspeed/runtime/constants.py and the per-feature config modules) and the literal keys
    it reads from the dict. None when DeepSpeed is not installed."""
    try:
        import inspect

        import deepspeed.runtime.config as rc
    except ImportError:  # pragma: no cover - deepspeed is an optional extra
        return None
    keys = {v for k, v in vars(rc).items() if k.isupper() and isinstance(v, str)}
    keys |= set(re.findall(r"param_dict(?:\.get\(|\[)\s*[\"'](\w+)[\"']", inspect.getsource(rc)))
    return frozenset(keys)


def warn_unknown_deepspeed_keys(ds: dict[str, Any], path: Path) -> list[str]:
    """Warn (by name) about top-level keys DeepSpeed does not know: DeepSpeed ignores them,
    so a typo like ``train_micro_batch_size_per_gpus`` silently keeps the default."""
    known = _deepspeed_keys()
    if known is None:
        return []
    unknown = [k for k in ds if k not in known]
    for k in unknown:
        warnings.warn(f"{path}: top-level key '{k}' is not a DeepSpeed config key, DeepSpeed "
                      f"ignores it (ours go in the '{BLOCK}' block). Fix: correct the spelling "
                      f"or remove it", UserWarning, stacklevel=3)
    return unknown


def dump_json(path: Path, obj: Any) -> None:
    """Write a config (dataclasses included) as indented JSON, atomically (a run killed while
    writing leaves the previous file, never a torn one)."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=asdict) + "\n")
