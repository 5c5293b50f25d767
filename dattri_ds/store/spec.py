"""StoreSpec: what a gradient store holds (layers, projection, model, data), and how specs are
compared.

A row is the concatenation, in ``StoreSpec.layers`` order, of one example's projected Dense
vectors (width ``P = sum_l P_l``). Rows are comparable only when the projection, layers,
capture semantics and model fingerprint are equal; ``diff`` lists what differs and
``mismatch_error`` makes it a StoreMismatchError showing both sides and the fix."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dattri_ds.errors import ConfigError, StoreMismatchError
from dattri_ds.gradient import Dense, GradBatch, LayerGrad, Space
from dattri_ds.ops.projection import ProjectionConfig
from dattri_ds.store.config import STORE_DTYPES
from dattri_ds.store.format import INFO_NAME, StoreCorruptError, load_info

__all__ = ["LayerSpec", "StoreSpec", "mismatch_error", "check_stored", "load_manifest",
           "capture_semantics", "ORIGIN_FIELDS", "weights_hash", "data_diff", "DATA_KEYS"]

#: Provenance fields of a StoreSpec a reader can require (``GradientStore.open(origin=...)``).
ORIGIN_FIELDS = ("fingerprint", "run_id", "checkpoint", "weights_hash")
_FIX_ORIGIN = ("the store was collected from another model or checkpoint (or another run): "
               "collect it again for this one (tools/collect.py --run <this run>), or point "
               "at the store of this run and checkpoint")
_FIX_SEMANTICS = ("capture with the same capture.loss_reduction / per_example_loss / "
                  "label_shift / ignore_index as the store, or point store.path at a new "
                  "directory")


def capture_semantics(capture: Any) -> dict[str, Any]:
    """The loss semantics of a CaptureConfig that change the stored rows (recorded)."""
    return {"loss_reduction": capture.loss_reduction,
            "per_example_loss": capture.per_example_loss,
            "label_shift": int(capture.label_shift), "ignore_index": int(capture.ignore_index)}

_FIX_PROJECTION = ("use the ProjectionConfig the store was written with (capture.projection "
                   "kind/distribution/dim/seed), or point store.path at a new directory")
_FIX_FINGERPRINT = ("the store belongs to another model or checkpoint: point store.path at a "
                    "new directory for this one")
_FIX_DATA = ("the store holds rows of other examples: use the data it was made from "
             "(--data-path {}), or point store.path at a new directory")
_FIX_LAYERS = ("capture the same layers as the store (capture.include / capture.exclude and "
               "capture.projection.dim), or point store.path at a new directory")


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One layer's column block in a stored row."""

    name: str
    """Fully qualified module name."""

    kind: str
    """Registered LayerKind name (``"linear"``, ``"embedding"``, ...)."""

    shape: tuple[int, int]
    """Canonical ``(O, I')`` shape of the layer's (unprojected) gradient."""

    width: int
    """Number of columns ``P_l`` of the projected vector."""

    projection: str
    """``LayerGrad.projection`` of the stored vectors: the tag, or ``identity:<tag>`` for layers
    small enough to be kept exactly."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", (int(self.shape[0]), int(self.shape[1])))
        if self.width < 1:
            raise ConfigError(f"Layer '{self.name}': stored width must be >= 1, got {self.width}")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "shape": list(self.shape),
                "width": self.width, "projection": self.projection}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayerSpec:
        return cls(name=d["name"], kind=d["kind"], shape=tuple(d["shape"]), width=int(d["width"]),
                   projection=d["projection"])

    def describe(self) -> str:
        return f"width {self.width}, shape {self.shape}, kind {self.kind!r}"


def _layer_spec(key: str, lg: LayerGrad) -> LayerSpec:
    """The LayerSpec of a captured layer, refusing anything but projected Dense rows."""
    if not isinstance(lg.data, Dense) or lg.space.canonical:
        form = "factorized" if lg.is_factorized else "unprojected dense"
        raise ConfigError(
            f"Layer '{key}' holds {form} gradients, but the gradient store keeps projected rows "
            f"only: set capture.projection (a ProjectionConfig) so every batch is projected "
            f"before it reaches the store"
        )
    if lg.shard is not None:
        raise ConfigError(
            f"Layer '{key}' holds tensor-parallel shard {lg.shard.rank}/{lg.shard.world}; the "
            f"store keeps whole-layer projections: reduce across the tensor-parallel group first"
        )
    return LayerSpec(name=key, kind=lg.kind_name, shape=lg.shape, width=int(lg.data.values.shape[1]),
                     projection=lg.projection)


@dataclass(frozen=True, kw_only=True)
class StoreSpec:
    """Identity of a gradient store: two stores (or a store and a query) with equal specs hold
    comparable rows."""

    layers: tuple[LayerSpec, ...]
    """Column blocks of a row, in order."""

    projection: str
    """``ProjectionConfig.tag`` of the projection that produced the rows."""

    seed: int
    """``ProjectionConfig.seed`` (also part of the tag; kept on its own for readers)."""

    fingerprint: str
    """Model/checkpoint fingerprint chosen by the caller (e.g. a checkpoint path plus step, or
    a hash of the weights): rows of different models are never mixed."""

    projection_config: dict[str, Any] | None = None
    """The ProjectionConfig as a dict (kind, dim, distribution, seed): readers rebuild the
    projector from it. None in specs built by hand without one."""

    semantics: dict[str, Any] | None = None
    """Capture semantics of the rows (``capture_semantics``); None = not recorded."""

    run_id: str | None = None
    """Id of the training run whose weights produced the rows (None = not recorded)."""

    checkpoint: str | None = None
    """Checkpoint tag of those weights (None: several, e.g. captured during training)."""

    weights_hash: str | None = None
    """``weights_hash`` of the model the rows were computed with (None: not one checkpoint)."""

    whitened: str | None = None
    """``kfac``/``ekfac``: the rows were whitened by that checkpoint's curvature factors
    before projection (``CaptureConfig.whiten``); scoring them needs the same factors and
    ``whitened=True``. None: plain projected gradients."""

    whitened_by: str | None = None
    """``KFACFactors.fingerprint()`` of the factors that whitened the rows (their config,
    damping and power included): scoring needs the query whitened by the same factors.
    None: not whitened, or not recorded."""

    data: dict[str, Any] | None = None
    """The data record of the examples the rows were computed on (``data_record`` of
    launch/data.py: ``fingerprint`` of the examples, ``tokenizer``, and ``data_path``,
    ``seq_len``, ``packing``, ``seed`` to open them again); rows of other data are never
    mixed in (``fingerprint`` and ``tokenizer`` compared). None: not recorded."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ConfigError("A gradient store needs at least one layer, got none")
        names = [ls.name for ls in self.layers]
        if len(set(names)) != len(names):
            raise ConfigError(f"Layer names in a StoreSpec must be unique, got {names}")

    @classmethod
    def from_batch(cls, batch: GradBatch, *, projection: ProjectionConfig, fingerprint: str,
                   capture: Any = None, run_id: str | None = None,
                   checkpoint: str | None = None, weights_hash: str | None = None,
                   whitened_by: str | None = None, data: dict | None = None) -> StoreSpec:
        """The spec of a projected batch (layer order = the batch's layer order).

        ``capture`` (the CaptureConfig that produced the batch), ``run_id``, ``checkpoint``,
        ``weights_hash``, ``whitened_by`` (the whitening factors' fingerprint) and ``data``
        (the examples' data record) are recorded in the manifest and checked by readers
        that ask.

        Raises:
            ConfigError: a layer is factorized, unprojected, TP-sharded or projected with
                another ProjectionConfig.
        """
        whitened = getattr(capture, "whiten", None)
        want = Space(projection.tag, whitened=whitened, whitened_first=whitened is not None)
        allowed = (want, want.replace(identity=True))  # kept exactly: small layers
        layers = tuple(_layer_spec(k, lg) for k, lg in batch.layers.items())
        for ls, lg in zip(layers, batch.layers.values()):
            if lg.space not in allowed:
                raise ConfigError(
                    f"Layer '{ls.name}' was projected with {ls.projection!r} but the store is "
                    f"configured for projection {want.tag!r}: pass the ProjectionConfig "
                    f"(and whiten setting) that capture uses")
        return cls(layers=layers, projection=projection.tag, seed=projection.seed,
                   fingerprint=fingerprint, projection_config=_projection_dict(projection),
                   semantics=None if capture is None else capture_semantics(capture),
                   run_id=run_id, checkpoint=checkpoint, weights_hash=weights_hash,
                   whitened=whitened, whitened_by=whitened_by, data=data)

    def origin(self) -> dict[str, str | None]:
        """The provenance fields (``ORIGIN_FIELDS``) of this spec."""
        return {k: getattr(self, k) for k in ORIGIN_FIELDS}

    def projection_cfg(self) -> ProjectionConfig:
        """The ProjectionConfig of the rows (from the structured record)."""
        if self.projection_config is None:
            raise ConfigError(f"This store records only the projection tag "
                              f"{self.projection!r}, not its configuration")
        return ProjectionConfig(**self.projection_config)

    @property
    def width(self) -> int:
        """``P``: total columns of a row."""
        return sum(ls.width for ls in self.layers)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(ls.name for ls in self.layers)

    def slices(self) -> dict[str, slice]:
        """Layer name -> its column range within a row."""
        out, start = {}, 0
        for ls in self.layers:
            out[ls.name] = slice(start, start + ls.width)
            start += ls.width
        return out

    def check_batch(self, batch: GradBatch, path: str) -> None:
        """Raise unless ``batch`` holds exactly this spec's layers, projected alike.

        Raises:
            ConfigError: a layer is not projected Dense (see ``from_batch``).
            StoreMismatchError: the layer set, widths, shapes or projection tags differ.
        """
        got = tuple(_layer_spec(k, lg) for k, lg in batch.layers.items())
        lines = _layer_diff(self.layers, got)
        if lines:
            raise mismatch_error(path, lines, what=f"Batch of step {batch.step}")

    def diff(self, requested: StoreSpec) -> list[str]:
        """One line per field where this (stored) spec differs from ``requested``."""
        lines = []
        same_projection = self.projection == requested.projection and self.seed == requested.seed
        if not same_projection:
            lines.append(f"projection: stored {self.projection!r} (seed {self.seed}), "
                         f"requested {requested.projection!r} (seed {requested.seed}); "
                         f"fix: {_FIX_PROJECTION}")
        if self.fingerprint != requested.fingerprint:
            lines.append(f"fingerprint: stored {self.fingerprint!r}, requested "
                         f"{requested.fingerprint!r}; fix: {_FIX_FINGERPRINT}")
        if same_projection and requested.projection_config is not None and \
                self.projection_config != requested.projection_config:
            lines.append(f"projection_config: stored {self.projection_config}, requested "
                         f"{requested.projection_config}; fix: {_FIX_PROJECTION}")
        if self.whitened != requested.whitened:
            lines.append(f"whitened: stored {self.whitened!r}, requested "
                         f"{requested.whitened!r}; fix: collect with the same capture.whiten "
                         f"(and factors), or point store.path at a new directory")
        if self.whitened_by != requested.whitened_by:
            lines.append(f"whitened_by: stored factors {self.whitened_by!r}, requested "
                         f"{requested.whitened_by!r}; fix: collect with the factors the store "
                         f"was whitened by, or point store.path at a new directory")
        if requested.semantics is not None and self.semantics != requested.semantics:
            lines.append(f"capture semantics: stored {self.semantics}, requested "
                         f"{requested.semantics}; fix: {_FIX_SEMANTICS}")
        lines += data_diff(self.data, requested.data)
        lines += self.origin_diff({k: v for k, v in requested.origin().items()
                                   if k != "fingerprint"})
        lines += _layer_diff(self.layers, requested.layers, compare_projection=same_projection)
        return lines

    def origin_diff(self, want: dict[str, str | None]) -> list[str]:
        """Lines for every provenance field of ``want`` (None values are not checked) that
        differs from this spec's."""
        unknown = sorted(set(want) - set(ORIGIN_FIELDS))
        if unknown:
            raise ConfigError(f"Unknown store origin field(s) {unknown}; allowed: "
                              f"{list(ORIGIN_FIELDS)}")
        return [f"{k}: stored {getattr(self, k)!r}, requested {v!r}; fix: {_FIX_ORIGIN}"
                for k, v in want.items() if v is not None and getattr(self, k) != v]

    def to_json(self) -> dict[str, Any]:
        return {"projection": self.projection, "seed": self.seed, "fingerprint": self.fingerprint,
                "projection_config": self.projection_config, "semantics": self.semantics,
                "run_id": self.run_id, "checkpoint": self.checkpoint,
                "weights_hash": self.weights_hash,
                **({} if self.whitened is None else {"whitened": self.whitened}),
                **({} if self.whitened_by is None else {"whitened_by": self.whitened_by}),
                **({} if self.data is None else {"data": self.data}),
                "layers": [ls.to_json() for ls in self.layers]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StoreSpec:
        return cls(layers=tuple(LayerSpec.from_json(x) for x in d["layers"]),
                   projection=d["projection"], seed=int(d["seed"]), fingerprint=d["fingerprint"],
                   projection_config=d.get("projection_config"), semantics=d.get("semantics"),
                   run_id=d.get("run_id"), checkpoint=d.get("checkpoint"),
                   weights_hash=d.get("weights_hash"), whitened=d.get("whitened"),
                   whitened_by=d.get("whitened_by"), data=d.get("data"))

    def digest(self, dtype: str) -> str:
        """blake2b of the canonical JSON of (spec, dtype): equal digests = same row layout
        (the data record, which says what the rows' ids refer to, is not part of it)."""
        spec = {k: v for k, v in self.to_json().items() if k != "data"}
        text = json.dumps({"spec": spec, "dtype": dtype}, sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


#: The keys of a data record that decide whether rows are comparable.
DATA_KEYS = ("fingerprint", "tokenizer")


def data_diff(stored: dict | None, requested: dict | None) -> list[str]:
    """One line when both records exist and their ``DATA_KEYS`` differ (both sides, the
    stored data's path and the fix)."""
    if not stored or not requested:
        return []
    diffs = [f"{k} {stored.get(k)!r} stored, {requested.get(k)!r} requested" for k in DATA_KEYS
             if stored.get(k) != requested.get(k)]
    return [f"data: {'; '.join(diffs)}; fix: {_FIX_DATA.format(stored.get('data_path'))}"
            ] if diffs else []


def _layer_diff(stored: tuple[LayerSpec, ...], requested: tuple[LayerSpec, ...], *,
                compare_projection: bool = True) -> list[str]:
    """Lines describing how two layer sets differ (order is irrelevant); empty if equal."""
    s = {ls.name: ls for ls in stored}
    r = {ls.name: ls for ls in requested}
    common = [n for n in s if n in r]
    lines = []
    reproj = [n for n in common if s[n].projection != r[n].projection]
    if compare_projection and reproj:
        n = reproj[0]
        lines.append(f"projection of layers {_short(reproj)}: stored {s[n].projection!r}, "
                     f"requested {r[n].projection!r}; fix: {_FIX_PROJECTION}")
    parts = []
    missing = [n for n in s if n not in r]
    extra = [n for n in r if n not in s]
    if missing:
        parts.append(f"stored but not requested {_short(missing)}")
    if extra:
        parts.append(f"requested but not stored {_short(extra)}")
    for n in common:
        if s[n].describe() != r[n].describe():
            parts.append(f"'{n}' stored ({s[n].describe()}) vs requested ({r[n].describe()})")
    if parts:
        lines.append(f"layers: {'; '.join(parts[:6])}; fix: {_FIX_LAYERS}")
    return lines


def _short(names: list[str], k: int = 5) -> str:
    more = f" and {len(names) - k} more" if len(names) > k else ""
    return f"{names[:k]}{more}"


def mismatch_error(path: str, lines: list[str], what: str = "The requested configuration"
                   ) -> StoreMismatchError:
    """A StoreMismatchError listing every differing field with both sides and its fix, in
    one line (fields separated by ``; ``)."""
    return StoreMismatchError(f"{what} does not match the gradient store at '{path}': "
                              f"{'; '.join(lines)}")


def check_stored(stored: StoreSpec, stored_dtype: str, *, path: str, expect: StoreSpec | None,
                 dtype: str | None) -> None:
    """Raise StoreMismatchError listing every difference between a store and a request.

    ``expect`` / ``dtype`` of None are not checked (a reader may accept any of them).
    """
    lines = [] if expect is None else stored.diff(expect)
    if dtype is not None and dtype != stored_dtype:
        lines.append(f"dtype: stored {stored_dtype!r}, requested {dtype!r}; fix: set "
                     f"store.dtype='{stored_dtype}' or point store.path at a new directory")
    if lines:
        raise mismatch_error(path, lines)


def _projection_dict(projection: ProjectionConfig) -> dict[str, Any]:
    import dataclasses

    d = json.loads(json.dumps(dataclasses.asdict(projection)))
    if not projection.strategy.per_layer:  # only auto reads it: older stores stay comparable
        d.pop("kron_speedup")
    return d


def load_manifest(root: Path, with_complete: bool = False):
    """``(spec, dtype)`` from ``root/info.json`` (plus its ``complete`` record when
    ``with_complete``), or None when no store exists there yet.

    Raises:
        StoreCorruptError: the manifest is missing (shard files present), unreadable, fails
            its checksum or is incomplete.
        StoreMismatchError: it was written by another format version.
    """
    info = load_info(root)
    if info is None:
        return None
    try:
        spec, dtype = StoreSpec.from_json(info["spec"]), info["dtype"]
        complete = info.get("complete")
        if complete is not None:
            complete = {"rows": {int(r): int(n) for r, n in complete["rows"].items()}}
    except (KeyError, TypeError, ValueError, AttributeError, ConfigError) as e:
        what = f"key {e.args[0]!r} is missing" if isinstance(e, KeyError) and e.args else \
            " ".join(str(e).split())
        raise StoreCorruptError(
            f"Manifest '{root / INFO_NAME}' is malformed ({what}): it was damaged outside "
            f"dattri-ds; restore it from a backup, or delete the store directory '{root}' and "
            f"collect it again") from e
    if dtype not in STORE_DTYPES:
        raise StoreCorruptError(f"Manifest '{root / INFO_NAME}' has unknown dtype {dtype!r}")
    return (spec, dtype, complete) if with_complete else (spec, dtype)


def weights_hash(model: Any) -> str:
    """``blake2b:<hex>`` of a module's (or state dict's) tensors: names, dtypes, shapes and
    bytes, in name order. Equal for the same weights loaded twice; stores record it so rows
    are never scored against another checkpoint. Cost: one read of the weights."""
    import torch

    if _zero3_partitioned(model):
        return _partitioned_weights_hash(model)
    state = model.state_dict() if hasattr(model, "state_dict") else model
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        t = state[name]
        if not torch.is_tensor(t):
            continue
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(state[name].shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "blake2b:" + h.hexdigest()


def _zero3_partitioned(model: Any) -> bool:
    """True for a module whose parameters DeepSpeed ZeRO-3 has partitioned (placeholders of
    numel 0 with the rank's slice in ``ds_tensor``): its ``state_dict`` holds no weights."""
    params = getattr(model, "parameters", None)
    return params is not None and any(hasattr(p, "ds_tensor") for p in params())


def _partitioned_weights_hash(model: Any) -> str:
    """``weights_hash`` of a ZeRO-3 module without gathering it: every rank hashes its own
    partitions (name, full shape, bytes), and the rank digests are hashed in rank order. Equal
    for the same weights at the same world size; a collective, so every rank must call it."""
    import torch
    import torch.distributed as dist

    h = hashlib.blake2b(digest_size=16)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        part = getattr(p, "ds_tensor", p).detach().to("cpu").contiguous().reshape(-1)
        shape = tuple(getattr(p, "ds_shape", p.shape))
        h.update(f"{name}|{part.dtype}|{shape}|".encode())
        h.update(part.view(torch.uint8).numpy().tobytes() if part.numel() else b"")
    digests = [h.hexdigest()]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, h.hexdigest())
    whole = hashlib.blake2b("|".join(digests).encode(), digest_size=16)
    return f"blake2b:zero3x{len(digests)}:{whole.hexdigest()}"
