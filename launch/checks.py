"""What launch/train.py refuses at start, before any process group: each a one-line error.

``load_run_config`` (launch/args.py) runs ``check_seq_len`` (``--seq-len`` against the
model's positions), ``check_deepspeed_json`` (DeepSpeed's batch rule for every backend, and
what DeepSpeed would assert on the keys the run passes on) and ``check_memory`` (the
planner's verdict on this machine's memory) as soon as the settings are read.
``train.main`` then runs ``check_inputs``: ``check_texts`` on the target and held-out files
the run reads (a file whose every text is whitespace would rank candidates against an empty
target or evaluate nothing), the ``--model-path`` folder and ``check_init_from``
(launch/init_from.py); ``check_resume`` (launch/resume.py); and ``check_outputs``, the
output door of ``--out`` and the store.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.io.files import model_dir, read_json
from dattri_ds.launch.config import BLOCK, RunConfig
from dattri_ds.launch.engine import BATCH_KEYS, data_parallel_world, resolve_batch
from dattri_ds.launch.data import check_data, start_vocab
from dattri_ds.launch.evaluate import text_reads
from dattri_ds.launch.init_from import check_init_from
from dattri_ds.io.outputs import check_dir

__all__ = ["check_inputs", "check_texts", "check_seq_len", "model_positions", "check_memory",
           "check_outputs", "check_deepspeed_json"]


def check_texts(path: str, flag: str, rows: slice = slice(None)) -> None:
    """Raises: ConfigError: every text of the jsonl file ``path`` (given by ``flag``) that
    the run reads (``rows`` of its documents) is whitespace (InputFileError for a file that
    cannot be read, from the reader)."""
    from dattri_ds.data.corpus import load_documents

    every = load_documents(path)
    docs = every[rows]
    if not docs:  # the held-out part of a target file that has none left
        raise ConfigError(f"{flag} {path} holds {len(every)} documents, and --eval-every reads "
                          f"documents {rows.start}.. of it (the first --eval-skip "
                          f"{rows.start} are the selection target): none are left. Fix: pass "
                          f"--eval-data FILE.jsonl, or a smaller --eval-skip")
    if all(not d.text.strip() for d in docs):
        what = (f"the {len(docs)} texts it reads (documents {rows.start or 0}.."
                f"{(rows.start or 0) + len(docs) - 1}) are" if rows != slice(None) else
                "its only text is" if len(docs) == 1 else f"all {len(docs)} texts are")
        raise ConfigError(f"{flag} {path}: {what} whitespace, so there is nothing to compare "
                          f"with or evaluate. Fix: pass a jsonl file whose \"text\" fields "
                          f"hold the texts you care about")


def check_inputs(cfg: RunConfig) -> str | None:
    """The text checks above, the ``--model-path`` folder (``files.model_dir``: its config
    and weights whole), the ``--init-from`` run (``load_run_config`` ran ``check_seq_len``)
    and the training data and tokenizer (``check_data``); the ``--init-checkpoint`` tag to
    load (None: none).

    Raises:
        ConfigError: naming the flag, the value and the fix.
    """
    for path, flag, rows, _ in text_reads(cfg):
        check_texts(path, flag, rows if rows != slice(0, None) else slice(None))
    tc = cfg.train
    if tc.model_path:  # config and weights whole, before anything is prepared into --out
        model_dir(tc.model_path, "--model-path")
    tag = check_init_from(cfg)
    check_data(cfg)
    return tag


#: Config keys holding a model's number of positions, in the order Hugging Face reads them.
_POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length")


def model_positions(cfg: RunConfig) -> tuple[int, str, Path] | None:
    """``(positions, key, file)`` of the run's model config, None when it names none or
    cannot be read (the model's own error follows later). A GPT-2 config without
    ``n_positions`` has Hugging Face's default, 1024."""
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
    """Raises: ConfigError: ``--seq-len`` exceeds the model's positions (both named), or
    ``--sequence-parallel`` cannot split it over the tensor-parallel ranks."""
    tp, seq_len = cfg.engine.tensor_model_parallel_size, cfg.train.seq_len
    if cfg.engine.sequence_parallel and tp > 1 and seq_len % tp:
        raise ConfigError(f"--sequence-parallel splits the sequence over the {tp} tensor-"
                          f"parallel ranks: --seq-len {seq_len} must be divisible by {tp}")
    found = model_positions(cfg)
    if found is None or cfg.train.seq_len <= found[0]:
        return
    n, key, path = found
    raise ConfigError(f"--seq-len {cfg.train.seq_len} is longer than the model's {n} positions "
                      f"({key} in {path}). Fix: pass --seq-len {n} or less, or a model "
                      f"config with more positions")


#: The planner's knobs in launch: RunSpec field -> (JSON key, flag, default).
_KNOBS = {"seq_len": (f"{BLOCK}.train.seq_len", "--seq-len", 128),
          "micro_batch": ("train_micro_batch_size_per_gpu", "in the DeepSpeed JSON", 4),
          "candidate_multiple": (f"{BLOCK}.selection.candidate_multiple",
                                 "--candidate-multiple", 2.0),
          "vocab": (f"{BLOCK}.train.vocab_size", "--vocab-size", 1024),
          "k": (f"{BLOCK}.capture.projection.dim", "--capture-projection-dim", 4096),
          "model": (f"{BLOCK}.train.model_config", "--model-config", None)}


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
                                       start_vocab(tc))
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
              "vocab": None if tc.model_path or tc.init_from or tc.tokenizer or tc.data_path
              else tc.vocab_size,
              "k": spec.k or None, "model": tc.model_path or tc.model_config}
    knobs = [Knob(f, key, flag, values[f], default)
             for f, (key, flag, default) in _KNOBS.items() if values[f] is not None]
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or 1)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0') or 0)}" if cuda else "cpu"
    check_fits(model, spec, knobs, device=device, local_ranks=local,
               override=f"--skip-memory-check ({BLOCK}.skip_memory_check)")


def check_outputs(out: Path, cfg: RunConfig) -> None:
    """The output door of launch (dattri_ds/io/outputs.py), at start: ``--out`` is a folder that
    can be written and holds no earlier run unless resumed or forced; the store path
    (``--capture``) is a folder too.

    Raises:
        OutputError: naming the path, the flag and the fix.
    """
    src = cfg.train.init_from
    if src is not None and Path(src).resolve() == out.resolve():
        raise ConfigError(f"--out {out} is the --init-from run: this run would write its "
                          f"files over the run (checkpoints, tokenizer) it starts from. Fix: "
                          f"pass another --out")
    check_dir(out, flag="--out", force=cfg.force or cfg.train.resume is not None,
              overwrites=("trajectory.json", "summary.json", "checkpoints"),
              what="an earlier run", fix=f"pass --resume latest to continue it, --force "
                                         f"({BLOCK}.force) to start over, or another --out")
    if cfg.capture_enabled:
        check_dir(cfg.store_config(out).path, flag=f"{BLOCK}.store.path (--store-path)")


# ---- the DeepSpeed JSON: the batch rule and what DeepSpeed would assert ---------------------
_DS_DOCS = "https://www.deepspeed.ai/docs/config-json/"


def check_deepspeed_json(ds: dict[str, Any], cfg: RunConfig, source: str) -> None:
    """Refuse at start what DeepSpeed would assert on the JSON this run passes on, each as
    one line naming the file, the key and the fix: the batch rule (``resolve_batch``; the
    resolved three keys are written back into ``ds``, so every backend and the resolved
    config say the same), ``gradient_clipping``, every check of DeepSpeed's own config parser
    (``DeepSpeedConfig``: ZeRO keys, fp16/bf16, ...), the optimizer (its type and params as
    the engine would build it, ZeRO with an untested optimizer) and the scheduler (built on
    a probe parameter). ``--backend torch`` and ``megatron`` build their torch optimizer and
    schedule on a probe instead.

    Raises:
        ConfigError: naming ``source``, the key and the fix.
    """
    world = data_parallel_world(cfg.engine)
    ds.update(zip(BATCH_KEYS, resolve_batch(ds, world, source)))
    clip = ds.get("gradient_clipping", 0.0)
    if type(clip) not in (int, float) or not math.isfinite(clip) or clip < 0:
        raise ConfigError(f"{source}: gradient_clipping = {json.dumps(clip)} is not allowed: "
                          f"expected a number >= 0 (the largest global gradient norm; 0 = no "
                          f"clipping). Fix: e.g. \"gradient_clipping\": 1.0")
    _deepspeed_parser(ds, source)
    if cfg.engine.backend == "deepspeed":
        _deepspeed_optimizer(ds, source)
        _deepspeed_scheduler(ds, source)
    else:
        _torch_optimizer(ds, source, cfg.engine.backend)


def _fail(source: str, key: str, problem: str, fix: str = "") -> ConfigError:
    return ConfigError(f"{source}: {key}: {problem}. Fix: "
                       f"{fix or f'correct {key} (DeepSpeed config reference: {_DS_DOCS})'}")


#: DeepSpeed's config models -> their key in the JSON.
_DS_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16",
                "DeepSpeedBF16Config": "bf16"}
#: An assertion of DeepSpeed's config parser (its message) -> (key, fix).
_DS_ASSERTS = {
    "bfloat16 and fp16 modes": ("fp16.enabled and bf16.enabled", "enable at most one of them"),
    "Fp16_master_weights_and_grads": ("fp16.fp16_master_weights_and_grads",
                                      "set zero_optimization.stage to 1, 2 or 3, or drop it"),
    "Bf16_master_weights_and_grads": ("bf16.bf16_master_weights_and_grads",
                                      "set zero_optimization.stage to 1, 2 or 3, or drop it"),
    "bf16_optimizer_states requires": ("bf16.bf16_optimizer_states",
                                       "also set bf16.bf16_master_weights_and_grads true"),
    "bf16_optimizer_states is only": ("bf16.bf16_optimizer_states",
                                      "set zero_optimization.stage to 1, 2 or 3, or drop it"),
    "Partial offloading": ("zero_optimization.offload_param",
                           "set zero_optimization.stage to 3, or drop the ratio"),
}


def _deepspeed_parser(ds: dict[str, Any], source: str) -> None:
    """``DeepSpeedConfig`` on ``ds`` (its batch keys as this process would see them), its
    errors as one line. Nothing without DeepSpeed."""
    try:
        from deepspeed import comm
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:  # pragma: no cover - deepspeed is an optional extra
        return
    try:
        world = comm.get_world_size()  # what DeepSpeedConfig divides by (1 without a group)
    except Exception:  # noqa: BLE001 - no process group yet
        world = 1
    _, micro, gas = (ds[k] for k in BATCH_KEYS)
    try:
        DeepSpeedConfig({**ds, "train_batch_size": micro * gas * world})
    except Exception as e:  # noqa: BLE001 - every refusal of DeepSpeed's parser is named
        if hasattr(e, "errors") and hasattr(e, "title"):  # pydantic: the key path and value
            first = e.errors()[0]
            key = ".".join([_DS_SECTIONS.get(e.title, e.title),
                            *(str(x) for x in first.get("loc", ()))])
            raise _fail(source, key, f"{json.dumps(first.get('input'), default=str)[:60]} is "
                        f"refused by DeepSpeed ({first.get('msg')})") from None
        text = " ".join(str(e).split())
        for needle, (key, fix) in _DS_ASSERTS.items():
            if needle in text:
                raise _fail(source, key, f"DeepSpeed refuses it ({text})", fix) from None
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ConfigError(f"{source}: DeepSpeed refuses this config: "
                          f"{text or where.line} ({Path(where.filename).name}:{where.lineno})."
                          f" Fix: correct the key it names ({_DS_DOCS})") from None


def _deepspeed_optimizer(ds: dict[str, Any], source: str) -> None:
    """The ``optimizer`` block as ``DeepSpeedEngine._configure_basic_optimizer`` reads it:
    the type (one of DeepSpeed's or a ``torch.optim`` class), params the class takes
    (``max_grad_norm`` refused, as DeepSpeed does), and with ZeRO an optimizer it supports
    unless ``zero_allow_untested_optimizer``."""
    spec = ds.get("optimizer")
    if spec is None:
        return
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str) or not isinstance(
            spec.get("params", {}), dict):
        raise _fail(source, "optimizer", f"{json.dumps(spec)[:60]} is not an object with a "
                    f"\"type\" string and a \"params\" object",
                    "e.g. \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.001}}")
    from deepspeed.runtime import config as dsc
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    name, params = spec["type"], spec.get("params", {})
    if "max_grad_norm" in params:
        raise _fail(source, "optimizer.params.max_grad_norm", "DeepSpeed clips with the "
                    "top-level gradient_clipping, not an optimizer parameter",
                    f"remove it and set \"gradient_clipping\": {params['max_grad_norm']}")
    classes, extra = _optimizer_classes(name.lower() if name.lower() in
                                        dsc.DEEPSPEED_OPTIMIZERS else name)
    if classes is None:
        raise _fail(source, "optimizer.type", f"'{name}' is neither one of DeepSpeed's "
                    f"optimizers {dsc.DEEPSPEED_OPTIMIZERS} nor a torch.optim class (the name "
                    f"is case-sensitive there)", "e.g. \"AdamW\", \"SGD\"")
    import inspect

    allowed = set(extra)
    for c in classes:
        allowed |= set(list(inspect.signature(c.__init__).parameters)[2:])
    bad = sorted(set(params) - allowed)
    if classes and bad:
        raise _fail(source, f"optimizer.params.{bad[0]}", f"{name} takes no parameter "
                    f"'{bad[0]}' (it takes {sorted(allowed)})", f"remove or rename '{bad[0]}'")
    zero = ds.get("zero_optimization") or {}
    if classes and zero.get("stage", 0) and not ds.get("zero_allow_untested_optimizer") and \
            not any(c in ZERO_SUPPORTED_OPTIMIZERS for c in classes):
        raise _fail(source, "optimizer.type", f"ZeRO stage {zero['stage']} has not been tested "
                    f"by DeepSpeed with {name}", "add \"zero_allow_untested_optimizer\": true, "
                    "or use AdamW")


def _optimizer_classes(name: str) -> tuple[list | None, tuple[str, ...]]:
    """The classes DeepSpeed may build for optimizer ``name`` and the params it removes
    first; ``([], ())`` for its optimizers whose params are not checked here, None for a
    name it does not know."""
    import torch

    if name in ("adam", "adamw"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
        return ([torch.optim.Adam, torch.optim.AdamW, FusedAdam, DeepSpeedCPUAdam],
                ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach"))
    if name == "adagrad":
        return [torch.optim.Adagrad], ()
    if name in ("lamb", "lion", "muadam", "muadamw", "musgd", "muon"):
        return [], ()
    found = getattr(torch.optim, name, None)
    ok = isinstance(found, type) and issubclass(found, torch.optim.Optimizer)
    return ([found], ()) if ok else (None, ())


def _deepspeed_scheduler(ds: dict[str, Any], source: str) -> None:
    """The ``scheduler`` block: a DeepSpeed ``lr_schedules`` class, built with its params
    on a probe optimizer (what the engine does with the real one)."""
    spec = ds.get("scheduler")
    if spec is None:
        return
    from deepspeed.runtime import lr_schedules

    if not isinstance(spec, dict) or spec.get("type") not in lr_schedules.VALID_LR_SCHEDULES \
            or not isinstance(spec.get("params", {}), dict):
        raise _fail(source, "scheduler.type", f"{json.dumps(spec)[:60]} does not name one of "
                    f"DeepSpeed's schedules {lr_schedules.VALID_LR_SCHEDULES} (with a "
                    f"\"params\" object)", "e.g. \"scheduler\": {\"type\": \"WarmupLR\", "
                    "\"params\": {\"warmup_num_steps\": 10}}")
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    try:
        getattr(lr_schedules, spec["type"])(probe, **spec.get("params", {}))
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise _fail(source, "scheduler.params", f"{spec['type']} refuses them "
                    f"({' '.join(str(e).split())[:160]})") from None


def _torch_optimizer(ds: dict[str, Any], source: str, backend: str) -> None:
    """``--backend torch`` / ``megatron``: the torch optimizer and the schedule of the JSON
    (launch/optimizer.py), built on a probe parameter."""
    from dattri_ds.launch.optimizer import OPTIMIZERS, make_schedule, optimizer_spec

    key = "optimizer"
    try:
        kind, params = optimizer_spec(ds)
        key = "optimizer.params"
        opt = OPTIMIZERS[kind]([torch.zeros(1, requires_grad=True)], **params)
        key = "scheduler"
        make_schedule(ds, opt)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (TypeError, ValueError, AssertionError, KeyError, AttributeError) as e:
        raise _fail(source, key, f"--backend {backend} builds its torch {key.split('.')[0]} "
                    f"from it, which refuses it ({' '.join(str(e).split())[:160]})") from None
