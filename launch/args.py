"""The command line of launch/train.py: the DeepSpeed JSON, and the flags that override it.

Every leaf field of the ``"dattri_ds"`` block (launch/config.py) gets one flag, with no edit
here: ``train.<f>`` and ``engine.<f>`` -> ``--<f>``, any other ``<a>.<b>.<f>`` ->
``--<a>-<b>-<f>`` (underscores become dashes), e.g. ``--seq-len``, ``--backend``,
``--capture-projection-dim``, ``--selection-score``. Values are parsed by the same strict
rules as the JSON (dattri_ds/io/schema.py): ``true``/``false`` for booleans (a bare boolean flag
means ``true``, ``--no-<flag>`` means ``false``), integer digits for counts, ``null`` for
"none". Flags override the JSON; each flag's help is its field's attribute docstring.
``ALIASES`` keeps the documented shorter names (``--online-selection``, ``--capture``,
``--target-data``, ...). ``load_run_config`` reads the JSON (its unknown top-level DeepSpeed
keys warned about by name), applies the flags and parses the block.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import warnings
from pathlib import Path
from typing import Any

from dattri_ds.io import schema
from dattri_ds.errors import ConfigError, UsageError
from dattri_ds.launch.checks import check_deepspeed_json, check_memory, check_seq_len
from dattri_ds.launch.config import BLOCK, RunConfig

__all__ = ["build_parser", "parse_args", "flag_name", "ALIASES", "load_run_config",
           "warn_unknown_deepspeed_keys"]

#: Extra names of a flag (key path in the ``"dattri_ds"`` block -> names).
ALIASES: dict[str, tuple[str, ...]] = {
    "capture_enabled": ("--capture",),
    "selection.enabled": ("--online-selection", "--enable-online-selection"),
    "selection.target_data": ("--target-data",),
    "selection.target_max_docs": ("--target-max-docs",),
    "selection.candidate_multiple": ("--candidate-multiple",),
    "selection.refresh_every": ("--refresh-every",),
    "selection.random": ("--random-selection",),
}

#: Sections whose fields are flags without a prefix (``engine.backend`` -> ``--backend``).
_UNPREFIXED = ("train", "engine")


def flag_name(leaf: schema.Leaf) -> str:
    """The generated flag of a config leaf (``train.seq_len`` -> ``--seq-len``)."""
    path = leaf.path[1:] if leaf.path[0] in _UNPREFIXED else leaf.path
    return "--" + "-".join(path).replace("_", "-")


class _FieldAction(argparse.Action):
    """Parse a flag's text strictly and record it under ``namespace.overrides[key path]``."""

    def __init__(self, option_strings: list[str], dest: str, leaf: schema.Leaf,
                 **kwargs: Any) -> None:
        self.leaf = leaf
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        key = f"{BLOCK}.{self.leaf.key}"
        if option_string is not None and option_string.startswith("--no-"):
            values = "false"  # the --no-<flag> form of a boolean field
        try:
            value = schema.parse_text(self.leaf.hint, values, key, self.leaf.meta)
        except Exception as e:  # ConfigError: name the flag, keep the key path
            raise UsageError(f"{option_string} {_shown(values)}: {e}") from None
        overrides = dict(getattr(namespace, "overrides", None) or {})
        overrides[self.leaf.path] = value
        namespace.overrides = overrides


def _shown(values: Any) -> str:
    return " ".join(values) if isinstance(values, list) else str(values)


def _add_field_flags(p: argparse.ArgumentParser) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for leaf in schema.leaves(RunConfig):
        section = leaf.path[0] if len(leaf.path) > 1 else "run"
        if section not in groups:
            groups[section] = p.add_argument_group(
                f"{section} settings ({BLOCK}.{section}.* in the DeepSpeed JSON; flags win)"
                if section != "run" else f"run settings ({BLOCK}.* in the DeepSpeed JSON)")
        names = [flag_name(leaf), *ALIASES.get(leaf.key, ())]
        members, _ = schema._split_optional(leaf.hint)
        kw: dict[str, Any] = {}
        if members == [bool]:
            kw = {"nargs": "?", "const": "true", "metavar": "true|false"}
        elif getattr(members[0], "__origin__", None) is tuple:
            kw = {"nargs": "+", "metavar": "STR"}
        else:
            kw = {"metavar": leaf.path[-1].upper()}
        default = "" if leaf.default is schema._MISSING else \
            f" [default {schema._show(leaf.default)}]"
        helptext = f"{leaf.doc} ({schema.describe(leaf.hint, leaf.meta)}){default}".replace(
            "%", "%%")
        groups[section].add_argument(*names, action=_FieldAction, leaf=leaf,
                                     dest=f"field:{leaf.key}", default=argparse.SUPPRESS,
                                     help=helptext, **kw)
        if members == [bool]:
            groups[section].add_argument(
                "--no-" + names[0][2:], action=_FieldAction, leaf=leaf, nargs=0,
                dest=f"field:{leaf.key}", default=argparse.SUPPRESS,
                help=f"same as {names[0]}=false")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a causal LM with DeepSpeed; capture per-example gradients and "
                    "select data online with dattri-ds. Settings come from the 'dattri_ds' "
                    "block of the DeepSpeed JSON; the flags below override them.",
        allow_abbrev=False)
    p.set_defaults(overrides={})
    p.add_argument("--out", default="runs/train", help="output directory")
    p.add_argument("--verbose", action="store_true",
                   help="also show what DeepSpeed, Megatron-core and transformers log (their "
                        "banners, parameter lists and warnings; hidden by default)")
    _add_field_flags(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                   help="set by the deepspeed launcher")
    try:
        import deepspeed

        deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    except ImportError:  # pragma: no cover - deepspeed is an optional extra
        p.add_argument("--deepspeed_config")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed flags; ``.overrides`` maps key paths of the ``"dattri_ds"`` block to values."""
    p = build_parser()
    args = p.parse_args(argv)
    if not getattr(args, "deepspeed_config", None):
        p.error("--deepspeed_config is required (e.g. configs/zero3_cpu.json)")
    return args


def load_run_config(path: str | Path, overrides: dict[tuple[str, ...], Any] | None = None
                    ) -> tuple[dict[str, Any], RunConfig]:
    """Read a DeepSpeed JSON; return (DeepSpeed config without our block, our RunConfig).

    Args:
        path: the DeepSpeed JSON (``--deepspeed_config``).
        overrides: ``{key path: value}`` from the generated flags (``parse_args``); they
            replace the JSON's values before the block is parsed.

    Raises:
        ConfigError: the file is missing, not UTF-8, not JSON (file:line:column), a value
            of the block is invalid (its key path named), or DeepSpeed would refuse a key
            (``check_deepspeed_json``; the three batch keys come back resolved).
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
    check_deepspeed_json(ds, cfg, str(p))  # the batch rule; what DeepSpeed would assert
    check_memory(ds, cfg)
    return ds, cfg


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
