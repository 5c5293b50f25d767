"""What launch/train.py reads, checked at start (before any process group): each a one-line error.

* ``check_seq_len``: ``--seq-len`` against the positions of the model (``n_positions`` /
  ``max_position_embeddings`` of ``--model-config`` or ``--model-path``), naming both
  numbers; a longer sequence would fail at the first forward with an index error.
* ``check_texts``: the target (``--target-data``, with ``--online-selection``) and held-out
  (``--eval-data``, ``--general-eval-data``, with ``--eval-every``) files hold text: a file
  whose every text is whitespace would rank candidates against an empty target (content and
  gradient scores alike) or evaluate nothing.
* ``check_init_from`` (launch/init_from.py): the run ``--init-from`` names.
"""

from __future__ import annotations

from pathlib import Path

from dattri_ds.errors import ConfigError
from dattri_ds.launch.config import RunConfig

__all__ = ["check_inputs", "check_seq_len", "check_texts", "model_positions"]

#: Config keys holding a model's number of positions, in the order Hugging Face reads them.
_POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length")


def model_positions(cfg: RunConfig) -> tuple[int, str, Path] | None:
    """``(positions, key, file)`` of the run's model config, None when it names none or
    cannot be read (the model's own error follows later). A GPT-2 config without
    ``n_positions`` has Hugging Face's default, 1024."""
    from dattri_ds.files import read_json

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


def check_texts(path: str, flag: str) -> None:
    """Raises: ConfigError: every text of the jsonl file ``path`` (given by ``flag``) is
    whitespace (InputFileError for a file that cannot be read, from the reader)."""
    from dattri_ds.data.corpus import load_documents

    docs = load_documents(path)
    if all(not d.text.strip() for d in docs):
        what = "its only text is" if len(docs) == 1 else f"all {len(docs)} texts are"
        raise ConfigError(f"{flag} {path}: {what} whitespace, so there is nothing to compare "
                          f"with or evaluate. Fix: pass a jsonl file whose \"text\" fields "
                          f"hold the texts you care about")


def check_inputs(cfg: RunConfig) -> str | None:
    """Every start check above; the ``--init-checkpoint`` tag to load (None: none).

    Raises:
        ConfigError: naming the flag, the value and the fix.
    """
    from dattri_ds.launch.init_from import check_init_from

    check_seq_len(cfg)
    sc, tc = cfg.selection, cfg.train
    if sc.enabled and sc.target_data is not None and not sc.target_store:
        check_texts(sc.target_data, "--target-data")
    if tc.eval_every:
        if tc.eval_data is not None:
            check_texts(tc.eval_data, "--eval-data")
        if tc.general_eval_data is not None:
            check_texts(tc.general_eval_data, "--general-eval-data")
    return check_init_from(cfg)
