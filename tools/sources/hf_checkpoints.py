"""A list of Hugging Face checkpoint folders (``--checkpoints DIR [DIR ...]``) read as one run.

    dattri-ds collect --checkpoints 'out/checkpoint-*' --data train.jsonl --out grads
    dattri-ds fit --checkpoints out/checkpoint-500 out/checkpoint-1000 --out factors
    dattri-ds attribute --checkpoints 'out/checkpoint-*' --store grads --queries q.jsonl \
        --factors factors --out attr        # ekfac-trajectory over every listed checkpoint

Each folder is a ``save_pretrained`` folder (e.g. the ``Trainer``'s ``checkpoint-<step>/``);
a value with ``*``, ``?`` or ``[`` is a glob expanded in natural order. Steps and learning
rates come from each ``trainer_state.json``, else ``--steps`` / ``--lrs``; each checkpoint is
tagged by its folder name, so the tools treat the list as a run folder
(docs/offline_tools.md, "Hugging Face checkpoints", has the rules).
"""

from __future__ import annotations

import glob
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.io.files import model_dir, read_json
from dattri_ds.tools.sources.base import pick_tags
from dattri_ds.tools.sources.hf import (
    HFModelDir, NoRunRecords, hf_tokenizer_dir, load_hf_model,
)

__all__ = ["HFCheckpoints", "expand_folders", "trainer_state", "natural_key"]

#: config.json keys that differ between checkpoints of one model (not its architecture).
_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


def natural_key(text: str) -> tuple:
    """Sort key with digit runs compared as numbers: ``checkpoint-500`` < ``checkpoint-1000``."""
    return tuple((0, int(s), "") if digits else (1, 0, s) for digits, g in
                 itertools.groupby(text, str.isdigit) for s in ["".join(g)])


def expand_folders(values: list[str]) -> list[Path]:
    """The folders ``--checkpoints`` names: globs expanded in natural order, in the order given.

    Raises:
        ConfigError: a glob matching no folder, or a folder given twice.
    """
    out: list[Path] = []
    for v in values:
        if any(c in v for c in "*?["):
            hits = sorted((h for h in glob.glob(os.path.expanduser(v)) if os.path.isdir(h)),
                          key=natural_key)
            if not hits:
                raise ConfigError(f"--checkpoints {v!r} matches no folder. Fix: give Hugging "
                                  f"Face checkpoint folders or a glob matching them (e.g. "
                                  f"'out/checkpoint-*', quoted)")
            out += [Path(h) for h in hits]
        else:
            out.append(Path(os.path.expanduser(v)))
    seen: dict[str, Path] = {}
    for p in out:
        key = os.path.realpath(p)
        if key in seen:
            raise ConfigError(f"--checkpoints names the folder {p} twice (also as "
                              f"{seen[key]}). Fix: give each checkpoint folder once")
        seen[key] = p
    return out


def trainer_state(folder: Path) -> tuple[int | None, float | None]:
    """``(step, lr)`` of a checkpoint from its ``trainer_state.json`` (None for what it lacks,
    both None without the file): ``global_step``, and the ``learning_rate`` of the last
    ``log_history`` entry whose ``step`` is at most that.

    Raises:
        InputFileError: the file is unreadable or not JSON (named).
    """
    path = folder / "trainer_state.json"
    if not path.exists() and not path.is_symlink():
        return None, None
    state = read_json(path, "trainer state", fix="pass --steps and --lrs instead")
    if not isinstance(state, dict):
        return None, None
    step = state.get("global_step")
    step = step if type(step) is int and step >= 0 else None
    logged = [e for e in state.get("log_history") or [] if isinstance(e, dict)
              and type(e.get("learning_rate")) in (int, float) and type(e.get("step")) is int
              and (step is None or e["step"] <= step)]
    lr = float(max(logged, key=lambda e: e["step"])["learning_rate"]) if logged else None
    return step, lr


@dataclass(frozen=True)
class HFCheckpoints(NoRunRecords):
    """Hugging Face checkpoint folders of one training run, ordered by step, as a tool source.

    A ``Source`` (``tools.sources.base``) as a run folder is, so collect, fit, attribute
    and curate read it as they read one.

    Attributes:
        folders: the checkpoint folders, oldest step first.
        entries: ``{"tag", "step", "lr"}`` per folder (``lr`` None when neither its
            ``trainer_state.json`` nor ``--lrs`` gives one; only lr-weighted scores need it).
        tokenizer_path: ``--tokenizer``, else the newest folder holding tokenizer files.
    """

    folders: tuple[Path, ...]
    entries: tuple[dict, ...]
    tokenizer_path: Path | None = None

    @staticmethod
    def open(values: list[str], steps: list[int] | None = None, lrs: list[float] | None = None,
             tokenizer: str | os.PathLike | None = None) -> HFCheckpoints:
        """The folders ``values`` names (``expand_folders``), each with its step and lr.

        Raises:
            ConfigError: a folder that is no model folder, ``--steps``/``--lrs`` of another
                length than the folders, a step or lr neither file nor flag gives, two
                folders with one step or one name, or folders of different models.
        """
        folders = [model_dir(f, "--checkpoints", "give Hugging Face checkpoint folders "
                             "(save_pretrained: config.json + weights), one per checkpoint")
                   for f in expand_folders(values)]
        for flag, given in (("--steps", steps), ("--lrs", lrs)):
            if given is not None and len(given) != len(folders):
                raise ConfigError(
                    f"{flag} gives {len(given)} value(s) for {len(folders)} checkpoint "
                    f"folder(s) ({', '.join(str(f) for f in folders)}). Fix: give one {flag} "
                    f"value per folder, in the order of --checkpoints (globs expanded)")
        entries = []
        for i, f in enumerate(folders):
            step, lr = trainer_state(f)
            step = steps[i] if steps is not None else step
            lr = lrs[i] if lrs is not None else lr
            if step is None:
                raise ConfigError(
                    f"The step of checkpoint folder {f} is unknown: it has no "
                    f"trainer_state.json with a global_step. Fix: pass --steps with one step "
                    f"per --checkpoints folder (in their order)")
            entries.append({"tag": _tag(f), "step": step, "lr": lr})
        _check_unique(folders, entries)
        order = sorted(range(len(folders)), key=lambda i: entries[i]["step"])
        folders, entries = [folders[i] for i in order], [entries[i] for i in order]
        _check_same_model(folders)
        tok = Path(tokenizer) if tokenizer else hf_tokenizer_dir(*reversed(folders))
        return HFCheckpoints(tuple(folders), tuple(entries), tok)

    @property
    def root(self) -> Path:
        """The newest checkpoint folder (its ``config.json`` describes every checkpoint)."""
        return self.folders[-1]

    @property
    def context(self) -> int:
        """The newest folder's model context (``HFModelDir.context``)."""
        return self._single().context

    @property
    def seq_len(self) -> int:
        """The model's context (``--seq-len`` overrides it in the tools)."""
        return self._single().seq_len

    @property
    def vocab_size(self) -> int | None:
        return self._single().vocab_size

    def tokenizer(self):
        return self._single().tokenizer()

    def trajectory(self) -> list[dict]:
        """``[{"tag", "step", "lr"}]``, oldest first (``trajectory.json``'s entries)."""
        return [dict(e) for e in self.entries]

    def folder(self, tag: str) -> Path:
        return self.folders[self._index(tag)]

    def checkpoint(self, tag: str) -> dict:
        """The entry of ``tag``; its ``lr`` is known (scores weighted by lr read it).

        Raises:
            ConfigError: ``tag`` is not listed, or its learning rate is unknown (names
                ``--lrs``).
        """
        e = self.entries[self._index(tag)]
        if e["lr"] is None:
            raise ConfigError(
                f"The learning rate of checkpoint '{tag}' is unknown ({self.folder(tag)} has "
                f"no trainer_state.json logging a learning_rate at or before step "
                f"{e['step']}), and lr-weighted scores need it. Fix: pass --lrs with one "
                f"learning rate per --checkpoints folder (in their order), or score without "
                f"lr weighting (attribute --weighting uniform or normalized)")
        return dict(e)

    def tags(self, wanted: str | None) -> list[str]:
        """``all``/None -> every listed checkpoint, ``last`` -> the newest, else a comma list."""
        return pick_tags([e["tag"] for e in self.entries], wanted, self._index)

    def default_tags(self, tool_default: str) -> str:
        """``all``: the folders listed are the checkpoints the user chose."""
        return "all"

    def fingerprint(self) -> str:
        """The model family (config + tokenizer), as ``--model`` on one of the folders."""
        return self._single().fingerprint()

    def model(self, tag: str, device: torch.device | str = "cpu"):
        """The model saved in checkpoint ``tag``'s folder, fp32, eval mode (dropout off)."""
        return load_hf_model(self.folder(tag), device)

    def _single(self) -> HFModelDir:
        return HFModelDir(self.root, self.tokenizer_path)

    def _index(self, tag: str) -> int:
        for i, e in enumerate(self.entries):
            if e["tag"] == tag:
                return i
        raise ConfigError(f"Checkpoint '{tag}' is not one of the --checkpoints folders; listed: "
                          f"{[e['tag'] for e in self.entries]}")


def _tag(folder: Path) -> str:
    return Path(os.path.abspath(folder)).name


def _check_unique(folders: list[Path], entries: list[dict]) -> None:
    for key, what in (("tag", "folder name (its tag: stores and factors are named by it)"),
                      ("step", "step")):
        seen: dict = {}
        for f, e in zip(folders, entries):
            if e[key] in seen:
                raise ConfigError(
                    f"--checkpoints folders {seen[e[key]]} and {f} have the same {what} "
                    f"{e[key]!r}. Fix: give checkpoints of one training run"
                    + (", or pass --steps" if key == "step" else ", with distinct names"))
            seen[e[key]] = f


def _check_same_model(folders: list[Path]) -> None:
    """Every folder holds the same architecture (``config.json`` equal but for
    :data:`_VOLATILE` keys)."""
    def arch(f: Path) -> dict:
        cfg = read_json(f / "config.json", "model config")
        return {k: v for k, v in cfg.items() if k not in _VOLATILE}

    first = arch(folders[0])
    for f in folders[1:]:
        other = arch(f)
        if other != first:
            key = next(k for k in sorted(set(first) | set(other)) if first.get(k) != other.get(k))
            raise ConfigError(
                f"--checkpoints folders hold different models: {folders[0]}/config.json and "
                f"{f}/config.json differ at {key!r} ({json.dumps(first.get(key))} vs "
                f"{json.dumps(other.get(key))}). Fix: give checkpoints of one training run")
