"""GradientCapture: hooks that record per-example factors of every forward/backward run inside it.

How it works, per micro-batch (one call of the root model = one record):

1. A forward pre-hook on the root model opens a record and reads ids, labels and attention
   mask from the call (``semantics.batch_info``).
2. A forward hook on every supported layer saves the layer input and registers a *tensor*
   hook on the layer output (works when engines wrap outputs; never reads weight shapes).
3. The first output-grad of the record queues a callback on the autograd engine, which runs
   once the whole backward pass is over: the record then turns its (input, output-grad)
   pairs into a GradBatch, scaled per example to the semantics of ``semantics.py``.

Only completed backward passes produce batches: a forward without backward yields nothing
and keeps nothing alive once its graph is freed. Activation checkpointing re-runs forward
hooks; only the outputs that really receive a gradient are counted, so nothing is counted
twice.
"""

from __future__ import annotations

import contextvars
import fnmatch
import logging
import warnings
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from dattri_ds.capture.callbacks import TrainingCallback
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.errors import CaptureError, ConfigError, UnsupportedLayerError
from dattri_ds.gradient import Dense, Factorized, GradBatch, LayerGrad, ShardInfo
from dattri_ds.capture.engine import EngineAdapter, adapter_for
from dattri_ds.layers import LayerKind, kind_for
from dattri_ds.capture.nonfinite import nonfinite_rows, read_with_flag
from dattri_ds.ops.cost import CostModel, default_cost_model
from dattri_ds.ops.projection import Projector
from dattri_ds.ops.space import project_batch, project_layers
from dattri_ds.capture.semantics import BatchInfo, batch_info, example_scale
from dattri_ds.capture.tied import TiedGroup, find_tied, merge_tied

if TYPE_CHECKING:
    from dattri_ds.ops.kronecker import KFACFactors

__all__ = ["GradientCapture"]

logger = logging.getLogger(__name__)
_ATTR = "_dattri_ds_capture"
#: True while any capture runs a probe forward: recording captures ignore that forward.
_PROBING: contextvars.ContextVar[bool] = contextvars.ContextVar("dattri_ds_probing",
                                                                 default=False)


@dataclass(eq=False)
class _Record:
    """Everything captured for one root forward call until its backward completes."""

    index: int
    step: int
    info: BatchInfo | None
    outputs: list[weakref.ref] = field(default_factory=list)
    empty: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(list))
    scale: float = 1.0
    queued: bool = False
    done: bool = False
    probe: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def alive(self) -> bool:
        return self.queued or any(r() is not None for r in self.outputs)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _has_own_trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


class GradientCapture:
    """Capture per-example gradients of ``model`` without changing the training loop.

    Args:
        model: the module the loop calls (``engine.module`` under DeepSpeed).
        config: what to capture and how the loop reduces its loss.
        callbacks: consumers of every GradBatch; without any, batches wait for ``pop()``.
        cost: cost model for the projection routing (default: per device type).
        scale_fn: engine adapters' backward scale, read at backward time (multiplies
            ``config.backward_scale``).
        step_fn: engine adapters' global step, read when a micro-batch starts.
        probe_only: record nothing during ordinary forwards; only ``probe()`` captures.
            Such a capture may share a model with one recording capture.
        factors: eigendecomposed curvature factors of this model (``config.whiten`` only):
            every batch is captured exactly, whitened by them (``KFACFactors.whiten``) and
            then projected (``config.projection``), rows tagged
            ``<projection>+whitened:<method>``.

    Use ``GradientCapture.for_engine(engine, ...)`` for a DeepSpeed engine: it hooks
    ``engine.module`` and takes scale, step and step boundaries from the engine.

    Example:
        >>> with GradientCapture(model) as cap:
        ...     model(input_ids=x, labels=x).loss.backward()
        ...     grads = cap.pop()          # GradBatch of this micro-batch
    """

    def __init__(self, model: nn.Module, config: CaptureConfig | None = None, *,
                 callbacks: Iterable[TrainingCallback] = (), cost: CostModel | None = None,
                 scale_fn: Callable[[], float] | None = None,
                 step_fn: Callable[[], int] | None = None, probe_only: bool = False,
                 factors: KFACFactors | None = None) -> None:
        self.model = model
        self.probe_only = probe_only
        self.config = config or CaptureConfig()
        self.callbacks = list(callbacks)
        self.cost = cost
        self.scale_fn = scale_fn
        self.step_fn = step_fn
        self.adapter: EngineAdapter | None = None
        self._remove_step_hook: Callable[[], None] | None = None
        self.step = 0
        self.skipped = 0  # micro-batches dropped whole (every example non-finite)
        self.skipped_examples = 0
        self.layers: dict[str, tuple[nn.Module, LayerKind]] = {}
        #: name -> the layer's canonical ``(O, I')`` and shard, read from the module once
        self._shapes: dict[str, tuple[tuple[int, int], ShardInfo | None]] = {}
        self.unsupported: list[str] = []
        if (self.config.whiten is None) != (factors is None):
            raise ConfigError(f"capture.whiten={self.config.whiten!r} with factors "
                              f"{'given' if factors is not None else 'missing'}: whitened rows "
                              f"need both (fit the factors first: dattri_ds.fit_factors; "
                              f"GradientCapture / collect(..., factors=)), plain rows neither")
        self._factors = factors
        self._projector = Projector(self.config.projection) if self.config.projection else None
        self._handles: list = []
        self._open: list[_Record] = []
        self._current: _Record | None = None
        self._in_backward: _Record | None = None
        self._pending: deque[GradBatch] = deque()
        self._count = 0
        self._user_ids: list[str] | None = None
        self._next_norm: tuple[float | None, float] | None = None
        self._warned_no_info = False
        self._probing = False
        self._tied: list[TiedGroup] = []

    @classmethod
    def for_engine(cls, engine: object, config: CaptureConfig | None = None, *,
                   callbacks: Iterable[TrainingCallback] = (), cost: CostModel | None = None,
                   optimizer: torch.optim.Optimizer | None = None) -> GradientCapture:
        """Capture on a training engine (DeepSpeed engine or plain module) via its adapter.

        For a plain module, steps advance after every ``optimizer.step()`` when ``optimizer``
        is given, else when the loop calls ``next_step()``.
        """

        adapter = adapter_for(engine, optimizer=optimizer)
        cap = cls(adapter.unwrap(), config, callbacks=callbacks, cost=cost,
                  scale_fn=adapter.backward_scale,
                  step_fn=adapter.global_step if adapter.counts_steps else None)
        cap.adapter = adapter
        return cap

    # ---- lifecycle ------------------------------------------------------------------
    def __enter__(self) -> GradientCapture:
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def attach(self) -> GradientCapture:
        """Find the layers to capture and register the hooks."""
        if not self.probe_only and getattr(self.model, _ATTR, None) is not None:
            raise CaptureError(
                f"A GradientCapture is already attached to this {type(self.model).__name__}; "
                f"detach it (or leave its `with` block) before attaching another"
            )
        self._discover()
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._root_post))
        for name, (module, kind) in self.layers.items():
            self._handles.append(module.register_forward_hook(self._layer_hook(name, kind)))
        if not self.probe_only:
            setattr(self.model, _ATTR, self)
        if self.adapter is not None and not self.probe_only:
            adapter = self.adapter
            self._remove_step_hook = adapter.on_step(
                lambda: self.next_step(adapter.global_step() - 1))
        return self

    def detach(self) -> None:
        """Remove every hook; pending batches stay available to ``pop()``.

        The callbacks stay open (each gets ``on_detach``: a store commits its buffered
        rows): ``attach()`` resumes capturing into them. ``close()`` (or
        leaving the ``with`` block) detaches and closes them.
        """
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._open.clear()
        if self._remove_step_hook is not None:
            self._remove_step_hook()
            self._remove_step_hook = None
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)
        for cb in self.callbacks:  # a store commits its buffered rows: detach loses none
            getattr(cb, "on_detach", lambda: None)()

    def close(self) -> None:
        """Detach and close every callback (stores flush and close): the end of a capture."""
        self.detach()
        for cb in self.callbacks:
            cb.on_close()

    def _discover(self) -> None:
        cfg = self.config
        self.layers, self.unsupported, self._shapes = {}, [], {}
        for name, module in self.model.named_modules():
            if _matches(name, cfg.exclude) or not _has_own_trainable(module):
                continue  # containers hold no parameter of their own: nothing to match
            kind = kind_for(module)
            if kind is None:
                self.unsupported.append(f"{name} ({type(module).__name__})")
                continue
            if cfg.include and not _matches(name, cfg.include):
                continue
            shard = kind.shard_info(module)  # module attributes only: safe before check
            kind.check(module, name)
            self.layers[name] = (module, kind)
            self._shapes[name] = (kind.layer_shape(module), shard)
        if self.unsupported:
            msg = (f"{len(self.unsupported)} trainable module(s) have no LayerKind and are not "
                   f"captured: {', '.join(self.unsupported)}. Register a LayerKind, or list them "
                   f"in capture.exclude")
            if cfg.strict:
                raise UnsupportedLayerError(msg + " (capture.strict=True)")
            warnings.warn(msg, stacklevel=3)
        self._warn_tied()
        if not self.layers:
            raise UnsupportedLayerError(
                f"{type(self.model).__name__} has no layer that dattri-ds can capture "
                f"(include={list(cfg.include)}, exclude={list(cfg.exclude)}); supported kinds "
                f"are nn.Linear, HF Conv1D, nn.Embedding, LayerNorm and RMSNorm"
            )

    def _warn_tied(self) -> None:
        """Find tied weights; warn, by name, about ties no rule of dattri_ds/capture/tied.py covers."""
        self._tied, unsupported = find_tied(self.layers)
        if unsupported:
            warnings.warn(
                f"Modules {unsupported} share a parameter (tied weights) in a way dattri-ds "
                f"cannot merge. Each is captured as its own layer, so whole-model inner "
                f"products omit the cross terms between them; untie the weights or exclude "
                f"one of them for exact whole-parameter similarities", stacklevel=4)

    # ---- hooks ----------------------------------------------------------------------
    def tag(self, user_ids: list[str]) -> None:
        """Prefix the sample ids of the next forward call with these user ids."""
        self._user_ids = list(user_ids)

    def normalize_next(self, num_items: float | None = None, scale: float = 1.0) -> None:
        """Say how the loop reduces the loss of the next recorded forward call.

        Args:
            num_items: the token-mean denominator ``N`` when the loop divides the summed token
                loss by it outside the model (Hugging Face Trainer's ``num_items_in_batch``);
                None: the model's own reduction (``config.loss_reduction``).
            scale: a further factor the loop multiplies that loss by before backward (it
                multiplies ``config.backward_scale`` and the adapter's scale).
        """
        self._next_norm = (None if num_items is None else float(num_items), float(scale))

    def _active(self) -> bool:
        """Whether this forward is recorded: probes record only their own forward."""
        return self._probing if (self.probe_only or _PROBING.get()) else True

    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._open = [r for r in self._open if r.alive()]
        if not torch.is_grad_enabled() or not self._active():
            self._current = None
            return
        cfg = self.config
        info = batch_info(args, kwargs, label_shift=cfg.label_shift,
                          ignore_index=cfg.ignore_index, user_ids=self._user_ids)
        self._user_ids = None
        norm, self._next_norm = self._next_norm, None
        scale = 1.0
        if norm is not None:
            scale = norm[1]
            if norm[0] is not None and info is not None:
                info = info.with_num_items(norm[0])
        step = self.step_fn() if self.step_fn is not None else self.step
        self._current = _Record(self._count, step, info, scale=scale)
        self._count += 1
        self._open.append(self._current)

    def _root_post(self, module: nn.Module, args: tuple, output) -> None:
        rec = self._current
        if rec is not None and not rec.outputs and rec in self._open:
            self._open.remove(rec)  # nothing required grad: an evaluation forward
        self._current = None

    def _layer_hook(self, name: str, kind: LayerKind):
        # A kind's own capture rules are asked; the defaults (the output as is, the first
        # argument) are applied here, without a call per forward.
        own_output = type(kind).output is not LayerKind.output
        own_activation = type(kind).activation is not LayerKind.activation

        bdim = _bdim(kind, self.layers[name][0])  # read once, not per forward

        def hook(module: nn.Module, args: tuple, output) -> None:
            if not torch.is_grad_enabled() or not self._active():
                return None
            out = kind.output(module, output) if own_output else output
            if not torch.is_tensor(out) or not out.requires_grad:
                return None
            rec = self._current or self._in_backward or (self._open[-1] if self._open else None)
            if rec is None:
                return None  # called outside the root model's forward: not a captured example
            a = (kind.activation(module, args) if own_activation else args[0]).detach()
            new_output = None
            b = rec.info.rows if rec.info is not None else 0
            if (out is output and b > 0 and a.dim() == 1 and not a.is_floating_point()
                    and out.dim() == 2 and bdim == 0):
                # Indices without a batch dim (nanoGPT's ``wpe(torch.arange(T))`` -> [T, D]),
                # broadcast over the batch after this layer: the same as a [1, T, D] output.
                out = new_output = out.unsqueeze(0)
                a = a.unsqueeze(0)
            if ((out is output or new_output is not None) and out.dim() >= 2
                    and out.shape[0] == 1 and b > 1
                    and bdim == 0):
                # Broadcast over the batch after this layer (e.g. position embeddings [1, T, D]):
                # hand the model a batch-sized view so every example gets its own output-grad.
                # The forward value and the summed weight gradient are unchanged.
                out = new_output = out.expand(b, *out.shape[1:])
                a = a.expand(b, *a.shape[1:])
            rec.outputs.append(weakref.ref(out))
            if name not in rec.empty:
                rec.empty[name] = _empty_factors(a, out, bdim)
            if self._probing:
                rec.probe.append((name, a, out))
            else:
                out.register_hook(lambda g: self._on_grad(rec, name, a, g))
            return new_output
        return hook

    def _on_grad(self, rec: _Record, name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        if rec.done:
            warnings.warn(
                f"Layer '{name}' received a gradient after micro-batch {rec.index} was already "
                f"captured (a second backward through a retained graph); it is ignored",
                stacklevel=2)
            return
        rec.pairs[name].append((a, g.detach()))
        if not rec.queued:
            rec.queued = True
            self._in_backward = rec
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finalize(rec))

    # ---- finalize -------------------------------------------------------------------
    def _finalize(self, rec: _Record) -> None:
        rec.done = True
        self._in_backward = None
        if rec in self._open:
            self._open.remove(rec)
        batch = self._whitened(self._build(rec))
        rec.pairs.clear()
        if batch is not None:
            self._deliver(batch)

    def _info(self, rec: _Record, b: int, t: int, device: torch.device) -> BatchInfo:
        if rec.info is not None and rec.info.rows == b:
            return rec.info
        if not self._warned_no_info:
            self._warned_no_info = True
            warnings.warn(
                "The model was called without integer `input_ids` (first argument or keyword): "
                "sample ids fall back to '<micro-batch>:<row>' and every position counts as a "
                "loss token; pass input_ids/labels/attention_mask for exact semantics",
                stacklevel=3)
        counts = torch.full((b,), max(t - self.config.label_shift, 1), dtype=torch.long,
                            device=device)
        return BatchInfo(tuple(f"{rec.index}:{i}" for i in range(b)), counts)

    def _build(self, rec: _Record, scale_c: float | None = None) -> GradBatch | None:
        """The record's GradBatch: per-example scaled, tied layers merged, projected if asked.

        Launches per group, not per layer (docs/kernels.md): the layers of one kind and shape
        are built (``LayerKind.build_many``) and projected (``ops.space.project_layers``) as
        one stacked group. With a projection the per-example scale multiplies the projected
        rows instead of the output-grads (projection is linear per example, so the result
        is the same), saving a scaled copy of every output-grad. One number per batch says
        whether every value is finite (``nonfinite.finite_total``); it is read together
        with the sample ids' tokens: the batch's one host sync.
        """
        cfg = self.config
        post = self._projector is not None and self._factors is None
        first, first_pairs = next(iter(rec.pairs.items()))
        bdim = _bdim(self.layers[first][1], self.layers[first][0])
        some_g = first_pairs[0][1]
        tokens = some_g.shape[1 - bdim] if some_g.dim() > 2 else 1
        info = self._info(rec, first_pairs[0][0].shape[bdim], tokens, some_g.device)
        if scale_c is None:
            scale_c = (cfg.backward_scale * rec.scale
                       * (self.scale_fn() if self.scale_fn else 1.0))
        scale = example_scale(info.token_counts, loss_reduction=cfg.loss_reduction,
                              per_example_loss=cfg.per_example_loss, backward_scale=scale_c,
                              num_items=info.num_items)
        scale = scale.to(device=some_g.device, dtype=torch.float32)
        cost = self.cost or default_cost_model(some_g.device)
        layers = self._layers(rec, scale, post, cost)
        merge_tied(layers, self._tied)
        if post:  # NaN/inf propagate through the projection: check the small projected rows
            layers = project_layers(layers, self._projector, cost, scale=scale)
        finite = self._read(info, layers, agree=not post)
        batch = GradBatch(rec.step, info.sample_ids, layers, rec.index, info.token_counts)
        if finite:
            return batch
        bad, layer = nonfinite_rows(batch, agree=not post)
        if bad is None:  # a norm overflowed; every value is finite
            return batch
        keep = torch.nonzero(~bad).flatten().cpu()
        self._nonfinite(layer, rec, [batch.sample_ids[i] for i in
                                     torch.nonzero(bad).flatten().tolist()], keep.numel())
        return replace(batch.index(keep), kept=keep) if keep.numel() else None

    def _layers(self, rec: _Record, scale: torch.Tensor, post: bool,
                cost: CostModel) -> dict[str, LayerGrad]:
        """Every captured layer's data, in module order, each kind's layers built together
        (``LayerKind.build_many``); output-grads scaled first unless a projection scales the
        rows (dense-only kinds produce rows: always scaled)."""
        cfg = self.config
        dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
        calls: dict[int, list[tuple[str, nn.Module, tuple]]] = defaultdict(list)
        kinds: dict[int, LayerKind] = {}
        for name, (module, kind) in self.layers.items():
            pairs = rec.pairs.get(name)
            if not pairs:
                if name not in rec.empty:
                    continue  # the layer did not run in this forward
                pairs = [rec.empty[name]]
            elif len(pairs) > 1 and not cfg.allow_shared:
                raise CaptureError(
                    f"Layer '{name}' ran {len(pairs)} times in one forward pass (weight "
                    f"sharing or a module called twice); set capture.allow_shared=True to sum "
                    f"its gradients over the calls")
            kinds[id(kind)] = kind  # by id: a kind's hash is a Python call
            calls[id(kind)].extend((name, module, pair) for pair in pairs)
        parts: dict[str, list[Factorized | Dense]] = defaultdict(list)
        for key, items in calls.items():
            kind = kinds[key]
            own = kind.dense_only or not post
            built = kind.build_many([m for _, m, _ in items], [p for *_, p in items],
                                    scale if own else None, dtype if not post else None,
                                    cost)
            for (name, _, _), data in zip(items, built):
                parts[name].append(data)
        layers: dict[str, LayerGrad] = {}
        for name in self.layers:
            if name in parts:
                shape, shard = self._shapes[name]
                layers[name] = LayerGrad(name, self.layers[name][1], _merge(parts[name]),
                                         shape, shard=shard)
        return layers

    def _read(self, info: BatchInfo, layers: dict[str, LayerGrad], agree: bool) -> bool:
        """Bring the sample ids' tokens and the finiteness total to the host in one copy
        (``nonfinite.read_with_flag``); whether every value is finite."""
        host, finite = read_with_flag(info.host_sources(), layers.values(), agree)
        info.resolve(host)
        return finite

    def _nonfinite(self, name: str, rec: _Record, bad_ids: list[str], kept: int) -> None:
        """Warn (or raise) about examples with a NaN/inf gradient, naming them by sample id."""
        who = f"Layer '{name}'" if name else "A layer sharded on another tensor-parallel rank"
        shown = bad_ids[:5] + ([f"... {len(bad_ids) - 5} more"] if len(bad_ids) > 5 else [])
        msg = (f"{who} has a NaN/inf per-example gradient for {len(bad_ids)} example(s) "
               f"{shown} in micro-batch {rec.index} (step {rec.step})")
        if self.config.on_nonfinite == "raise":
            raise CaptureError(msg + "; set capture.on_nonfinite='skip' to drop such examples")
        self.skipped_examples += len(bad_ids)
        if kept == 0:
            self.skipped += 1
            warnings.warn(msg + "; the micro-batch is dropped", stacklevel=3)
        else:
            warnings.warn(msg + f"; only those are dropped, the other {kept} are kept",
                          stacklevel=3)

    def _deliver(self, batch: GradBatch) -> None:
        if self.callbacks:
            for cb in self.callbacks:
                cb.on_batch(batch)
            return
        self._pending.append(batch)
        if len(self._pending) > self.config.max_pending:
            warnings.warn(
                f"{len(self._pending)} captured batches are waiting; call capture.pop() or "
                f"pass callbacks (capture.max_pending={self.config.max_pending})", stacklevel=3)

    # ---- probing: per-example gradients without touching parameter gradients ------------
    def probe(self, forward: Callable[[], torch.Tensor], *,
              retain_graph: bool = False) -> GradBatch | None:
        """Per-example gradients of one forward, computed without any parameter ``.grad``.

        ``forward()`` must call the root model and return its reduced loss (reduced as
        ``config.loss_reduction`` says); it may call the model several times (e.g. once
        per example) and return the sum of the calls' losses: the batch then holds every
        call's examples in call order. Only gradients w.r.t. the captured layers' outputs
        are computed (``torch.autograd.grad``), so engines see no gradient accumulation and
        no reduction: safe between the steps of DDP, FSDP2 and DeepSpeed ZeRO-3 training.
        ``retain_graph=True`` keeps the forward graphs, so the caller may back-propagate
        (some of) the calls' losses again afterwards.
        The batch is returned (and projected if configured), not delivered to callbacks;
        Its ``kept`` holds the positions of the kept examples over all calls (None: all).
        Cost: one forward and one backward without weight-gradient matmuls, which stops
        at the lowest captured layer.
        """
        self._probing = True
        token = _PROBING.set(True)
        first = self._count
        try:
            loss = forward()
            recs = [r for r in self._open if r.index >= first and r.probe]
        finally:
            _PROBING.reset(token)
            self._probing = False
        if not recs:
            return None
        entries = [(r, name, a, o) for r in recs for name, a, o in r.probe]
        for r in recs:
            r.probe = []
        grads = torch.autograd.grad(loss, [o for *_, o in entries], allow_unused=True,
                                    retain_graph=retain_graph)
        for (r, name, a, _), g in zip(entries, grads):
            if g is not None:
                r.pairs[name].append((a, g.detach()))
        return self._whitened(self._build_probed(recs))

    def _whitened(self, batch: GradBatch | None) -> GradBatch | None:
        """The post-capture step of ``config.whiten``: the exact batch whitened by the
        factors, then projected (``<projection>+whitened:<method>``); others as they are."""
        if batch is None or self._factors is None:
            return batch
        return project_batch(self._factors.whiten(batch, method=self.config.whiten),
                             self._projector, self.cost)

    def _build_probed(self, recs: list[_Record]) -> GradBatch | None:
        """The probed records' batches, concatenated; ``kept`` over all of them."""
        batches, kept, offset, dropped = [], [], 0, False
        for r in recs:
            r.done = True
            self._open.remove(r)
            rows = _rows(r)
            batch = self._build(r, scale_c=1.0) if r.pairs else None
            r.pairs.clear()
            if batch is not None:
                batches.append(batch)
                kept.append((batch.kept if batch.kept is not None else torch.arange(rows))
                            + offset)
            dropped |= batch is None or batch.kept is not None
            offset += rows
        if not batches:
            return None
        out = batches[0] if len(batches) == 1 else GradBatch.cat(batches)
        return replace(out, kept=torch.cat(kept)) if dropped else out

    # ---- consumer API ---------------------------------------------------------------
    def pop(self) -> GradBatch | None:
        """The oldest captured batch not yet consumed, or None."""
        return self._pending.popleft() if self._pending else None

    def drain(self) -> list[GradBatch]:
        """All captured batches not yet consumed, oldest first."""
        out = list(self._pending)
        self._pending.clear()
        return out

    def next_step(self, step: int | None = None) -> None:
        """Mark an optimizer-step boundary: callbacks see ``on_step_end(step)``.

        Engine adapters call this after every optimizer step; plain loops may call it
        themselves so that GradBatch.step counts optimizer steps.
        """
        for cb in self.callbacks:
            cb.on_step_end(self.step if step is None else step)
        self.step += 1


def _bdim(kind: LayerKind, module: nn.Module) -> int:
    """``layers.base.batch_dim_of`` read here: where B sits (1 for sequence-first kinds)."""
    fn = getattr(kind, "batch_dim", None)
    return fn(module) if fn is not None else 0


def _rows(rec: _Record) -> int:
    """Examples of a record's forward call (from its ids, else its zero-token factors)."""
    if rec.info is not None:
        return rec.info.rows
    a0, _ = next(iter(rec.empty.values()))
    return a0.shape[1] if a0.dim() > 1 and a0.shape[0] == 0 else a0.shape[0]


def _empty_factors(a: torch.Tensor, out: torch.Tensor,
                   bdim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-token factors ``[B, 0, ...]`` (``[0, B, ...]`` sequence-first): the exact gradient
    of a layer that got no grad."""
    b = a.shape[bdim]
    lead = (b, 0) if bdim == 0 else (0, b)
    a0 = a.new_empty(lead + ((a.shape[-1],) if a.is_floating_point() else ()))
    return a0, out.new_empty(lead + (out.shape[-1],))


def _merge(parts: list[Factorized | Dense]) -> Factorized | Dense:
    """Sum of the gradients of several calls of one module: tokens concatenate."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], Dense):
        return Dense(sum(p.values for p in parts))
    return Factorized(torch.cat([p.a for p in parts], 1), torch.cat([p.g for p in parts], 1))
