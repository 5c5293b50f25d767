"""The training loop of launch/train.py, one for every backend.

The loop owns what does not depend on the engine: the data order (``step_slots``,
a function of the step, so a resumed run continues the same stream), online selection,
capture tags, the step bookkeeping (``RunLog``: losses, lrs, evaluations, non-finite steps),
checkpoints with the loop's own state, and resume. A ``Backend`` does the rest: it builds the
model and optimizer, runs forward and backward of one micro-batch, steps the optimizer,
attaches capture, and saves / loads its own checkpoint.

Backends are looked up by ``--backend`` name (``engine.backend``) in ``BACKENDS``
(launch/engine.py: ``"name": "module:Class"``, imported on use so that DeepSpeed and
Megatron stay optional): add one by writing a ``Backend`` subclass and one line there.
``deepspeed`` (launch/deepspeed_backend.py), ``megatron`` (launch/megatron_backend.py) and
``torch`` (launch/torch_backend.py: one plain PyTorch process, which the demo and the
selection benchmarks run through ``train.train_in_process``).

Resume (``train.resume``): the backend restores weights, optimizer and lr schedule; the loop
restores the step, every rank's RNG state and the ``RunRecord`` (``LoopState``), and with
online selection the selector's state and log (selection/state.py), so the resumed run
trains and chooses what the uninterrupted one would have; on another data-parallel world
size (an *elastic* resume) the backend reshards its state (``Backend.load_resharded``) and
the data stream continues where the checkpoint stopped (``LoopState.origin``). What is
saved, what equals what, and the tests: docs/training.md, docs/multinode.md.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.launch.config import RunConfig
from dattri_ds.launch.engine import BACKENDS
from dattri_ds.launch.runlog import RunLog, RunRecord, make_run_id
from dattri_ds.io.outputs import write_atomic
from dattri_ds.sample_id import SampleId
from dattri_ds.selection.state import SelectionCheckpoint, config_difference, log_lines_before

__all__ = ["Backend", "BACKENDS", "backend_class", "LoopState", "train", "resume",
           "resume_tag", "Checkpoints", "micro_batch_indices", "step_slots", "fingerprint",
           "seal_captured_store"]

logger = logging.getLogger("dattri_ds.launch")

def backend_class(name: str) -> type[Backend]:
    """The Backend class registered as ``name``.

    Raises:
        ConfigError: an unknown name.
    """
    if name not in BACKENDS:
        raise ConfigError(f"--backend {name!r} is not known; use one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


class Backend(ABC):
    """One training engine driven by ``train``.

    ``setup`` runs before any model exists (checks, then the process groups); the constructor
    builds model and optimizer, writing nothing (a refused resume leaves the run as it was);
    ``write_model_config`` then writes ``<out>/model``. Attributes every backend sets:
    ``model`` (called like a Hugging Face causal LM: ``model(**batch).loss``; what capture,
    selection and evaluation use), ``ctx`` (data- and tensor-parallel groups), ``device``,
    ``micro`` (examples per micro-batch and rank) and ``gas`` (micro-batches per step).
    """

    #: Appended to the run fingerprint in stores (stores of two backends never mix).
    fingerprint_suffix: ClassVar[str] = ""
    #: ``backward_reused`` back-propagates a loss the selector computed from the candidates'
    #: forward (``selection.reuse_forward``); backends without it forward the chosen again.
    reuses_selection_forward: ClassVar[bool] = False

    model: nn.Module
    ctx: ParallelContext
    device: torch.device
    micro: int
    gas: int

    @classmethod
    @abstractmethod
    def setup(cls, ds_config: dict, cfg: RunConfig) -> tuple[int, int]:
        """Check the settings (``cfg.engine``, the DeepSpeed JSON), start the process groups; return ``(global rank, world size)``."""

    @abstractmethod
    def __init__(self, ds_config: dict, cfg: RunConfig, tok, data) -> None:
        """Build model and optimizer on this rank (nothing written yet)."""

    def write_model_config(self, out: Path) -> None:
        """Rank 0: what the offline tools need to rebuild the model, in ``<out>/model``
        (default: the Hugging Face model's ``config.json``)."""
        self.model.config.save_pretrained(str(out / "model"))

    @property
    @abstractmethod
    def optimizer(self) -> Any:
        """The optimizer (read by ``--selection-precondition adam``)."""

    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""

    @abstractmethod
    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward of one micro-batch (``1 / gas`` of the step); its loss."""

    def backward_reused(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of one micro-batch whose forward the selector already ran; its loss."""
        raise NotImplementedError(f"{type(self).__name__} does not train on reused forwards")

    @abstractmethod
    def optimizer_step(self) -> None:
        """After the ``gas`` micro-batches of a step: synchronize, clip, step, zero."""

    @abstractmethod
    def attach_capture(self, cfg: RunConfig, callbacks: list, start_step: int):
        """An attached GradientCapture on ``model`` writing to ``callbacks``, its step count
        starting at ``start_step``."""

    @abstractmethod
    def save(self, ckpt_dir: Path, tag: str, meta: dict, data) -> None:
        """Write checkpoint ``ckpt_dir/tag`` (collective); ``meta`` has tag, step and lr."""

    @abstractmethod
    def load(self, ckpt_dir: Path, tag: str) -> None:
        """Restore weights, optimizer and lr schedule from ``ckpt_dir/tag`` (collective).

        Raises:
            ConfigError: the checkpoint cannot be resumed by this run.
        """

    def check_selection(self) -> None:
        """Refuse, at start, an engine online selection cannot drive (default: accept)."""

    def selection_log(self, out: Path) -> Path | None:
        """Where this rank logs its selections (None: it does not)."""
        return out / "selection.jsonl"

    def store_writer(self) -> bool:
        """Whether this rank writes a store shard (ranks holding the same examples write one)."""
        return self.ctx.tp_rank == 0

    def layout(self) -> dict[str, int]:
        """The process layout a checkpoint of this run can be resumed with."""
        return {"dp": self.ctx.dp_world, "tp": self.ctx.tp_world}

    def load_resharded(self, ckpt_dir: Path, tag: str, saved: dict[str, int]) -> None:
        """Restore weights, optimizer and lr schedule from ``ckpt_dir/tag``, written with the
        process layout ``saved`` (another data-parallel world size): an elastic resume.

        Raises:
            ConfigError: this backend resumes only on the layout that wrote the checkpoint.
        """
        raise ConfigError(f"--resume {tag}: the checkpoint was written with the process "
                          f"layout {saved}, this run has {self.layout()}, and "
                          f"{type(self).__name__} resumes only on the layout that wrote it: "
                          f"resume with the same number of processes and parallel sizes "
                          f"(elastic resume onto another world size runs on --backend "
                          f"deepspeed)")

    def summary(self) -> dict:
        """Backend-specific fields of ``summary.json``."""
        return {}


@dataclass(frozen=True, kw_only=True)
class LoopState:
    """The loop's part of a checkpoint, one per rank (``loop_state.rank<R>.pt``)."""

    step: int
    """Optimizer steps done: the resumed run starts at this step (its data position)."""

    record: RunRecord
    """The run record up to ``step`` (equal on every rank)."""

    rng: dict[str, Any]
    """This rank's RNG states (``torch`` CPU, and CUDA when available)."""

    layout: dict[str, int]
    """``Backend.layout()`` of the run that wrote it (another data-parallel size: elastic)."""

    origin: tuple[int, int] = (0, 0)
    """``(step, position)``: the data stream's position (in candidate slots) at which that
    step began under this layout; ``micro_batch_indices`` counts on from it. ``(0, 0)``
    unless the run was resumed on another world size."""

    per_step: int = 0
    """Candidate slots one step consumed (candidates x gas x DP ranks); 0: not recorded."""

    selection: SelectionCheckpoint | None = None
    """On resume with online selection: this rank's selector state and log lines (saved
    apart from this file, by ``SelectionCheckpoint``); None otherwise."""

    FILE: ClassVar[str] = "loop_state.rank{rank:05d}.pt"

    @staticmethod
    def capture_rng() -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return rng

    def restore_rng(self) -> None:
        torch.set_rng_state(self.rng["torch"])
        if torch.cuda.is_available() and "cuda" in self.rng:
            torch.cuda.set_rng_state(self.rng["cuda"])

    def save(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"step": self.step, "record": self.record.to_dict(), "rng": self.rng,
                    "layout": self.layout, "origin": list(self.origin),
                    "per_step": self.per_step}, folder / self.FILE.format(rank=rank))

    @classmethod
    def load(cls, folder: Path, rank: int) -> LoopState:
        """Raises: ConfigError: no state of this rank (written by fewer ranks, or by an older
        dattri-ds)."""
        path = folder / cls.FILE.format(rank=rank)
        if not path.exists():
            raise ConfigError(f"{folder} has no loop state of rank {rank} ({path.name}): it was "
                              f"written by fewer processes or by a dattri-ds without resume; "
                              f"resume with the number of processes that wrote it")
        d = torch.load(path, map_location="cpu", weights_only=True)
        return cls(step=int(d["step"]), record=RunRecord.from_dict(d["record"]), rng=d["rng"],
                   layout=dict(d["layout"]), origin=tuple(d.get("origin", (0, 0))),
                   per_step=int(d.get("per_step", 0)))

    selection_copied: bool = False
    """Elastic resume onto more ranks: this rank continues another rank's selector state
    (its run statistics start at zero, so that none is counted twice)."""

    def origin_for(self, per_step: int) -> tuple[int, int]:
        """The ``origin`` of a run resumed from this state that consumes ``per_step`` slots
        a step: unchanged when the step consumes what it did, else ``(step, the position
        this state reached)``.

        Raises:
            ConfigError: the layout changed and the checkpoint did not record its position.
        """
        if per_step == self.per_step or self.step == 0:
            return self.origin if self.step else (0, 0)
        if not self.per_step:
            raise ConfigError(f"--resume at step {self.step}: the checkpoint does not record "
                              f"its data position (written by a dattri-ds before elastic "
                              f"resume) and this run consumes another number of examples a "
                              f"step ({per_step}); resume with the processes, micro-batch and "
                              f"accumulation that wrote it")
        return self.step, self.origin[1] + (self.step - self.origin[0]) * self.per_step


@functools.lru_cache(maxsize=2)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The seeded permutation of epoch ``epoch`` (kept: a step reads at most two epochs, and
    drawing ``randperm(n)`` per example cost O(n) host time per example)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


def step_slots(n: int, step: int, micro: int, gas: int, world: int, seed: int,
               origin: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """Example indices ``[gas, world, micro]`` of step ``step``'s slots, and how many earlier
    slots of the step (in stream order) hold the same example (0 but where the step runs
    past the end of an epoch: docs/multinode.md). The stream is a seeded permutation per
    epoch, laid end to end; step ``s`` begins at position
    ``origin[1] + (s - origin[0]) * micro * gas * world``; an elastic resume moves ``origin``
    to the resumed step and the position the old layout reached, so no example of the
    stream is skipped or repeated when the world size changes."""
    per_step = micro * gas * world
    start = origin[1] + (step - origin[0]) * per_step
    parts = []
    for epoch in range(start // n, (start + per_step - 1) // n + 1):
        lo = epoch * n
        parts.append(_epoch_order(n, seed, epoch)[max(start - lo, 0):start + per_step - lo])
    flat = torch.cat(parts)
    repeats = torch.zeros_like(flat)
    if len(parts) > 1:  # rank of each slot among the slots of its example, in stream order
        order = torch.argsort(flat, stable=True)
        pos = torch.arange(per_step)
        first = torch.ones(per_step, dtype=torch.bool)
        first[1:] = flat[order][1:] != flat[order][:-1]
        repeats[order] = pos - torch.cummax(torch.where(first, pos, 0), 0).values
    return flat.view(gas, world, micro), repeats.view(gas, world, micro)


def micro_batch_indices(n: int, step: int, micro: int, gas: int, rank: int, world: int,
                        seed: int, origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Example indices ``[gas, micro]`` of (step, micro-batch, rank) (``step_slots``)."""
    return step_slots(n, step, micro, gas, world, seed, origin)[0][:, rank].contiguous()


def fingerprint(cfg: RunConfig, tok) -> str:
    """Identity of the trained model family recorded in stores: config + tokenizer + seed."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps([cfg.train.model_config, cfg.train.model_path, cfg.train.seed,
                         cfg.train.seq_len]).encode())
    h.update(tok.fingerprint.encode())
    return f"run:{h.hexdigest()}"


def selection_config(cfg: RunConfig) -> dict:
    """The resolved selection config as JSON data (what a checkpoint records)."""
    import dataclasses

    return json.loads(json.dumps(dataclasses.asdict(cfg.selection)))


def check_resume(cfg: RunConfig, out: Path | str) -> None:
    """Refuse, before any process starts, what a resume cannot reproduce: no complete
    checkpoint to continue from (``resume_tag``), or online selection under a selection
    config other than the checkpoint's (its selector state would not fit or would choose
    differently). Every other setting the selector holds is restored.

    Raises:
        ConfigError: no such checkpoint, or a selection key that differs from the
            checkpoint's (named, with both values).
    """
    if not cfg.train.resume:
        return
    tag = resume_tag(Path(out), cfg.train.resume)
    if tag is None or not cfg.selection.enabled:
        return
    saved = SelectionCheckpoint.config_of(Path(out) / "checkpoints" / tag)
    if saved is None:
        return  # written without selection: ``resume`` starts a fresh selector (warned)
    diff = config_difference(saved, selection_config(cfg))
    if diff is not None:
        key, was, now = diff
        raise ConfigError(f"--resume {tag}: the checkpoint was written with {key}={was!r}, "
                          f"this run has {key}={now!r}; a selector's state continues only "
                          f"under the settings that wrote it: set {key} back to {was!r}, or "
                          f"start a fresh run (drop --resume)")


@dataclass(frozen=True)
class Checkpoints:
    """The checkpoints of a run folder, as a resume sees them.

    A checkpoint is *complete* once ``trajectory.json`` lists it: the loop rewrites that file
    (atomically) only after every rank has written the checkpoint, so a folder under
    ``checkpoints/`` that it does not list was being written when the run stopped
    (``incomplete``), and a listed tag without its folder was deleted (``missing``).
    """

    listed: tuple[str, ...]
    """Tags in ``trajectory.json``, oldest first."""

    existing: tuple[str, ...]
    """Listed tags whose folder exists: the checkpoints a run can resume from."""

    incomplete: tuple[str, ...]
    """Folders under ``checkpoints/`` that ``trajectory.json`` does not list."""

    @classmethod
    def of(cls, out: Path, flag: str = "--resume") -> Checkpoints:
        from dattri_ds.io.files import read_json

        traj, folder = out / "trajectory.json", out / "checkpoints"
        data = read_json(traj, "trajectory", flag=flag) if traj.exists() else {}
        rows = data.get("checkpoints", []) if isinstance(data, dict) else None
        if not isinstance(rows, list) or not all(isinstance(c, dict) and isinstance(
                c.get("tag"), str) for c in rows):
            raise ConfigError(f"{traj} is not a launch/train.py trajectory (no list of "
                              f"checkpoints with tags); pass {flag} the --out of a launch run")
        listed = tuple(c["tag"] for c in rows)
        existing = tuple(t for t in listed if (folder / t).is_dir())
        incomplete = tuple(sorted((p.name for p in folder.iterdir() if p.is_dir()
                                   and p.name not in listed), key=lambda t: (len(t), t))
                           ) if folder.is_dir() else ()
        return cls(listed, existing, incomplete)

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(t for t in self.listed if t not in self.existing)

    def choose(self, out: Path, wanted: str, flag: str = "--resume",
               fresh_ok: bool = True) -> str | None:
        """The complete checkpoint ``wanted`` names (``latest``: the newest one); None when
        ``wanted`` is ``latest``, ``fresh_ok`` and no checkpoint was ever completed (the
        run starts at step 0).

        Raises:
            ConfigError: naming what exists and a fix that works: a tag that is not there,
                an incomplete one, or ``latest`` when the newest checkpoint was deleted.
        """
        where = out / "checkpoints"
        have = list(self.existing)
        other = (f"pass {flag} {have[-1]} to continue from the newest that exists"
                 if have else "no checkpoint of this run exists: drop " + flag)
        if wanted == "latest":
            if self.missing and self.listed[-1] in self.missing:
                raise ConfigError(
                    f"{flag} latest: the newest checkpoint of {out}, '{self.listed[-1]}' "
                    f"(trajectory.json), is missing from {where} (deleted?); checkpoints that "
                    f"exist: {have}. Fix: {other}, or --force to start over")
            if have:
                return have[-1]
            if fresh_ok and (self.incomplete or (out / "resolved_dattri_ds_config.json"
                                                 ).exists()):
                return None
            raise ConfigError(f"{flag} latest: {out} holds no run to continue (no "
                              f"trajectory.json, no checkpoints); pass the --out of the run to "
                              f"continue, or drop {flag} to start one")
        if wanted in have:
            return wanted
        if wanted in self.incomplete:
            raise ConfigError(f"{flag} {wanted}: {where / wanted} is incomplete (the run stopped "
                              f"while writing it; trajectory.json does not list it); complete "
                              f"checkpoints: {have}. Fix: "
                              f"{other if have else 'drop ' + flag + ' (or pass --force)'}")
        listed = " (listed in trajectory.json but deleted)" if wanted in self.missing else ""
        raise ConfigError(f"{flag} {wanted}: no checkpoint '{wanted}' in {where}{listed} "
                          f"(checkpoints of this run: {have}); pass the --out of the run to "
                          f"continue and one of its tags" + (", or 'latest'" if have and
                                                             not self.missing else ""))


def resume_tag(out: Path, resume: str) -> str | None:
    """The complete checkpoint tag ``train.resume`` names (``latest``: the newest one that
    ``trajectory.json`` lists); None for ``latest`` when the run never completed one (a run
    stopped during its first checkpoint: it restarts at step 0).

    Raises:
        ConfigError: no such complete checkpoint in ``out`` (what exists named).
    """
    return Checkpoints.of(out).choose(out, resume)


def _capture(backend: Backend, cfg: RunConfig, out: Path, tok, run_id: str, start: int):
    """Capture on every rank; one store shard per data-parallel rank (``store_writer``)."""
    if not cfg.capture_enabled:
        return None
    from dattri_ds.store import StoreCallback

    if cfg.capture.projection is None:
        raise ConfigError("--capture stores projected gradients: pass --capture-projection-dim "
                          "256 (or set dattri_ds.capture.hooks.projection in the DeepSpeed JSON)")
    ctx, cbs = backend.ctx, []
    if backend.store_writer():
        cbs.append(StoreCallback(cfg.store_config(out), projection=cfg.capture.projection,
                                 fingerprint=fingerprint(cfg, tok) + backend.fingerprint_suffix,
                                 rank=ctx.dp_rank, world=ctx.dp_world, capture=cfg.capture,
                                 run_id=run_id))
    return backend.attach_capture(cfg, cbs, start)


def resume(backend: Backend, cfg: RunConfig, out: Path, rank: int) -> LoopState | None:
    """With ``train.resume``: check the checkpoint fits this run, load the backend's state
    from it and return the loop's (``train`` restores its RNG right before the first step,
    and the selector's state, with its log lines of the steps before, read here before the
    selector rewrites its log). None for a fresh run. Call before anything is written to
    ``out``.

    Raises:
        ConfigError: no such checkpoint, one written by another process layout, or one
            written with selection that lacks this rank's selector state.
    """
    check_shared_out(out, rank)
    if not cfg.train.resume:
        return None
    found = Checkpoints.of(out)
    tag = found.choose(out, cfg.train.resume)
    if rank == 0 and found.incomplete:
        logger.warning("--resume %s: skipping %s under %s: written when the run stopped, "
                       "incomplete (trajectory.json does not list it); it is written again "
                       "when the run reaches it", cfg.train.resume,
                       ", ".join(found.incomplete), out / "checkpoints")
    if tag is None:
        if rank == 0:
            logger.warning("--resume latest: %s holds no complete checkpoint; the run starts "
                           "again at step 0 (stored gradients already committed are kept)",
                           out)
        return None
    folder = out / "checkpoints" / tag
    try:
        state = LoopState.load(folder, rank)
    except ConfigError:
        state = LoopState.load(folder, 0)  # more ranks than wrote it: an elastic resume
        if rank < state.layout["dp"] * state.layout.get("tp", 1):
            raise
    saved_dp = state.layout["dp"]
    elastic = state.layout != backend.layout()
    if elastic and rank == 0:
        logger.info("--resume %s: elastic resume from the process layout %s onto %s", tag,
                    state.layout, backend.layout())
    selection = None
    if cfg.selection.enabled and SelectionCheckpoint.config_of(folder) is not None:
        from dattri_ds.selection.online import log_file, writes_log

        log = backend.selection_log(out)  # read before the selector rewrites its log
        if log is not None and writes_log(cfg.selection, backend.ctx):
            log = log_file(log, backend.ctx.dp_rank)
        else:
            log = None
        source = backend.ctx.dp_rank % saved_dp if elastic else rank  # rank r <- r mod W
        selection = SelectionCheckpoint.read(folder, source, log_lines_before(log, state.step))
        if elastic and rank == 0:
            _trim_dropped_logs(backend.selection_log(out), backend.ctx.dp_world, saved_dp,
                               state.step)
        state = replace(state, selection_copied=elastic and backend.ctx.dp_rank >= saved_dp)
    elif cfg.selection.enabled and rank == 0:
        logger.warning("--resume %s: the checkpoint was written without online selection; "
                       "the selector starts fresh at step %d", tag, state.step)
    if elastic:
        backend.load_resharded(out / "checkpoints", tag, state.layout)
        _rollback_store(cfg, out, rank, state.step)
    else:
        backend.load(out / "checkpoints", tag)
    logger.info("resuming from %s at step %d", tag, state.step)
    return replace(state, selection=selection)


def check_shared_out(out: Path, rank: int) -> None:
    """Every rank sees the ``--out`` that rank 0 wrote to (several nodes need it on a shared
    file system): rank 0 writes a token there, every rank reads it back (collective; a no-op
    in one process).

    Raises:
        ConfigError: on every rank, naming the ranks and hosts that do not see it.
    """
    import os
    import socket

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mark = out / f".shared.{make_run_id('check', out)[4:]}"
    token = f"{socket.gethostname()}:{os.urandom(8).hex()}"  # not torch's RNG: the run's
    sent = [token]
    dist.broadcast_object_list(sent, src=0)
    if rank == 0:
        mark.write_text(sent[0], encoding="utf-8")
    dist.barrier()
    try:
        seen = mark.read_text(encoding="utf-8") == sent[0]
    except OSError:
        seen = False
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if seen else f"rank {rank} on {socket.gethostname()}")
    dist.barrier()
    if rank == 0:
        mark.unlink(missing_ok=True)
    blind = [b for b in blind if b is not None]
    if blind:
        raise ConfigError(f"--out {out} is not shared: {', '.join(blind)} cannot read what "
                          f"rank 0 ({sent[0].split(':')[0]}) wrote there; runs on several "
                          f"nodes need --out on a file system every node mounts at the same "
                          f"path (docs/multinode.md)")


def _rollback_store(cfg: RunConfig, out: Path, rank: int, step: int) -> None:
    """Elastic resume with capture: rank 0 drops the stored rows of steps from ``step`` on
    (the stopped run's, of a data order this run does not repeat), before any rank opens
    its shard."""
    import torch.distributed as dist

    if not cfg.capture_enabled:
        return
    if rank == 0:
        from dattri_ds.store.shard import rollback_to_step

        dropped = rollback_to_step(cfg.store_config(out).path, step)
        if dropped:
            logger.info("--resume: dropped %d stored rows of steps >= %d (written after the "
                        "checkpoint by the stopped run)", sum(dropped.values()), step)
    if dist.is_initialized():
        dist.barrier()


def _trim_dropped_logs(log: Path | None, world: int, saved: int, step: int) -> None:
    """Elastic resume onto fewer ranks: the selection logs of the ranks that no longer run
    keep only their records of the steps before the checkpoint."""
    from dattri_ds.selection.online import log_file

    for r in range(world, saved):
        path = log_file(log, r) if log is not None else None
        if path is not None and path.exists():
            write_atomic(path, "".join(log_lines_before(path, step)))


def train(backend: Backend, cfg: RunConfig, data, out: Path, tok, rank: int,
          selector=None, evaluator=None, resumed: LoopState | None = None) -> dict:
    """Train up to ``cfg.train.steps`` optimizer steps; the run summary.

    ``resumed`` (from ``resume``) continues at its step with its record and RNG state.
    Nothing here knows about capture: hooks and the selector do the work.
    """
    import torch.distributed as dist

    tc, ctx, micro, gas = cfg.train, backend.ctx, backend.micro, backend.gas
    start = resumed.step if resumed is not None else 0
    run_id = make_run_id(fingerprint(cfg, tok) + backend.fingerprint_suffix, out)
    capture = _capture(backend, cfg, out, tok, run_id, start)
    n_cand = selector.num_candidates(micro) if selector is not None else micro
    per_step = n_cand * gas * ctx.dp_world  # candidate slots of the stream one step consumes
    origin = resumed.origin_for(per_step) if resumed is not None else (0, 0)
    ckpt_dir = out / "checkpoints"
    log = RunLog(tc, out, rank, evaluator, run_id=run_id,
                 record=resumed.record if resumed is not None else None)

    def save(tag: str, step: int, lr: float) -> None:
        if capture is not None:  # a checkpoint implies the rows of its steps are committed:
            for cb in capture.callbacks:  # a resume from it never recomputes them
                cb.on_detach()  # StoreCallback: commit the buffered rows
        backend.save(ckpt_dir, tag, {"tag": tag, "step": step, "lr": lr}, data)
        LoopState(step=step, record=log.record, rng=LoopState.capture_rng(),
                  layout=backend.layout(), origin=origin, per_step=per_step
                  ).save(ckpt_dir / tag, rank)
        if selector is not None:  # every rank: under rank scope each rank's state differs
            SelectionCheckpoint.write(ckpt_dir / tag, rank, selector.state_dict(),
                                      selection_config(cfg) if rank == 0 else None)
        dist.barrier()

    backend.model.train()
    if resumed is not None and resumed.selection is not None and selector is not None:
        state = resumed.selection.state
        if resumed.selection_copied:  # another rank's state: its statistics count there
            state = {**state, "log": selector.state_dict()["log"]}
        selector.load_state_dict(state, resumed.selection.log)
    if resumed is not None:
        resumed.restore_rng()
    else:  # dropout's stream from the seed: equal on every launch, node layout and launcher
        torch.manual_seed(tc.seed)
    for step in range(start, tc.steps):
        idx, repeats = (t[:, ctx.dp_rank] for t in step_slots(
            len(data), step, n_cand, gas, ctx.dp_world, tc.seed, origin))
        lr = backend.lr()  # the lr this step uses
        step_loss = torch.zeros((), dtype=torch.float64, device=backend.device)
        for mb in range(gas):
            batch = {k: v.to(backend.device) for k, v in data.batch(idx[mb]).items()}
            doc_ids = [data.docs[i].id for i in idx[mb].tolist()]
            # stored ids: "<doc id>@<step>[+<repeat>]#<content hash>", one per trained slot
            tags = [SampleId.user_id(d, step, r) for d, r in zip(doc_ids, repeats[mb].tolist())]
            # ---- online selection: candidates -> the chosen micro-batch -----------------
            reused = None
            if selector is not None:
                sel = selector.select(batch, micro, step, user_ids=doc_ids,
                                      train_loss=backend.reuses_selection_forward)
                batch, reused = sel.batch, sel.loss
                tags = [tags[i] for i in sel.indices.tolist()]
            # ---- end of online selection -----------------------------------------------
            if capture is not None:
                capture.tag(tags)
            loss = backend.forward_backward(batch) if reused is None else \
                backend.backward_reused(reused)
            step_loss += loss.double() / gas
        backend.optimizer_step()
        all_reduce_sum(step_loss, ctx.dp_group, ctx.dp_world)
        log.end_step(step, float(step_loss) / ctx.dp_world, lr, micro * gas * ctx.dp_world, save)
    if capture is not None:
        capture.close()
    summary = log.summary(world=dist.get_world_size(), captured=bool(capture))
    if capture is not None:  # examples dropped for a NaN/inf gradient, over the DP ranks
        dropped = torch.tensor([float(capture.skipped_examples)], device=backend.device)
        all_reduce_sum(dropped, ctx.dp_group, ctx.dp_world)
        summary["capture_dropped_examples"] = int(dropped.item())
    if selector is not None:
        summary["selection"] = selector.summary()
        selector.close()
    dist.barrier()
    if capture is not None:
        seal_captured_store(cfg.store_config(out).path, rank)
    return {**summary, **backend.summary()}


def seal_captured_store(path: str, rank: int) -> None:
    """After every rank closed its shard (a barrier), rank 0 records the store complete."""
    from dattri_ds.store import seal_store

    if rank == 0 and (Path(path) / "info.json").exists():
        seal_store(path)
