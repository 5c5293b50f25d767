"""attach: the one door to an existing gradient store; what a consumer asks is compared first.

Every consumer (``collect`` resuming, ``fit --store``, ``attribute``, a selector's
``selection.target_store``) states what it will do with the rows as a ``StoreRequest`` and
calls ``attach``: every field the request names (provenance, projection, dtype, layers,
capture semantics, whitening) is compared with the manifest before any gradient is
computed, and a difference is one StoreMismatchError line with both values and the flag
that fixes it (docs/store.md, "Attaching")."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from dattri_ds.errors import ConfigError, StoreMismatchError
from dattri_ds.ops.projection import ProjectionConfig
from dattri_ds.store.reader import GradientStore
from dattri_ds.store.spec import DATA_KEYS, ORIGIN_FIELDS, StoreSpec, _projection_dict, \
    load_manifest

__all__ = ["StoreRequest", "attach", "check", "manifest", "model_layers", "capture_layers",
           "Difference", "compare", "checked_target_store"]

#: A layer as a consumer sees it before any gradient: (LayerKind name, canonical shape).
LayerShape = tuple[str, tuple[int, int]]
Mode = Literal["resume", "score", "read"]

#: How each mode opens the store once it matches (GradientStore.open options).
MODES: dict[str, dict[str, Any]] = {
    # collect: keep every intact row, verify all of them, recompute missing shards
    "resume": {"duplicates": "first", "verify": "eager", "allow_missing_shards": True},
    # attribute: a finished, complete store only
    "score": {"require_complete": True},
    # fit --store, a selection target: the manifest and every committed shard
    "read": {},
}
_PROJECTION_KEYS = ("kind", "dim", "seed", "distribution", "kron_speedup")


@dataclass(frozen=True, kw_only=True)
class StoreRequest:
    """What a consumer is about to do with a store's rows; None fields are not compared."""

    consumer: str
    """Who asks, as the user typed it (``collect``, ``fit --store``, ...): named in errors."""

    projection: ProjectionConfig | Mapping[str, Any] | None = None
    """The projection the consumer uses: a ProjectionConfig (every field compared) or some
    of its fields (``{"dim": 64}``: only those compared)."""

    dtype: str | None = None
    """The storage dtype rows are appended in."""

    layers: Mapping[str, LayerShape] | None = None
    """Layer name -> (kind, shape) the consumer captures (``model_layers``)."""

    semantics: Mapping[str, Any] | None = None
    """``capture_semantics`` of the consumer's capture (not compared with stores that
    record none)."""

    whitening: tuple[str | None, str | None] | None = None
    """``(whiten kind, factors fingerprint)`` of the rows the consumer expects; ``(None,
    None)`` = plain projected gradients. The fingerprint is not compared with stores that
    record none."""

    data: Mapping[str, Any] | None = None
    """The data record of the examples the consumer reads (``StoreSpec.data``): its
    ``fingerprint`` and ``tokenizer`` are compared with a store that records one."""

    origin: Mapping[str, str | None] = field(default_factory=dict)
    """Provenance (``fingerprint``, ``run_id``, ``checkpoint``, ``weights_hash``) the rows
    must have; None values are not compared."""

    fixes: Mapping[str, str] = field(default_factory=dict)
    """Field (``projection.dim``) or field group (``projection``) -> the flag that fixes a
    difference; ``{stored}`` is replaced by the stored value."""

    otherwise: str = ""
    """The way out for any field (e.g. ``write a new store: --out <another folder>``)."""

    def __post_init__(self) -> None:
        proj = self.projection
        if isinstance(proj, ProjectionConfig):
            object.__setattr__(self, "projection", _projection_dict(proj))
        elif proj is not None:
            unknown = sorted(set(proj) - set(_PROJECTION_KEYS))
            if unknown:
                raise ConfigError(f"StoreRequest.projection: unknown field(s) {unknown}; "
                                  f"allowed: {list(_PROJECTION_KEYS)}")
            object.__setattr__(self, "projection", dict(proj))
        unknown = sorted(set(self.origin) - set(ORIGIN_FIELDS))
        if unknown:
            raise ConfigError(f"StoreRequest.origin: unknown field(s) {unknown}; allowed: "
                              f"{list(ORIGIN_FIELDS)}")

    def fix(self, key: str, stored: Any) -> str:
        """The fix for a difference in ``key`` (its own, its group's, or the default)."""
        group = re.split(r"[.\[]", key, maxsplit=1)[0]  # projection.dim, layers['a.b']
        text = self.fixes.get(key) or self.fixes.get(group) or _DEFAULT_FIX.get(group, "")
        return text.replace("{stored}", str(stored))


_DEFAULT_FIX = {
    "fingerprint": "use the model the store was collected from",
    "run_id": "use the run the store was collected from",
    "checkpoint": "use the checkpoint the store was collected at",
    "weights_hash": "use the checkpoint weights the store was collected with",
    "data": "read the data the store was made from (--data-path {stored}), or write a new "
            "store",
}


@dataclass(frozen=True)
class Difference:
    """One field where a store and a request differ (values already rendered)."""

    key: str
    stored: str
    requested: str
    raw_stored: Any = None


def manifest(path: str | Path) -> tuple[StoreSpec, str] | None:
    """``(spec, dtype)`` of the store at ``path`` read through the store reader, or None
    when no store is there.

    Raises:
        StoreCorruptError: the manifest is missing (shard files present), unreadable,
            fails its checksum or is malformed (the file is named).
    """
    return load_manifest(Path(path))


def attach(path: str | Path, request: StoreRequest, *, mode: Mode) -> GradientStore | None:
    """Open the store at ``path`` for ``request`` after comparing the two.

    Args:
        path: the store directory.
        request: what the consumer will do with the rows.
        mode: ``resume`` (collect appending: None when no store exists yet, intact rows
            kept), ``score`` (a complete store), ``read`` (any committed store).

    Returns:
        The open GradientStore (the caller closes it), or None in ``resume`` mode when
        ``path`` holds no store yet.

    Raises:
        StoreMismatchError: a requested field differs (one line: every field, both values
            and the fix).
        StoreCorruptError: the manifest or a shard is damaged (the file is named).
        ConfigError: no store at ``path`` (modes other than ``resume``).
    """
    if mode not in MODES:
        raise ConfigError(f"attach: mode {mode!r} is not one of {sorted(MODES)}")
    if check(path, request, missing_ok=mode == "resume") is None:
        return None
    return GradientStore.open(Path(path), **MODES[mode])


def check(path: str | Path, request: StoreRequest, *, missing_ok: bool = False
          ) -> StoreSpec | None:
    """Compare the manifest of the store at ``path`` with ``request`` without opening its
    shards (a consumer checks every store it will use before working on the first).

    Returns:
        The store's spec, or None when ``missing_ok`` and no store is there yet.

    Raises:
        StoreMismatchError, StoreCorruptError, ConfigError: as :func:`attach`.
    """
    root = Path(path)
    found = manifest(root)
    if found is None:
        if missing_ok:
            return None
        raise ConfigError(f"No gradient store at '{root}' (no info.json) for {request.consumer}"
                          f": collect one there (tools/collect.py --out), or fix the path")
    spec, dtype = found
    diffs = compare(spec, dtype, request)
    if diffs:
        raise mismatch(root, request, diffs)
    return spec


def compare(spec: StoreSpec, dtype: str, request: StoreRequest) -> list[Difference]:
    """Every difference between a store's manifest and a request, in a fixed order."""
    return [d for check in _CHECKS for d in check(spec, dtype, request)]


def mismatch(root: Path, request: StoreRequest, diffs: list[Difference]) -> StoreMismatchError:
    """The one-line StoreMismatchError of ``diffs``."""
    parts, shown = [], set()
    for d in diffs:
        fix = request.fix(d.key, d.raw_stored)
        parts.append(f"{d.key}: stored {d.stored}, requested {d.requested}"
                     + (f" (fix: {fix})" if fix and fix not in shown else ""))
        shown.add(fix)  # a fix shared by several fields (layers) is said once
    tail = f"; or {request.otherwise}" if request.otherwise else ""
    return StoreMismatchError(f"Gradient store '{root}' does not hold what {request.consumer} "
                              f"asks for: {'; '.join(parts)}{tail}")


# ---- the comparisons, one per field group ------------------------------------------------
def _origin(spec: StoreSpec, dtype: str, req: StoreRequest) -> list[Difference]:
    return [Difference(k, repr(getattr(spec, k)), repr(v), getattr(spec, k))
            for k, v in req.origin.items() if v is not None and getattr(spec, k) != v]


def _data(spec: StoreSpec, dtype: str, req: StoreRequest) -> list[Difference]:
    if req.data is None or spec.data is None:
        return []
    return [Difference(f"data.{k}", repr(spec.data.get(k)), repr(req.data.get(k)),
                       spec.data.get("data_path")) for k in DATA_KEYS
            if spec.data.get(k) != req.data.get(k)]


def _projection(spec: StoreSpec, dtype: str, req: StoreRequest) -> list[Difference]:
    if req.projection is None:
        return []
    want = dict(req.projection)  # normalized to a dict in __post_init__
    have = spec.projection_config
    if have is None:  # a spec built by hand records only the tag
        tag = ProjectionConfig(**want).tag if set(want) >= {"kind", "dim", "seed"} else None
        return [] if tag in (None, spec.projection) else [
            Difference("projection", repr(spec.projection), repr(tag), spec.projection)]
    return [Difference(f"projection.{k}", repr(have.get(k)), repr(v), have.get(k))
            for k, v in want.items() if have.get(k) != v]


def _dtype(spec: StoreSpec, dtype: str, req: StoreRequest) -> list[Difference]:
    if req.dtype is None or req.dtype == dtype:
        return []
    return [Difference("dtype", repr(dtype), repr(req.dtype), dtype)]


def _whitening(spec: StoreSpec, dtype: str, req: StoreRequest) -> list[Difference]:
    if req.whitening is None:
        return []
    kind, by = req.whitening
    if spec.whitened != kind:
        return [Difference("whitened", repr(spec.whitened), repr(kind), spec.whitened)]
    if kind is not None and by is not None and spec.whitened_by not in (None, by):
        return [Difference("whitened_by", f"factors {spec.whitened_by}", f"factors {by}",
                           spec.whitened_by)]
    return []


def _semantics(spec: StoreSpec, dtype: str, req: StoreRequest) -> list[Difference]:
    if req.semantics is None or spec.semantics is None:
        return []
    return [Difference(f"semantics.{k}", repr(spec.semantics.get(k)), repr(v),
                       spec.semantics.get(k))
            for k, v in req.semantics.items() if spec.semantics.get(k) != v]


def _layers(spec: StoreSpec, dtype: str, req: StoreRequest) -> list[Difference]:
    if req.layers is None:
        return []
    have = {ls.name: (ls.kind, tuple(ls.shape)) for ls in spec.layers}
    want = {n: (k, tuple(s)) for n, (k, s) in req.layers.items()}
    out = []
    missing = [n for n in have if n not in want]
    extra = [n for n in want if n not in have]
    if missing or extra:
        out.append(Difference("layers", f"{len(have)} layers" + (
            f" including {_short(missing)}" if missing else ""),
            f"{len(want)} layers" + (f" including {_short(extra)}" if extra else ""),
            f"{len(have)} layers"))
    changed = [n for n in have if n in want and have[n] != want[n]]
    for n in changed[:3]:
        out.append(Difference(f"layers['{n}']", _layer(have[n]), _layer(want[n]), have[n]))
    return out


def _layer(ls: LayerShape) -> str:
    return f"{ls[0]} {tuple(ls[1])}"


def _short(names: list[str], k: int = 3) -> str:
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return f"{names[:k]}{more}"


_CHECKS: tuple[Callable[[StoreSpec, str, StoreRequest], list[Difference]], ...] = (
    _origin, _data, _projection, _dtype, _whitening, _semantics, _layers)


# ---- the layers a consumer captures, before any gradient ---------------------------------
def capture_layers(capture: Any) -> dict[str, LayerShape]:
    """Layer name -> (kind, shape) of an attached GradientCapture, as its GradBatches (and so
    a store) name them: tied modules merged into their primary (``dattri_ds.capture.tied``)."""
    from dattri_ds.capture.tied import find_tied

    groups, _ = find_tied(capture.layers)
    members = {m for g in groups for m in g.members}
    return {name: (kind.name, tuple(kind.layer_shape(module)))
            for name, (module, kind) in capture.layers.items() if name not in members}


def model_layers(model: Any, capture: Any = None) -> dict[str, LayerShape]:
    """``capture_layers`` of ``model`` under a CaptureConfig (default: every supported
    layer), found without a forward pass (hooks are attached and removed again)."""
    from dattri_ds.capture.hooks import GradientCapture
    from dattri_ds.capture.config import CaptureConfig

    cfg = replace(capture or CaptureConfig(), whiten=None, projection=None)
    with warnings.catch_warnings():  # the consumer's own capture warns once
        warnings.simplefilter("ignore")
        probe = GradientCapture(model, cfg, probe_only=True).attach()
    try:
        return capture_layers(probe)
    finally:
        probe.detach()


# ---- a selector's fixed target -------------------------------------------------------------
_TARGET_FIXES = {
    "projection.kind": "selection.projection.kind = '{stored}'",
    "projection.dim": "selection.projection.dim = {stored}",
    "projection.seed": "selection.projection.seed = {stored}",
    "projection.distribution": "selection.projection.distribution = '{stored}'",
    "projection.kron_speedup": "selection.projection.kron_speedup = {stored}",
    "semantics.label_shift": "capture.label_shift = {stored}",
    "semantics.ignore_index": "capture.ignore_index = {stored}",
    "layers": "selection.include / selection.top_blocks as the store was collected, or a "
    "store collected from this model",
    "whitened": "a store of plain projected gradients (tools/collect.py without --whiten / "
    "--factors)",
}


#: The capture semantics a target store must share with the selector's probe: which token
#: losses a gradient holds. The per-example normalization (``per_example_loss``) only weighs
#: the examples within the target's mean, and ``loss_reduction`` is undone by capture.
_TARGET_SEMANTICS = ("label_shift", "ignore_index")


def checked_target_store(path: str, probe: Any) -> str:
    """``path`` once the store there holds what a selector's ``probe`` capture scores
    against: the same projection, token semantics (``_TARGET_SEMANTICS``) and layers
    (names, kinds, shapes: the same model), plain (not whitened) rows. Called where the selector is built, so another
    model's store fails at launch, not at the first scoring step.

    Raises:
        StoreMismatchError: a field differs (one line: both values and the config key).
        StoreCorruptError / ConfigError: a damaged store, or none at ``path``.
    """
    from dattri_ds.store.spec import capture_semantics

    cfg = probe.config
    semantics = {k: v for k, v in capture_semantics(cfg).items() if k in _TARGET_SEMANTICS}
    check(path, StoreRequest(
        consumer="selection.target_store", projection=cfg.projection,
        semantics=semantics, layers=capture_layers(probe),
        whitening=(None, None), fixes=_TARGET_FIXES,
        otherwise="point selection.target_store at a store collected from this model with "
                  "selection.projection"))
    return path
