"""What the offline tools share: a training run's artifacts, models at checkpoints, queries."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.io.schema import add_flag, flag_type, read_json

__all__ = ["Run", "setup_logging", "init_distributed", "write_config", "add_source_args",
           "add_checkpoint_args", "open_source", "source_tags", "checkpoint_tags", "store_paths",
           "store_of"]

logger = logging.getLogger("dattri_ds.tools")
#: The project folder: a run's relative data paths are also looked up from here.
_PROJECT = Path(__file__).resolve().parents[1]


#: ``--verbose``: third-party output (DeepSpeed's checkpoint consolidation banners,
#: transformers' warnings and progress bars, the per-layer projection table) is shown.
VERBOSE = False


def setup_logging(rank: int = 0, verbose: bool = False) -> None:
    """The tools' log lines (rank 0 at INFO, other ranks WARNING); third-party logging,
    warnings and progress bars kept to errors unless ``verbose`` (``dattri_ds.cli.noise``, as
    launch/train.py does)."""
    from dattri_ds.cli.noise import setup_logging as setup

    global VERBOSE
    VERBOSE = verbose
    setup(rank, verbose)


@contextlib.contextmanager
def quiet_stdout():
    """A context in which third-party prints and progress bars (DeepSpeed's ``zero_to_fp32``
    banners, its "Loading checkpoint shards" / "Gathering sharded weights" bars) are dropped
    unless ``--verbose`` (their logging is kept to errors by ``setup_logging``); an error
    raised inside still propagates."""
    import io

    if VERBOSE:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


@dataclass(frozen=True)
class Run:
    """A ``launch/train.py`` output directory (or any folder laid out the same way).

    Attributes:
        root: the run directory: ``model/config.json``, ``tokenizer.model``,
            ``checkpoints/<tag>/``, ``trajectory.json``, ``resolved_dattri_ds_config.json``.
    """

    root: Path
    tokenizer_path: Path | None = None

    @staticmethod
    def open(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> Run:
        """A run directory; its tokenizer is ``tokenizer.model`` (SentencePiece), Hugging Face
        tokenizer files in the run or its ``model/`` folder, or ``tokenizer``."""
        from dattri_ds.io.files import check_dir
        from dattri_ds.tools.sources import hf_tokenizer_dir

        root = check_dir(path, "--run folder", "pass the --out folder of launch/train.py, or "
                         "--model with a Hugging Face model folder")
        if not (root / "model/config.json").exists():
            raise ConfigError(f"'{root}' is not a training run directory: missing "
                              f"model/config.json. Pass the --out folder of launch/train.py, "
                              f"or --model with a Hugging Face model folder")
        tok = Path(tokenizer) if tokenizer else None
        if tok is None and not (root / "tokenizer.model").exists():
            tok = hf_tokenizer_dir(root, root / "model")
        return Run(root, tok)

    @property
    def seq_len(self) -> int:
        """The run's ``train.seq_len`` (from ``resolved_dattri_ds_config.json``).

        Raises:
            ConfigError: the file is missing or holds no integer ``train.seq_len``.
        """
        cfg, train = self._train_record()
        hint = (f"it records the run's train.seq_len (launch/train.py writes it to the --out "
                f"folder you pass as --run-dir). Fix: pass --seq-len N, the tokens per example")
        if not cfg.is_file():
            raise ConfigError(f"--seq-len is needed: {cfg} is missing; {hint}")
        value = train.get("seq_len")
        if type(value) is not int or value < 2:
            raise ConfigError(f"--seq-len is needed: {cfg}: train.seq_len = {value!r} is not an "
                              f"integer >= 2; {hint}")
        return value

    def _train_record(self) -> tuple[Path, dict]:
        """``resolved_dattri_ds_config.json`` and its ``train`` object (``{}`` when absent)."""
        cfg = self.root / "resolved_dattri_ds_config.json"
        data = read_json(cfg, "--run") if cfg.is_file() else None
        train = data.get("train") if isinstance(data, dict) else None
        return cfg, train if isinstance(train, dict) else {}

    @property
    def context(self) -> int:
        """The model's context length (``n_positions`` / ``max_position_embeddings``)."""
        from dattri_ds.tools.sources import required_context

        return required_context(self.root / "model/config.json")

    def train_data(self) -> tuple[list[str], int | None] | None:
        """The run's own training data: ``(train.train_data files, train.max_docs)`` from
        ``resolved_dattri_ds_config.json`` (relative files found from the current folder or
        the project's), None when the run records none.

        Raises:
            ConfigError: a recorded file is not found (named, with ``--data``).
        """
        cfg, train = self._train_record()
        files = train.get("train_data")
        files = [files] if isinstance(files, str) else files
        if not isinstance(files, list) or not files or \
                not all(isinstance(f, str) for f in files):
            return None
        found = []
        for f in files:
            path = next((p for p in (Path(f), _PROJECT / f) if p.is_file()), None)
            if path is None:
                raise ConfigError(f"The run's training data '{f}' ({cfg}: train.train_data) is "
                                  f"not found from {Path.cwd()} nor {_PROJECT}. Fix: pass --data "
                                  f"the jsonl the run trained on")
            found.append(str(path.resolve()))  # recorded: found from any folder later
        max_docs = train.get("max_docs")
        return found, max_docs if type(max_docs) is int and max_docs > 0 else None

    def tokenizer(self):
        """SentencePiece ``tokenizer.model``, else the Hugging Face tokenizer found at open."""
        from dattri_ds.tools.sources import HFTokenizer

        if self.tokenizer_path is not None:
            return HFTokenizer(self.tokenizer_path)
        spm = self.root / "tokenizer.model"
        if spm.exists() or spm.is_symlink():  # a broken link is named by the reader
            from dattri_ds.data import Tokenizer
            return Tokenizer.load(spm)
        raise ConfigError(f"Run '{self.root}' has no tokenizer ({spm} or Hugging Face "
                          f"tokenizer files): pass --tokenizer FOLDER, or give token-id jsonl")

    def trajectory(self) -> list[dict]:
        """Saved checkpoints ``[{"tag", "step", "lr"}]``, oldest first.

        Raises:
            ConfigError: ``trajectory.json`` is missing or malformed. Its learning rates
                weight TracIn's checkpoints; no stand-in (such as lr = 1) is assumed.
        """
        path = self.root / "trajectory.json"
        hint = ("it records every checkpoint's tag, step and learning rate (TracIn's weights); "
                "launch/train.py writes it to its --out folder at each checkpoint. Fix: pass "
                "--run-dir the --out folder of a launch/train.py run that saved a checkpoint, "
                "write it as {\"checkpoints\": [{\"tag\", \"step\", \"lr\"}, ...]} "
                "(docs/offline_tools.md), or pass Hugging Face checkpoint folders as "
                "--checkpoints DIR [DIR ...] instead of --run-dir")
        if not path.is_file():
            raise ConfigError(_failed_run(self.root) or f"{path} is missing: {hint}")
        data = read_json(path, "--run")
        ckpts = data.get("checkpoints") if isinstance(data, dict) else None
        ok = isinstance(ckpts, list) and all(
            isinstance(c, dict) and isinstance(c.get("tag"), str) and type(c.get("step")) is int
            and type(c.get("lr")) in (int, float) for c in ckpts)
        if not ok:
            raise ConfigError(f"{path}: 'checkpoints' must be a list of {{tag, step, lr}} "
                              f"objects, got {str(ckpts)[:80]}: {hint}")
        return ckpts

    def folder(self, tag: str) -> Path:
        """The folder of checkpoint ``tag`` (``checkpoints/<tag>``)."""
        return self.root / "checkpoints" / tag

    def checkpoint(self, tag: str) -> dict:
        for c in self.trajectory():
            if c["tag"] == tag:
                return c
        raise ConfigError(f"Checkpoint '{tag}' is not in {self.root / 'trajectory.json'}; "
                          f"available: {[c['tag'] for c in self.trajectory()]}")

    def tags(self, wanted: str | None) -> list[str]:
        """``all``/None -> every checkpoint, ``last`` -> the newest, else a comma list."""
        tags = [c["tag"] for c in self.trajectory()]
        if not tags:
            raise ConfigError(f"No checkpoints in {self.root / 'checkpoints'}")
        from dattri_ds.tools.sources import pick_tags

        return pick_tags(tags, wanted, self.checkpoint)

    @property
    def run_id(self) -> str | None:
        """The id launch/train.py gave this run (``trajectory.json``), None for older runs."""
        path = self.root / "trajectory.json"
        data = read_json(path, "--run") if path.exists() else None
        return data.get("run_id") if isinstance(data, dict) else None

    def fingerprint(self) -> str:
        """Identity of the model family: model config + tokenizer (stores record it)."""
        import hashlib
        h = hashlib.blake2b(digest_size=8)
        h.update((self.root / "model/config.json").read_bytes())
        tok = self.tokenizer_path
        files = [self.root / "tokenizer.model"] if tok is None else sorted(
            p for p in tok.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges")))
        for f in files:
            if f.exists():
                h.update(f.read_bytes())
        return f"model:{h.hexdigest()}"

    def model(self, tag: str, device: torch.device | str = "cpu"):
        """The model at checkpoint ``tag``, fp32, eval mode, no dropout.

        A ``--backend megatron`` run (``checkpoints/<tag>/megatron_consolidated.pt``) gives a
        TP=1 GPTModel called like a Hugging Face model (``MegatronLM``).
        """
        from dattri_ds.integrations.megatron_checkpoint import is_consolidated

        if is_consolidated(self.root / "checkpoints" / tag):
            return _megatron_model(self.root, tag).to(device).eval()
        from transformers import AutoConfig, AutoModelForCausalLM

        from dattri_ds.io.files import model_dir
        from dattri_ds.integrations.checkpoints import load_state_dict
        from dattri_ds.tools.sources import is_hf_model_dir, load_hf_model

        folder = self.root / "checkpoints" / tag
        if is_hf_model_dir(folder):  # save_pretrained checkpoints (ties restored there)
            return load_hf_model(model_dir(folder, "--run"), device)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
            model_dir(self.root / "model", "--run", weights=False)))
        with quiet_stdout():  # DeepSpeed's consolidation banners: --verbose
            state = load_state_dict(self.root / "checkpoints", tag)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = _tied_to_loaded(model, set(state))
        bad = [m for m in missing if not m.endswith((".attn.bias", ".masked_bias"))
               and m not in tied]
        if bad or unexpected:
            raise ConfigError(f"Checkpoint '{tag}' of {self.root} does not match the run's "
                              f"model config: missing {bad[:5]}, unexpected {unexpected[:5]}")
        return model.to(device).eval()


def _failed_run(root: Path) -> str | None:
    """Why a run has no checkpoint, from its ``summary.json`` when training failed."""
    try:
        s = json.loads((root / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(s, dict) or s.get("status") != "failed":
        return None
    at = s.get("diverged_at_step")
    cause = f"diverged at step {at}" if s.get("cause") == "diverged" else "failed"
    return (f"{root} holds no checkpoint: its training run {cause} and stopped at step "
            f"{s.get('steps')} before saving one ({root / 'summary.json'}: "
            f"{str(s.get('error', ''))[:200]}). Fix: rerun training with the fix it names "
            f"(or --save-every N to keep checkpoints before a failure)")


def _tied_to_loaded(model: torch.nn.Module, loaded: set[str]) -> set[str]:
    """Parameter names that share their tensor with a loaded one (tied weights)."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return {n for names in by_tensor.values() if any(m in loaded for m in names) for n in names}


def add_source_args(p) -> None:
    """The flags naming what a tool reads: a run or a model folder, tokenizer, seq_len.

    ``--run-dir`` is also accepted as ``--run`` (plain ``python``); under torchrun use
    ``--run-dir`` (torchrun reads ``--run`` as an ambiguous prefix of its ``--run-path``).
    ``--local_rank`` (added by the ``deepspeed`` launcher) is accepted and ignored: ranks
    come from the environment. A list of Hugging Face checkpoint folders comes in through
    :func:`add_checkpoint_args`.
    """
    import argparse

    p.add_argument("--run-dir", "--run", dest="run", help="launch/train.py output directory "
                   "(or any folder laid out the same way: docs/offline_tools.md)")
    p.add_argument("--model", help="one Hugging Face causal LM folder (save_pretrained) instead "
                                   "of --run-dir; several: --checkpoints DIR [DIR ...]")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer folder (default: the model's)")
    add_flag(p, "--seq-len", int, ge=1, default=None,
             help="tokens per example (default: the run's seq_len, else the model's "
             "context)")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="run even when the planner predicts the run does not fit in memory")
    p.add_argument("--verbose", action="store_true",
                   help="also show third-party output: DeepSpeed's checkpoint consolidation "
                        "banners, transformers' warnings and progress bars, per-layer tables")
    p.add_argument("--local_rank", "--local-rank", type=flag_type(int, name="--local_rank", ge=0),
                   help=argparse.SUPPRESS)


def add_checkpoint_args(p, selects: str | None = "checkpoints") -> None:
    """``--checkpoints`` (Hugging Face checkpoint folders, or with --run-dir / --model the
    tags to read: ``selects`` says what that choice is for) and ``--steps`` / ``--lrs``
    (each folder's step and learning rate when it has no ``trainer_state.json``)."""
    also = f"; with --run-dir / --model, tags instead (all | last | tag,tag): {selects}" \
        if selects else ""
    p.add_argument("--checkpoints", nargs="+", default=None, metavar="DIR",
                   help="Hugging Face checkpoint folders of one training run (or a quoted "
                        f"glob such as 'out/checkpoint-*'), read as a run{also}")
    add_flag(p, "--steps", int, ge=0, nargs="+", default=None, metavar="STEP",
             help="--checkpoints folders: the step of each (default: its trainer_state.json)")
    add_flag(p, "--lrs", float, ge=0, nargs="+", default=None, metavar="LR",
             help="--checkpoints folders: the learning rate after each (default: its "
                  "trainer_state.json); lr-weighted scores need it")


def folder_list(args) -> list[str] | None:
    """The ``--checkpoints`` values when they name checkpoint folders (no --run-dir /
    --model given), else None."""
    values = getattr(args, "checkpoints", None)
    if isinstance(values, list) and not (args.run or args.model):
        return values
    return None


def tag_choice(args) -> str | None:
    """``--checkpoints`` as a tag choice (``all`` | ``last`` | ``tag,tag``) of a run or model,
    None when not given or when it names the checkpoint folders themselves."""
    values = getattr(args, "checkpoints", None)
    if values is None or folder_list(args) is not None:
        return None
    return ",".join(values) if isinstance(values, list) else values


def _looks_like_folder(value: str) -> bool:
    return os.sep in value or "/" in value or any(c in value for c in "*?[") or (
        Path(value, "config.json").exists())


def open_source(args):
    """The Run, HFModelDir or HFCheckpoints the parsed source flags name.

    ``--run-dir`` takes a run folder (or one model folder); ``--model`` one model folder;
    ``--checkpoints`` alone a list of checkpoint folders (``tools.hf_checkpoints``). A
    folder given to the wrong flag is an error naming the flag that reads it.

    Raises:
        ConfigError: not exactly one source, a folder of another layout than its flag
            reads (the flag that reads it named), --steps / --lrs without folders.
    """
    from dattri_ds.tools.hf_checkpoints import HFCheckpoints

    folders = folder_list(args)
    given = [f for f, v in (("--run-dir", args.run), ("--model", args.model),
                            ("--checkpoints", folders)) if v]
    if len(given) != 1:
        raise ConfigError("Give exactly one of --run-dir (a launch/train.py run), --model (a "
                          "Hugging Face model folder) and --checkpoints DIR [DIR ...] (Hugging "
                          f"Face checkpoint folders); got run={args.run!r}, "
                          f"model={args.model!r}")
    if folders is not None:
        return HFCheckpoints.open(folders, getattr(args, "steps", None),
                                  getattr(args, "lrs", None), args.tokenizer)
    for flag in ("--steps", "--lrs"):
        if getattr(args, flag[2:], None) is not None:
            raise ConfigError(f"{flag} goes with --checkpoints DIR [DIR ...] (Hugging Face "
                              f"checkpoint folders); a run's steps and learning rates are in "
                              f"its trajectory.json. Fix: drop {flag}")
    wanted = tag_choice(args)
    if wanted is not None and any(_looks_like_folder(v) for v in args.checkpoints):
        raise ConfigError(
            f"--checkpoints {' '.join(args.checkpoints)}: with {given[0]} it chooses checkpoint "
            f"tags (all | last | tag,tag), not folders. Fix: to read Hugging Face checkpoint "
            f"folders, pass them to --checkpoints without {given[0]}")
    return _open_folder(Path(args.model or args.run), given[0], args.tokenizer)


def _open_folder(path: Path, flag: str, tokenizer):
    """``--run-dir`` / ``--model`` ``path`` by its layout; another layout names its flag."""
    from dattri_ds.tools.hf_checkpoints import natural_key
    from dattri_ds.tools.sources import HFModelDir, is_hf_model_dir

    is_run = (path / "model/config.json").exists()
    if is_hf_model_dir(path) and not is_run:
        return HFModelDir.open(path, tokenizer)
    if is_run and flag == "--run-dir":
        return Run.open(path, tokenizer)
    if is_run:
        raise ConfigError(f"--model {path} is a run folder (model/config.json, checkpoints/), "
                          f"not one model. Fix: pass it as --run-dir {path}")
    inner = sorted((q for q in path.iterdir() if q.is_dir() and is_hf_model_dir(q)),
                   key=lambda q: natural_key(q.name)) if path.is_dir() else []
    if inner:
        names = ", ".join(q.name for q in inner[:4]) + (", ..." if len(inner) > 4 else "")
        raise ConfigError(
            f"{flag} {path} holds Hugging Face checkpoint folders ({names}), not one model or "
            f"a run. Fix: pass them as --checkpoints {path / inner[0].name} ... (or the quoted "
            f"glob '{path}/*') in place of {flag}")
    if flag == "--model":
        return HFModelDir.open(path, tokenizer)  # names what the folder lacks
    from dattri_ds.io.files import check_dir
    check_dir(path, "--run-dir folder", "pass the --out folder of launch/train.py")
    raise ConfigError(
        f"--run-dir {path} is not a run folder (it has no model/config.json; the layout is in "
        f"docs/offline_tools.md) nor a model folder (config.json + weights). Fix: pass --run-dir "
        f"the --out folder of launch/train.py, or --checkpoints with Hugging Face checkpoint "
        f"folders")


def source_tags(source, args, default: str, flag: str = "--checkpoints",
                chosen: str | None = None) -> list[str]:
    """The checkpoints a tool reads: ``chosen`` (a tool's own tag flag) or the tag choice of
    ``--checkpoints`` (``default`` when neither is given); every folder of a ``--checkpoints``
    folder list unless ``chosen`` picks among them."""
    from dattri_ds.tools.hf_checkpoints import HFCheckpoints

    if isinstance(source, HFCheckpoints) and chosen is None:
        return source.tags(None)
    wanted = chosen if chosen is not None else tag_choice(args)
    return checkpoint_tags(source, default if wanted is None else wanted, flag)


def training_data(source, args, flag: str = "--data") -> tuple[str | list[str], int | None, str]:
    """``(file or files, max_docs, where from)`` of the documents a tool reads: ``flag``
    when given, else the run's own training data (``Run.train_data``: its files and its
    ``max_docs`` unless ``--max-docs`` is given). The tool's ``args.data`` and
    ``args.max_docs`` are set to them (so its recorded config names what it read).

    Raises:
        ConfigError: no ``flag`` and the source records no training data (a model folder),
            naming the flag.
    """
    given = getattr(args, flag.lstrip("-").replace("-", "_"), None)
    if given:
        return given, args.max_docs, flag
    recorded = source.train_data() if hasattr(source, "train_data") else None
    if recorded is None:
        raise ConfigError(f"{flag} is needed: {source.root} records no training data (only a "
                          f"launch/train.py run does, in resolved_dattri_ds_config.json). Fix: "
                          f"pass {flag} the jsonl of documents (or token ids) to read")
    files, max_docs = recorded
    data = files[0] if len(files) == 1 else files
    args.data = data
    if args.max_docs is None:
        args.max_docs = max_docs
    return data, args.max_docs, "the run's training data"


def source_flags(args) -> str:
    """The source flags a tool was given (``--run-dir R``, ``--model M`` or ``--checkpoints
    DIR ...``), for a fix that repeats them."""
    return (f"--run-dir {args.run}" if args.run else f"--model {args.model}" if args.model
            else f"--checkpoints {' '.join(args.checkpoints or [])}")


def store_origin(source, tag: str, model) -> dict:
    """Where a store of checkpoint ``tag`` comes from (``StoreRequest.origin``): the model
    family at that tag, the run id, the tag and a hash of the model's weights."""
    from dattri_ds.store import weights_hash

    return {"fingerprint": f"{source.fingerprint()}@{tag}", "run_id": source.run_id,
            "checkpoint": tag, "weights_hash": weights_hash(model)}


def factors_path(factors: str | None, tag: str) -> Path | None:
    """``--factors``: a file, or a folder of ``<tag>.pt`` (``fit --checkpoint all``)."""
    path = Path(factors) if factors else None
    return path / f"{tag}.pt" if path is not None and path.is_dir() else path


def check_factors(factors, path, model, args) -> None:
    """Refuse curvature factors fitted on a model of other layer shapes before any work
    (the fix names the tool's source flags, ``args``).

    Raises:
        ConfigError: one line naming the factors file, the first differing layer with both
            shapes, and the fix (fit on this model, or pass the model they were fitted on).
    """
    from dattri_ds.store.attach import model_layers

    have, source = model_layers(model), source_flags(args)
    diff = [(n, tuple(lf.shape), tuple(have[n][1])) for n, lf in factors.layers.items()
            if n in have and tuple(have[n][1]) != tuple(lf.shape)]
    if not diff and not any(n in have for n in factors.layers):
        diff = [(next(iter(factors.layers)), "a layer", "absent")]
    if diff:
        name, theirs, ours = diff[0]
        raise ConfigError(
            f"--factors {path} were fitted on another model: layer '{name}' is {theirs} there "
            f"and {ours} in {source} ({len(diff)} layer(s) differ). Fix: fit factors on this "
            f"model (tools/fit.py {source} --out <file or dir>), or pass the model the factors "
            f"were fitted on")


def announce(tool: str, **parts) -> None:
    """The first line a tool prints: what it reads and does (data, checkpoints, projection,
    method), ``key value`` pairs in order; None values are left out."""
    logger.info("%s: %s", tool, "; ".join(f"{k.replace('_', ' ')} {v}" for k, v in parts.items()
                                        if v is not None))


def describe_data(data, where: str, n: int) -> str:
    """``FILE (N documents, the run's training data)`` for ``announce``."""
    files = data if isinstance(data, str) else ", ".join(data)
    return f"{files} ({n} documents, {where})" if where != "--data" else f"{files} ({n} documents)"


def seq_len_of(source, args) -> int:
    """``--seq-len``, else the source's own."""
    return args.seq_len or source.seq_len


# ---- Megatron runs (integrations/megatron_checkpoint.py documents the checkpoint format) ----
def _megatron_single_process() -> None:
    """Megatron groups with TP=1 (a 1-process gloo group if none exists); CPU workarounds."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dattri_ds.models.megatron_gpt import cpu_workarounds

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() != 1:
            raise ConfigError("Offline tools rebuild Megatron models with TP=1, but this process "
                              "already initialized Megatron with tensor parallelism "
                              f"{ps.get_tensor_model_parallel_world_size()}")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    if not torch.cuda.is_available():  # docs/cpu_setup.md
        cpu_workarounds()


def _megatron_model(root: Path, tag: str) -> torch.nn.Module:
    """The TP=1 GPTModel of a Megatron run's consolidated checkpoint, prepared for capture."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|Torch Norm).*")
        from dattri_ds.integrations.megatron import prepare_model
        from dattri_ds.integrations.megatron_checkpoint import (
            load_consolidated, read_consolidated,
        )
        from dattri_ds.models.megatron_gpt import MegatronLM, build_gpt

    cfg = read_json(root / "model/config.json", "--run")
    if cfg.get("backend") != "megatron":
        raise ConfigError(f"{root / 'checkpoints' / tag} holds a Megatron checkpoint but "
                          f"{root / 'model/config.json'} is not a Megatron model config")
    _megatron_single_process()
    kw = {**cfg["transformer_config"], "tensor_model_parallel_size": 1,
          "sequence_parallel": False}
    gpt = build_gpt(kw, cfg["vocab_size"], cfg["max_position_embeddings"], seed=0)
    try:
        load_consolidated(gpt, read_consolidated(root / "checkpoints" / tag))
    except ConfigError as e:
        raise ConfigError(f"Megatron checkpoint '{tag}' of {root} does not match its model "
                          f"config: {e}") from None
    return prepare_model(MegatronLM(gpt))


def checkpoint_tags(source, wanted: str | None, flag: str) -> list[str]:
    """``source.tags(wanted)``, refusing a value that names no checkpoint (``""``, ``","``).

    Raises:
        ConfigError: ``wanted`` selects nothing (the flag and the available tags named).
    """
    if wanted is not None and not [t for t in wanted.split(",") if t.strip()]:
        raise ConfigError(f"{flag} {wanted!r} names no checkpoint: give all, last or a comma "
                          f"list of tags of {[c['tag'] for c in source.trajectory()]}")
    return source.tags(wanted)


def store_paths(root: Path) -> dict[str, Path]:
    """Checkpoint tag -> store path under ``root`` (or ``root`` itself when it is a store,
    tagged by the checkpoint its manifest records, else by its folder name).

    A directory holding a manifest or any shard file is a store, so a store whose
    ``info.json`` was deleted is found (and refused when it is attached), never skipped.

    Raises:
        ConfigError: ``root`` holds no store.
        StoreCorruptError: ``root`` is a store with a damaged manifest (named).
    """
    from dattri_ds.store.attach import manifest
    from dattri_ds.store.format import store_files

    if store_files(root):
        found = manifest(root)
        return {(found[0].checkpoint if found else None) or root.name: root}
    stores = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and store_files(p)} \
        if root.is_dir() else {}
    if not stores:
        raise ConfigError(f"'{root}' holds no gradient store: run tools/collect.py --out {root}")
    return stores


def store_of(root: Path, tag: str, flag: str = "--store") -> Path:
    """The store of checkpoint ``tag``: ``root`` itself when it is a store (its manifest then
    says which checkpoint it holds), else ``root/<tag>``.

    Raises:
        ConfigError: neither is a store (the expected path named).
    """
    from dattri_ds.store.format import store_files

    if store_files(root):
        return root
    if store_files(root / tag):
        return root / tag
    raise ConfigError(f"{flag} {root}: no gradient store for checkpoint '{tag}' (expected "
                      f"'{root}' or '{root / tag}' to hold one); collect it with "
                      f"tools/collect.py --checkpoints {tag} --out {root}")


def init_distributed() -> tuple[int, int]:
    """(rank, world) under torchrun/deepspeed (gloo on CPU), (0, 1) for a plain process."""
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            atexit.register(_shutdown_distributed)
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shutdown_distributed() -> None:
    """Destroy the group this process created (local, no collective: a rank that failed must
    not make its peers wait): a gloo group left to interpreter shutdown can abort a rank
    ("terminate called without an active exception") after its work is done, which launchers
    report as a failed run."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def write_config(out: Path, name: str, args) -> None:
    """Write the resolved arguments of a tool next to its output."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}_config.json").write_text(json.dumps(vars(args), indent=2, default=str) + "\n")


def recorded_config(folder: str | os.PathLike, name: str) -> dict:
    """The resolved arguments ``write_config(folder, name, ...)`` recorded there (``{}`` when
    nothing was), e.g. the ``--data`` collect read a store's rows from."""
    from dattri_ds.io.files import read_json

    rec = Path(folder) / f"{name}_config.json"
    if not rec.is_file():
        return {}
    got = read_json(rec, f"{name} record", fix=f"remove or repair {rec}")
    return got if isinstance(got, dict) else {}


def example_ids(data, rows: torch.Tensor, label_shift: int = 1) -> list[str]:
    """The sample ids capture will give these rows (``<doc id>#<content hash>``)."""
    from dattri_ds.capture.semantics import batch_info

    batch = data.batch(rows)
    info = batch_info((), batch, label_shift=label_shift,
                      user_ids=[data.docs[i].id for i in rows.tolist()])
    return list(info.sample_ids)


def gradients(model, data, rows: torch.Tensor, *, capture, batch_size: int,
              device: torch.device | str = "cpu", progress: str | None = None,
              factors=None):
    """Per-example gradients (GradBatch per ``batch_size`` rows) by probe passes
    (``dattri_ds.collect``): no parameter ``.grad`` is touched. ``capture`` is a
    CaptureConfig (projection and whitening by ``factors`` apply); sample ids are
    ``<doc id>#<content hash>``."""
    from dattri_ds import collect

    from dattri_ds.tools.progress import bar as progress_bar  # tqdm on a terminal, else log lines

    chunks = [rows[s:s + batch_size] for s in range(0, rows.numel(), batch_size)]
    bar = progress_bar(rows.numel(), progress)
    batches = (data.batch(idx) for idx in chunks)
    ids = ([data.docs[i].id for i in idx.tolist()] for idx in chunks)
    for idx, got in zip(chunks, collect(model, batches, capture, user_ids=ids, device=device,
                                             factors=factors)):
        if bar is not None:
            bar.update(idx.numel())
        yield got
    if bar is not None:
        bar.close()


def load_texts(path: str | list[str], tokenizer, seq_len: int, max_docs: int | None = None,
               context: int | None = None, truncate: bool = True, queries: bool = False):
    """Tokenized documents of a jsonl file of texts or of token ids (``is_token_file``).

    ``tokenizer`` is a Tokenizer, a callable returning one (called only for text files),
    or None for token-id files. ``queries``: a text line needs only ``text`` (``id``
    defaults to ``q<line>``, ``source`` and ``title`` to empty). Errors name the file and
    the fix.
    """
    from dattri_ds.data import load_documents, tokenize_documents
    from dattri_ds.io.files import check_file
    from dattri_ds.tools.sources import is_token_file, load_token_ids, vocab_size_of

    if not isinstance(path, (str, os.PathLike)) and len(path) == 1:
        path = path[0]
    one = isinstance(path, (str, os.PathLike))
    if one:
        p = check_file(path, "data file", "pass an existing jsonl file of documents or token ids")
    else:  # several text files (a run's train_data)
        for f in path:
            check_file(f, "data file", "pass existing jsonl files of documents")
        p = Path(path[0])
    if one and is_token_file(p):
        data = load_token_ids(p, seq_len, max_docs, vocab_size_of(tokenizer))
        _check_truncation(data, p, seq_len, context, truncate)
        return data
    if callable(tokenizer) and not hasattr(tokenizer, "encode_batch"):
        tokenizer = tokenizer()
    docs = _query_documents(p) if queries and one else load_documents(p if one else list(path))
    if max_docs:
        docs = docs[:max_docs]
    if not docs:
        raise ConfigError(f"'{p}' holds no documents: give at least one jsonl line with a "
                          f"'text' field")
    data = tokenize_documents(docs, tokenizer, seq_len,
                              add_bos=getattr(tokenizer, "bos_id", None) is not None,
                              add_eos=getattr(tokenizer, "eos_id", None) is not None)
    _check_truncation(data, p, seq_len, context, truncate)
    return data


def _query_documents(p: Path) -> list:
    """Query documents: every line a JSON object with a string ``text``; ``id``, ``source``
    and ``title`` optional (a query needs no metadata).

    Raises:
        InputFileError: a line without a string ``text`` (file and line named), a repeated id.
    """
    from dattri_ds.data import Document
    from dattri_ds.errors import InputFileError
    from dattri_ds.io.files import iter_json_lines

    fix = 'write one {"id": ..., "text": ...} object per line'
    docs, seen = [], set()
    for n, d in iter_json_lines(p, "--queries file", 'one {"id"?, "text"} object per line',
                                fix):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str):
            raise InputFileError(f"--queries file {p}:{n}: expected a JSON object with a string "
                                 f"'text', got {str(d)[:60]}. Fix: {fix}")
        doc_id = str(d.get("id", f"q{n}"))
        if doc_id in seen:
            raise InputFileError(f"--queries file {p}:{n}: id '{doc_id}' repeats an earlier "
                                 f"line. Fix: give every query its own id")
        seen.add(doc_id)
        docs.append(Document(doc_id, str(d.get("source", "")), str(d.get("title", "")),
                             d["text"]))
    return docs


def row_texts(data, tokenizer) -> list[str] | None:
    """The text each row of ``data`` holds: token-id rows their ``text`` field (None when
    one lacks it), text rows their tokens decoded (``tokenizer`` a Tokenizer or a callable
    returning one)."""
    if data.tokenizer_fingerprint == "token-ids":
        texts = [d.text for d in data.docs]
        return texts if all(t.strip() for t in texts) else None
    if callable(tokenizer) and not hasattr(tokenizer, "decode"):
        tokenizer = tokenizer()
    return data.texts(tokenizer)


def _check_truncation(data, p: Path, seq_len: int, context: int | None, truncate: bool) -> None:
    if not truncate and bool(data.truncated.any()):
        i = int(torch.nonzero(data.truncated)[0])
        raise ConfigError(
            f"Document '{data.docs[i].id}' of '{p}' is longer than {seq_len} tokens (the model "
            f"context{'' if context is None else f' is {context}'}): shorten it, or pass "
            f"--truncate to score its first {seq_len} tokens")
