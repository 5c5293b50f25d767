"""The flags naming a tool's source, and the source and checkpoints they choose.

``--run-dir`` (a launch/train.py run), ``--model`` (one Hugging Face model folder) or
``--checkpoints DIR [DIR ...]`` (Hugging Face checkpoint folders) name the ``Source``;
with ``--run-dir`` / ``--model``, ``--checkpoints`` chooses tags instead (``all`` | ``last``
| ``tag,tag``). A folder given to the wrong flag is an error naming the flag that reads it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dattri_ds.errors import ConfigError
from dattri_ds.io.files import check_dir
from dattri_ds.io.schema import add_flag, flag_type
from dattri_ds.tools.sources.base import Source, check_checkpoints
from dattri_ds.tools.sources.hf import HFModelDir, is_hf_model_dir
from dattri_ds.tools.sources.hf_checkpoints import HFCheckpoints, natural_key
from dattri_ds.tools.sources.run import Run

__all__ = ["add_source_args", "add_checkpoint_args", "open_source", "folder_list",
           "tag_choice", "source_tags", "checkpoint_tags", "source_flags"]


def add_source_args(p) -> None:
    """The flags naming what a tool reads: a run or a model folder, tokenizer, seq_len.

    ``--run-dir`` is also accepted as ``--run`` (plain ``python``); under torchrun use
    ``--run-dir`` (torchrun reads ``--run`` as an ambiguous prefix of its ``--run-path``).
    ``--local_rank`` (added by the ``deepspeed`` launcher) is accepted and ignored: ranks
    come from the environment. A list of Hugging Face checkpoint folders comes in through
    :func:`add_checkpoint_args`.
    """
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


def open_source(args) -> Source:
    """The Run, HFModelDir or HFCheckpoints the parsed source flags name.

    ``--run-dir`` takes a run folder (or one model folder); ``--model`` one model folder;
    ``--checkpoints`` alone a list of checkpoint folders (``tools.sources.hf_checkpoints``). A
    folder given to the wrong flag is an error naming the flag that reads it.

    Raises:
        ConfigError: not exactly one source, a folder of another layout than its flag
            reads (the flag that reads it named), --steps / --lrs without folders.
    """
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


def _open_folder(path: Path, flag: str, tokenizer) -> Source:
    """``--run-dir`` / ``--model`` ``path`` by its layout; another layout names its flag."""
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
    check_dir(path, "--run-dir folder", "pass the --out folder of launch/train.py")
    raise ConfigError(
        f"--run-dir {path} is not a run folder (it has no model/config.json; the layout is in "
        f"docs/offline_tools.md) nor a model folder (config.json + weights). Fix: pass --run-dir "
        f"the --out folder of launch/train.py, or --checkpoints with Hugging Face checkpoint "
        f"folders")


def source_tags(source: Source, args, default: str, flag: str = "--checkpoints",
                chosen: str | None = None) -> list[str]:
    """The checkpoints a tool reads: ``chosen`` (a tool's own tag flag) or the tag choice of
    ``--checkpoints``, else the source's default for the tool's ``default``
    (``Source.default_tags``: every folder of a ``--checkpoints`` folder list); their files
    are checked whole (``check_checkpoints``).

    Raises:
        ConfigError: no such checkpoint; InputFileError: one of its files is cut or damaged.
    """
    wanted = chosen if chosen is not None else tag_choice(args)
    tags = checkpoint_tags(source, source.default_tags(default) if wanted is None else wanted,
                           flag)
    check_checkpoints(source, tags)  # their files whole, before the tool writes anything
    return tags


def checkpoint_tags(source: Source, wanted: str | None, flag: str) -> list[str]:
    """``source.tags(wanted)``, refusing a value that names no checkpoint (``""``, ``","``).

    Raises:
        ConfigError: ``wanted`` selects nothing (the flag and the available tags named).
    """
    if wanted is not None and not [t for t in wanted.split(",") if t.strip()]:
        raise ConfigError(f"{flag} {wanted!r} names no checkpoint: give all, last or a comma "
                          f"list of tags of {[c['tag'] for c in source.trajectory()]}")
    return source.tags(wanted)


def source_flags(args) -> str:
    """The source flags a tool was given (``--run-dir R``, ``--model M`` or ``--checkpoints
    DIR ...``), for a fix that repeats them."""
    return (f"--run-dir {args.run}" if args.run else f"--model {args.model}" if args.model
            else f"--checkpoints {' '.join(args.checkpoints or [])}")
