"""A launch/train.py output folder as a tool source (``Run``).

The folder holds ``model/config.json``, the tokenizer (``tokenizer.model`` or Hugging Face
files), ``checkpoints/<tag>/`` (DeepSpeed, ``save_pretrained`` or consolidated Megatron
checkpoints), ``trajectory.json`` (each checkpoint's step and learning rate) and
``resolved_dattri_ds_config.json`` (the run's ``train`` settings: seq_len, training data).
docs/offline_tools.md has the layout.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dattri_ds.data import Tokenizer
from dattri_ds.errors import ConfigError
from dattri_ds.io.files import check_dir, model_dir, read_json
from dattri_ds.io.tokenizer_files import check_sentencepiece
from dattri_ds.integrations.checkpoints import load_state_dict
from dattri_ds.integrations.megatron_checkpoint import is_consolidated
from dattri_ds.tools.provenance import DataOrigin, recorded_origin
from dattri_ds.tools.runtime import quiet_stdout
from dattri_ds.tools.sources.base import config_vocab_size, pick_tags, required_context
from dattri_ds.tools.sources.hf import HFTokenizer, hf_tokenizer_dir, is_hf_model_dir, load_hf_model
from dattri_ds.tools.sources.megatron import megatron_model

__all__ = ["Run"]

_SPM_FIX = ("copy the run's tokenizer.model again, or pass --tokenizer with a Hugging Face "
            "tokenizer folder")


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
        hint = ("it records the run's train.seq_len (launch/train.py writes it to the --out "
                "folder you pass as --run-dir). Fix: pass --seq-len N, the tokens per example")
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
        return required_context(self.root / "model/config.json")

    @property
    def vocab_size(self) -> int | None:
        return config_vocab_size(self.root / "model/config.json")

    def training_record(self) -> DataOrigin | None:
        """The run's own training data: ``train.data_path`` (prepared data, with
        ``train.packing``) or ``train.train_data``, and ``train.max_docs``, of
        ``resolved_dattri_ds_config.json`` as written there (None when it names none;
        ``tools.provenance.training_data`` finds the files)."""
        cfg, train = self._train_record()
        return recorded_origin(train, cfg, "the run's training data", jsonl_key="train_data",
                               prefix="train.")

    def tokenizer(self):
        """SentencePiece ``tokenizer.model``, else the Hugging Face tokenizer found at open."""
        if self.tokenizer_path is not None:
            return HFTokenizer(self.tokenizer_path)
        spm = self.root / "tokenizer.model"
        if spm.exists() or spm.is_symlink():  # a broken link is named by the reader
            return Tokenizer.load(check_sentencepiece(spm, "--run tokenizer", _SPM_FIX))
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
        return pick_tags(tags, wanted, self.checkpoint)

    def default_tags(self, tool_default: str) -> str:
        return tool_default

    @property
    def run_id(self) -> str | None:
        """The id launch/train.py gave this run (``trajectory.json``), None for older runs."""
        path = self.root / "trajectory.json"
        data = read_json(path, "--run") if path.exists() else None
        return data.get("run_id") if isinstance(data, dict) else None

    def fingerprint(self) -> str:
        """Identity of the model family: model config + tokenizer (stores record it)."""
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
        if is_consolidated(self.root / "checkpoints" / tag):
            return megatron_model(self.root, tag).to(device).eval()
        from transformers import AutoConfig, AutoModelForCausalLM

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
