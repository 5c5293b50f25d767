"""The flags of collect, fit and attribute, generated from the config dataclasses they set.

Every option of these tools is one field of a frozen config dataclass: a library config
(``ProjectionConfig``, ``CaptureConfig``, ``StoreConfig``, ``KFACConfig``, ``Recipe``) or
the tool's own (``CollectOptions``, ``FitOptions``, ``AttributeOptions`` below: batch sizes,
output knobs). :func:`add_flags` adds one flag per field: the type hint gives the parser
(:func:`dattri_ds.io.schema.field_flag`: strict numbers in the declared range; ``Literal`` and
registry names as choices; booleans as switches), the attribute docstring the help, the
default the flag's default. The tables below name the library fields a tool exposes, under
the flag names they have always had (``--seed`` for ``ProjectionConfig.seed``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dattri_ds import CaptureConfig, KFACConfig, ProjectionConfig
from dattri_ds.methods import registered_attributors
from dattri_ds.methods.tracin import WEIGHTINGS
from dattri_ds.ops.projection import KINDS
from dattri_ds.methods.recipe import Recipe
from dattri_ds.io.schema import bounds, field_docs, field_flag
from dattri_ds.store import StoreConfig

__all__ = ["Flag", "add_flags", "values", "DataOptions", "CollectOptions", "FitOptions",
           "AttributeOptions", "CurateOptions", "DATA", "COLLECT", "FIT", "ATTRIBUTE",
           "CURATE", "DEFAULT_METHOD"]

#: attribute's default method: the most faithful at its cost in ``benchmarks/lds.py``
#: (docs/attribution_fidelity.md).
DEFAULT_METHOD = "ekfac-trajectory"
#: A flag default taken from the dataclass field's own default.
FROM_FIELD: Any = object()


@dataclass(frozen=True)
class Flag:
    """One config field exposed as a flag.

    Attributes:
        cls: the config dataclass.
        field: the field's name.
        flag: the flag (default ``--<field-with-dashes>``).
        default: the flag's default (default: the field's; None: "the config's default",
            left out of the config so that the dataclass's own default applies).
        choices: a callable returning the allowed names (a registry's), for ``str`` fields
            that a registry validates.
        help: a short help text (default: the first sentence of the field's docstring).
    """

    cls: type
    field: str
    flag: str | None = None
    default: Any = FROM_FIELD
    choices: Callable[[], Sequence[str]] | None = None
    help: str | None = None

    @property
    def name(self) -> str:
        return self.flag or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    cut = text.find(". ")
    return text if cut < 0 else text[:cut + 1]


def _members(hint: Any) -> list[Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(hint) if a is not type(None)]
    return [hint]


def add_flags(p: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    """One argparse flag per entry of ``flags``, derived from its dataclass field."""
    for spec in flags:
        f = _field(spec.cls, spec.field)
        hint = typing.get_type_hints(spec.cls)[spec.field]
        base = _members(hint)[0]
        default = _field_default(f) if spec.default is FROM_FIELD else spec.default
        doc = spec.help or _first_sentence(field_docs(spec.cls).get(spec.field, ""))
        own = _field_default(f)
        said = (f"default {default!r}" if default is not None or own is None
                else f"default: the config's {own!r}")
        text = f"{doc} ({spec.cls.__name__}.{spec.field}; {said})"
        if base is bool:
            p.add_argument(spec.name, dest=spec.dest, action="store_true", default=default,
                           help=text)
        elif typing.get_origin(base) is tuple:
            p.add_argument(spec.name, dest=spec.dest, nargs="+", default=default, help=text)
        elif typing.get_origin(base) is Literal or spec.choices is not None:
            choices = list(spec.choices()) if spec.choices else list(typing.get_args(base))
            p.add_argument(spec.name, dest=spec.dest, choices=choices, default=default,
                           help=text)
        elif base in (int, float):
            p.add_argument(spec.name, dest=spec.dest, default=default, help=text,
                           type=field_flag(spec.cls, spec.field, name=spec.name))
        else:
            p.add_argument(spec.name, dest=spec.dest, default=default, help=text)


def values(args: argparse.Namespace, flags: Sequence[Flag], cls: type) -> dict[str, Any]:
    """``{field: value}`` of the flags that set fields of ``cls`` (flags left at a None
    default are left out, so the dataclass's own default applies)."""
    out = {}
    for spec in flags:
        if spec.cls is cls:
            v = getattr(args, spec.dest)
            if not (v is None and spec.default is None):
                out[spec.field] = v
    return out


def option_flags(cls: type) -> list[Flag]:
    """One flag per field of a tool's options dataclass (``--<field-with-dashes>``)."""
    return [Flag(cls, f.name) for f in dataclasses.fields(cls)]


# ---- the tools' own options ------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """Prepared data a tool reads (``dattri-ds prepare``; docs/data.md), instead of jsonl."""

    data_path: tuple[str, ...] | None = None
    """Prepared data: PREFIX [PREFIX ...] or the blend form W1 PREFIX1 W2 PREFIX2 (examples and
    ids as a training run on it; default: the data the store or run records)."""

    packing: Literal["windows", "documents"] | None = None
    """--data-path examples: seq_len windows over the packed documents, or each document cut
    into chunks (default: as recorded, else windows)."""

@dataclass(frozen=True, kw_only=True)
class CollectOptions:
    """What ``collect`` does besides the library configs it sets."""

    max_docs: int | None = field(default=None, metadata=bounds(ge=1))
    """Collect the first N documents of --data, or examples of --data-path (default: every
    one)."""

    batch_size: int = field(default=8, metadata=bounds(ge=1))
    """Examples per probe pass."""


@dataclass(frozen=True, kw_only=True)
class FitOptions:
    """What ``fit`` does besides the ``KFACConfig`` and projection it sets."""

    max_docs: int | None = field(default=None, metadata=bounds(ge=1))
    """Fit on the first N documents of --data, or examples of --data-path (default: every
    one)."""

    batch_size: int = field(default=8, metadata=bounds(ge=1))
    """Examples per probe pass."""

    kfac_only: bool = False
    """Skip the EK-FAC pass (K-FAC factors only)."""


@dataclass(frozen=True, kw_only=True)
class AttributeOptions:
    """What ``attribute`` does besides the ``Recipe`` it runs."""

    query_max_docs: int | None = field(default=None, metadata=bounds(ge=1))
    """Score the first N documents of --queries (default: every one)."""

    top_k: int = field(default=10, metadata=bounds(ge=1))
    """Proponents and opponents per query in topk.json."""

    block_rows: int = field(default=1024, metadata=bounds(ge=1))
    """Store rows streamed per block (memory: one block, the queries and the [N, Q] result)."""

    truncate: bool = False
    """Score the first context-many tokens of queries longer than the model's context
    (default: error)."""

    per_token: bool = False
    """Also score every query token: per_token.npy [N, Q, T] and query_tokens.json (the
    report colours query tokens by influence)."""

    token_chunk: int | None = field(default=None, metadata=bounds(ge=1))
    """--per-token: query token rows scored per pass over the store (default: as many as fit
    in --token-memory-gb; memory grows with the chunk, not the query length)."""

    token_memory_gb: float = field(default=1.0, metadata=bounds(gt=0))
    """--per-token: memory allowed for one chunk of query token rows (the chunk is sized to
    it and a larger --token-chunk is refused at start)."""

    text_weight: float | None = field(default=None, metadata=bounds(ge=0))
    """Weight w of the text-overlap prior added to the method's scores (per query: score +
    w * std(score) * z(TF-IDF overlap of the rows' and the queries' texts)); default: the
    method's measured weight (Attributor.text_weight; 0 for a method not measured
    with it), on when the training texts are found; 0: the method's own scores. The
    training texts are --train-data, else collect's recorded --data; when the default is on
    and they are not found, the prior is off and the summary says so (the weights' choice:
    docs/attribution_fidelity.md)."""

    train_data: str | None = None
    """The jsonl of training documents the store was collected from, for the text prior
    (default: the --data or --data-path collect recorded in the store folder's
    collect_config.json, else the data the store records)."""


@dataclass(frozen=True, kw_only=True)
class CurateOptions:
    """What ``curate`` does besides the ``CurateConfig`` it runs."""

    target_max_docs: int | None = field(default=None, metadata=bounds(ge=1))
    """Read the first N documents of --target (default: every one)."""

    with_text: bool = False
    """Write the documents into subset.jsonl (trainable by launch/)."""

    allow_target_overlap: bool = False
    """Curate against a --target that shares documents with the pool (counted by text hash;
    default: refused, since the target then measures documents the subset may train on)."""


# ---- which library fields each tool exposes, under the names its flags always had -------

def _projection_kinds() -> Sequence[str]:
    return KINDS


def _methods() -> Sequence[str]:
    return sorted(registered_attributors())


def _weightings() -> Sequence[str]:
    return WEIGHTINGS


def _library_flags():
    collect = [
        Flag(ProjectionConfig, "kind", "--projection", choices=_projection_kinds,
             help="projection kind (ops/projection.py registry)"),
        Flag(ProjectionConfig, "dim", "--projection-dim",
             help="per-layer size k (docs/attribution_fidelity.md: fidelity per byte)"),
        Flag(ProjectionConfig, "seed", "--seed", help="projection seed"),
        Flag(CaptureConfig, "whiten",
             help="whiten rows by each checkpoint's factors before projecting (for --method "
                  "kfac/ekfac[-trajectory]; default: ekfac when --factors is given, else "
                  "plain rows)"),
        Flag(StoreConfig, "dtype"),
        Flag(StoreConfig, "flush_every", default=256),
    ]
    fit = [
        Flag(ProjectionConfig, "dim", "--projection-dim", default=None,
             help="Kronecker projection size (default: exact, or from --store)"),
        Flag(ProjectionConfig, "seed", "--seed", default=None,
             help="Kronecker projection seed (default: 0, or from --store)"),
        Flag(KFACConfig, "damping", default=None),
        Flag(KFACConfig, "damping_mode", default=None),
        Flag(KFACConfig, "power", default=None),
    ]
    attribute = [
        Flag(Recipe, "method", default=DEFAULT_METHOD, choices=_methods,
             help="attribution method (trajectories need a store and, for curvature, "
                  "factors per checkpoint)"),
        Flag(Recipe, "weighting", choices=_weightings,
             help="trajectory methods: checkpoint weights (default: the method's, lr for "
                  "tracin, normalized for the curvature trajectories)"),
    ]
    return collect, fit, attribute


_COLLECT, _FIT, _ATTRIBUTE = _library_flags()
#: collect's flags: projection, whitening and store dtype/flush, then its own options.
COLLECT: list[Flag] = _COLLECT + option_flags(CollectOptions)
#: fit's flags: the Kronecker projection and KFACConfig, then its own options.
FIT: list[Flag] = _FIT + option_flags(FitOptions)
#: attribute's flags: the Recipe's method and weighting, then its own options.
ATTRIBUTE: list[Flag] = _ATTRIBUTE + option_flags(AttributeOptions)
#: --data-path and --packing: every tool that reads training data.
DATA: list[Flag] = option_flags(DataOptions)
#: curate's own options (its CurateConfig flags are generated in tools/curate.py).
CURATE: list[Flag] = option_flags(CurateOptions)
