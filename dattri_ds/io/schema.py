"""Strict typed parsing of the frozen config dataclasses, driven by their type hints.

The dataclasses are the single source of truth: a field's type hint says what a JSON value
or a flag string may be, ``field(metadata=bounds(...))`` declares its range once, and the
attribute docstring under it is its help text. Every failure is one
:class:`~dattri_ds.errors.ConfigError` whose one-line message names the full key path, the
value, what is allowed and the fix. The rules per type: docs/training.md ("Configuration,
flags and errors").
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union

from dattri_ds.errors import ConfigError

__all__ = ["bounds", "partial", "parse", "parse_value", "parse_text", "check", "Leaf",
           "leaves", "describe", "field_docs", "read_json", "FlagType", "flag_type",
           "field_flag"]

_MISSING = dataclasses.MISSING


def bounds(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, ne: float | None = None,
           nonfinite: bool = False, min_items: int = 0) -> dict[str, Any]:
    """Field metadata declaring a range: ``field(default=1, metadata=bounds(ge=1))``.

    ``None`` values of an ``Optional`` field are not range-checked. ``nonfinite`` allows
    NaN/inf for a float field (refused by default); ``min_items`` is the shortest list a
    ``tuple`` field takes.
    """
    return {"bounds": {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt),
                                         ("ne", ne)) if v is not None},
            "nonfinite": nonfinite, "min_items": min_items}


def partial(cls: type) -> dict[str, Any]:
    """Field metadata for a ``dict`` field holding a subset of ``cls``'s fields (each checked
    as in ``cls``); the owner fills in the rest when it builds the ``cls``."""
    return {"partial": cls}


# ---- introspection (cached per class) --------------------------------------------------

@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # pragma: no cover - source not available
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return _MISSING


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


# ---- describing what is allowed --------------------------------------------------------

def _split_optional(hint: Any) -> tuple[list[Any], bool]:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = list(typing.get_args(hint))
        return [a for a in args if a is not type(None)], type(None) in args
    return [hint], False


def _range_text(meta: dict[str, Any]) -> str:
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "ne": "!="}
    return " and ".join(f"{ops[k]} {v}" for k, v in meta.get("bounds", {}).items())


def describe(hint: Any, meta: dict[str, Any] | None = None) -> str:
    """What a value of ``hint`` may be, in words (used in errors and flag help)."""
    meta = meta or {}
    members, optional = _split_optional(hint)
    parts = [_describe_one(m, meta) for m in members]
    text = " or ".join(parts)
    return f"{text} or null" if optional else text


def _describe_one(hint: Any, meta: dict[str, Any]) -> str:
    rng = _range_text(meta)
    rng = f" {rng}" if rng else ""
    if hint is bool:
        return "true or false (a JSON boolean, unquoted)"
    if hint is int:
        return f"an integer{rng}"
    if hint is float:
        return f"a {'' if meta.get('nonfinite') else 'finite '}number{rng}"
    if hint is str:
        return "a non-empty string"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(_json(c) for c in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        n = meta.get("min_items", 0)
        return (f"a list of {f'at least {n} ' if n else ''}strings (e.g. [\"a\", \"b\"]; one "
                f"string is a list of one)")
    if dataclasses.is_dataclass(hint):
        return f"an object with keys {', '.join(f.name for f in _fields(hint))}"
    if meta.get("partial") is not None:
        return f"an object with keys {', '.join(f.name for f in _fields(meta['partial']))}"
    if typing.get_origin(hint) is dict or hint is dict:
        return "an object"
    return "any value"


def _json(v: Any) -> str:
    if v is None or isinstance(v, (bool, int, float, str)):
        return json.dumps(v, allow_nan=True)
    return repr(v)


def _show(v: Any) -> str:
    """A value as it appears in JSON, shortened to fit on one line."""
    if isinstance(v, (dict, list, tuple)):
        text = json.dumps(v, default=str, allow_nan=True)
    elif isinstance(v, str):
        text = json.dumps(v)
    else:
        text = _json(v)
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            tuple: "list", dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _fail(path: str, value: Any, hint: Any, meta: dict[str, Any], default: Any = _MISSING,
          why: str = "") -> ConfigError:
    allowed = describe(hint, meta)
    fix = "give a value of that form"
    if default is not _MISSING and not dataclasses.is_dataclass(default):
        fix += f", or remove the key to use the default {_show(default)}"
    reason = f" ({why})" if why else ""
    return ConfigError(f"{path} = {_show(value)} ({_type_name(value)}) is not allowed{reason}: "
                       f"expected {allowed}. Fix: {fix}")


# ---- parsing JSON-like values ------------------------------------------------------------

def parse(cls: type, value: Any, path: str) -> Any:
    """Build config dataclass ``cls`` from a JSON object, checking every key (also keys the
    chosen options do not use) before anything is constructed.

    Raises:
        ConfigError: naming ``path.<key>``, the value, what is allowed and the fix.
    """
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise _fail(path, value, cls, {})
    kwargs = _parse_fields(cls, value, path, required=True)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # cross-field checks in __post_init__
        raise ConfigError(f"{path}: {e}") from None
    except TypeError as e:  # pragma: no cover - a required field the schema missed
        raise ConfigError(f"{path}: {e}") from None


def _parse_fields(cls: type, value: dict, path: str, *, required: bool) -> dict[str, Any]:
    fields = {f.name: f for f in _fields(cls)}
    unknown = [k for k in value if k not in fields]
    if unknown:
        k = unknown[0]
        raise ConfigError(
            f"{path}.{k} is not a known key (value {_show(value[k])}); allowed keys in {path}: "
            f"{', '.join(fields)}. Fix: correct the spelling or remove '{k}'")
    hints = _hints(cls)
    out = {}
    for name, f in fields.items():
        if name in value:
            out[name] = parse_value(hints[name], value[name], f"{path}.{name}", f.metadata,
                                    f.default)
        elif required and f.default is _MISSING and f.default_factory is _MISSING:
            raise ConfigError(f"{path}.{name} is required: {describe(hints[name], f.metadata)}. "
                              f"Fix: add \"{name}\" to {path}")
    return out


def parse_value(hint: Any, value: Any, path: str, meta: Any = None,
                default: Any = _MISSING) -> Any:
    """``value`` (from JSON) checked against ``hint`` and ``meta``'s range; returns the
    value to store (lists become tuples, objects become config dataclasses)."""
    meta = dict(meta or {})
    members, optional = _split_optional(hint)
    if value is None:
        if optional:
            return None
        raise _fail(path, value, hint, meta, default, "null is not allowed here")
    errors = []
    for m in members:
        try:
            return _parse_one(m, value, path, meta, default, hint)
        except ConfigError as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    raise _fail(path, value, hint, meta, default)


#: The JSON values a plain type hint takes: a bool is not an int, "" is not a str.
_ACCEPTS: dict[Any, Callable[[Any], bool]] = {
    bool: lambda v: type(v) is bool, int: lambda v: type(v) is int,
    float: lambda v: type(v) in (int, float), str: lambda v: isinstance(v, str) and v != "",
    dict: lambda v: isinstance(v, dict), Any: lambda v: True,
}


def _parse_one(hint: Any, value: Any, path: str, meta: dict, default: Any,
               full: Any) -> Any:
    if dataclasses.is_dataclass(hint):
        return parse(hint, value, path)
    if meta.get("partial") is not None:
        if not isinstance(value, dict):
            raise _fail(path, value, full, meta, default)
        return _parse_fields(meta["partial"], value, path, required=False)
    origin = typing.get_origin(hint)
    if origin is Literal:
        if not any(type(value) is type(c) and value == c for c in typing.get_args(hint)):
            raise _fail(path, value, full, meta, default)
        return value
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if isinstance(value, str) and item is str:  # one path or pattern: a list of one
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise _fail(path, value, full, meta, default)
        if len(value) < meta.get("min_items", 0):
            raise _fail(path, value, full, meta, default, "too few items")
        return tuple(parse_value(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    base = dict if origin is dict else hint
    if base not in _ACCEPTS:
        raise TypeError(f"schema: unsupported type hint {hint!r} at {path}")  # programming error
    if not _ACCEPTS[base](value):
        raise _fail(path, value, full, meta, default)
    if base is float and not math.isfinite(value) and not meta.get("nonfinite"):
        raise _fail(path, value, full, meta, default, "not finite")
    return _check_range(value, path, full, meta, default) if base in (int, float) else value


def _check_range(value: float, path: str, hint: Any, meta: dict, default: Any) -> float:
    b = meta.get("bounds", {})
    ok = (("ge" not in b or value >= b["ge"]) and ("gt" not in b or value > b["gt"])
          and ("le" not in b or value <= b["le"]) and ("lt" not in b or value < b["lt"])
          and ("ne" not in b or value != b["ne"]))
    if not ok:
        raise _fail(path, value, hint, meta, default, "out of range")
    return value


def check(obj: Any, where: str) -> None:
    """Validate a constructed config dataclass's fields in ``__post_init__`` (Python callers
    get the same rules as JSON). Lists of a ``tuple`` field are converted to tuples."""
    cls = type(obj)
    hints = _hints(cls)
    for f in _fields(cls):
        value = getattr(obj, f.name)
        hint = hints[f.name]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            members, _ = _split_optional(hint)
            if type(value) in members:
                continue  # validated by its own __post_init__
        parsed = parse_value(hint, value, f"{where}.{f.name}", f.metadata, f.default)
        if isinstance(parsed, tuple) and not isinstance(value, tuple):
            object.__setattr__(obj, f.name, parsed)


# ---- command-line text -------------------------------------------------------------------

_INT = re.compile(r"[+-]?\d+")


def parse_text(hint: Any, text: str | list[str], path: str, meta: Any = None) -> Any:
    """A flag's text (a list for ``tuple`` fields) parsed by the same rules as JSON: ``true``
    / ``false`` for bools, integer digits for ints, ``null`` for None."""
    members, optional = _split_optional(hint)
    if optional and text in ("null", ["null"]):  # a list: a tuple field's flag
        return None
    if isinstance(text, list):
        return parse_value(hint, list(text), path, meta)
    base = members[0] if len(members) == 1 else None
    value: Any = text
    if base is bool:
        value = {"true": True, "false": False}.get(text, text)
    elif base in (int, float):
        value = _number(text)
    return parse_value(hint, value, path, meta)


def _number(text: str) -> Any:
    """An integer for digits, a float for other numeric text (``2.5``, ``nan``), else the
    text itself (so the error shows what was given)."""
    if _INT.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


@dataclass(frozen=True, eq=False)  # hashed by identity: argparse looks types up in a dict
class FlagType:
    """An argparse ``type=`` for a tool flag, parsing its text by :func:`parse_text`'s rules
    (integer digits for ints, finite numbers for floats, the declared range); a bad value
    is one argparse error naming the flag, the value and what is allowed."""

    hint: Any
    name: str
    meta: dict[str, Any]

    @property
    def __name__(self) -> str:  # argparse names a type by ``__name__`` in its messages
        return describe(self.hint, self.meta)

    def __call__(self, text: str) -> Any:
        import argparse

        try:
            value = parse_text(self.hint, text, self.name, self.meta)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        members, _ = _split_optional(self.hint)
        return float(value) if members == [float] and value is not None else value


def flag_type(hint: Any, *, name: str, nonfinite: bool = False, **rng: float) -> FlagType:
    """The strict ``type=`` of flag ``name``: ``flag_type(int, name="--top-k", ge=1)``;
    ``rng`` takes :func:`bounds`' ``ge``/``gt``/``le``/``lt``/``ne``."""
    return FlagType(hint, name, bounds(nonfinite=nonfinite, **rng))


_RANGE_KEYS = ("ge", "gt", "le", "lt", "ne", "nonfinite")


def add_flag(parser: Any, flag: str, hint: Any, **kwargs: Any) -> Any:
    """``parser.add_argument(flag, type=flag_type(hint, name=flag, ...), ...)`` with the flag
    named once: range keys (``ge``/``gt``/``le``/``lt``/``ne``/``nonfinite``) go to
    :func:`flag_type`, everything else to ``add_argument``."""
    rng = {k: kwargs.pop(k) for k in _RANGE_KEYS if k in kwargs}
    return parser.add_argument(flag, type=flag_type(hint, name=flag, **rng), **kwargs)


def field_flag(cls: type, field_name: str, *, name: str) -> FlagType:
    """The strict ``type=`` of a flag that sets config field ``cls.field_name``: its type
    hint and range come from the dataclass (one rule for the JSON key and the flag)."""
    f = next(f for f in _fields(cls) if f.name == field_name)
    members, _ = _split_optional(_hints(cls)[field_name])
    return FlagType(members[0], name, dict(f.metadata))


@dataclass(frozen=True)
class Leaf:
    """One settable leaf of a config tree: its key path, type, range metadata and docstring."""

    path: tuple[str, ...]
    hint: Any
    meta: dict[str, Any]
    doc: str
    default: Any

    @property
    def key(self) -> str:
        return ".".join(self.path)


def leaves(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every leaf field of ``cls``, descending into nested config dataclasses and ``partial``
    dicts (a new field anywhere in the tree appears here, and so gets a flag)."""
    hints, docs = _hints(cls), field_docs(cls)
    for f in _fields(cls):
        hint, path = hints[f.name], prefix + (f.name,)
        members, _ = _split_optional(hint)
        nested = next((m for m in members if dataclasses.is_dataclass(m)), None)
        if nested is None and f.metadata.get("partial") is not None:
            nested = f.metadata["partial"]
        if nested is not None:
            yield from leaves(nested, path)
        else:
            yield Leaf(path, hint, dict(f.metadata), docs.get(f.name, ""), _default(f))


# ---- JSON files ---------------------------------------------------------------------------

def read_json(path: str | os.PathLike, flag: str) -> Any:
    """A JSON file's content through the one file reader (:func:`dattri_ds.io.files.read_json`):
    every failure is an InputFileError naming the file (and line and column for syntax
    errors, the flag that supplies the file when it is missing)."""
    from dattri_ds.io.files import read_json as read

    return read(path, "JSON config", flag=flag)
