"""Refusals before the first step: engines and target data online selection cannot serve."""

from __future__ import annotations

from dattri_ds.errors import ConfigError

__all__ = ["check_engine_supported", "check_target_compatible"]


def check_engine_supported(engine: object) -> None:
    """Raise ConfigError, before any step, for DeepSpeed features selection cannot serve."""
    names = {c.__name__ for c in type(engine).__mro__}
    if "PipelineEngine" in names:
        raise ConfigError("Online selection does not support DeepSpeed pipeline parallelism "
                          "(PipelineEngine): candidates must be scored by one module call. Use "
                          "ZeRO data parallelism, or turn selection off")
    cfg = getattr(engine, "_config", None)
    if cfg is not None and getattr(cfg, "sequence_parallel_size", 1) > 1:
        raise ConfigError("Online selection does not support DeepSpeed sequence parallelism "
                          "(sequence_parallel_size > 1)")
    data_eff = getattr(cfg, "data_efficiency_config", None) or {}
    if isinstance(data_eff, dict) and data_eff.get("enabled"):
        raise ConfigError("Online selection and DeepSpeed data_efficiency both reorder the "
                          "training data; enable only one of them")


def check_target_compatible(train: object, target: object) -> None:
    """Refuse target data tokenized differently from the training data (before any step).

    Both arguments are ``TokenizedDocuments``-like: ``tokenizer_fingerprint`` and ``seq_len``.
    """
    tf = getattr(train, "tokenizer_fingerprint", "")
    gf = getattr(target, "tokenizer_fingerprint", "")
    if tf and gf and tf != gf:
        raise ConfigError(f"The target data was tokenized with '{gf}' but the training data with "
                          f"'{tf}': tokenize the target texts with the training tokenizer")
    if train.seq_len != target.seq_len:
        raise ConfigError(f"Target examples have {target.seq_len} tokens but training examples "
                          f"have {train.seq_len}: tokenize both with the same seq_len")
    if len(target) == 0:
        raise ConfigError("The target set is empty: give selection.target_data at least one "
                          "document")
