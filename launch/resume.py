"""Checkpoints as a resume sees them: the loop's state, which checkpoint, and resuming from it.

Resume (``train.resume``): the backend restores weights, optimizer and lr schedule; the loop
restores the step, every rank's RNG state and the ``RunRecord`` (``LoopState``), and with
online selection the selector's state and log (selection/state.py), so the resumed run
trains and chooses what the uninterrupted one would have; on another data-parallel world
size (an *elastic* resume) the backend reshards its state (``Backend.load_resharded``), the
data stream continues where the checkpoint stopped (``LoopState.origin``), the stored rows
of the steps after the checkpoint are dropped and the selection logs of the ranks that no
longer run are trimmed. A checkpoint is complete once ``trajectory.json`` lists it
(``Checkpoints``). What is saved, what equals what, and the tests: docs/training.md,
docs/multinode.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from dattri_ds.errors import ConfigError
from dattri_ds.io.files import check_checkpoint, load_torch, read_json
from dattri_ds.launch.backend import Backend
from dattri_ds.launch.config import RunConfig, TrainConfig
from dattri_ds.launch.data import SOURCE_FLAGS, data_source
from dattri_ds.launch.engine import data_parallel_world
from dattri_ds.launch.runlog import RunRecord, make_run_id
from dattri_ds.io.outputs import write_atomic
from dattri_ds.selection.online import log_file, writes_log
from dattri_ds.selection.state import SelectionCheckpoint, config_difference, log_lines_before
from dattri_ds.store.shard import rollback_to_step

__all__ = ["LoopState", "Checkpoints", "resume_tag", "check_resume", "resume",
           "check_shared_out", "selection_config", "run_record", "zero_stage", "check_same_data"]

logger = logging.getLogger("dattri_ds.launch")

#: The fix for a checkpoint whose files are cut or damaged.
_EARLIER = "resume from an earlier checkpoint (--resume <tag>), or start over (--force)"


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

    selection_copied: bool = False
    """Elastic resume onto more ranks: this rank continues another rank's selector state
    (its run statistics start at zero, so that none is counted twice)."""

    run: dict[str, Any] = field(default_factory=dict)
    """What trained (``run_record``: backend, ZeRO stage, model, data); empty in checkpoints
    of a dattri-ds that did not record it."""

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
                    "per_step": self.per_step, "run": self.run},
                   folder / self.FILE.format(rank=rank))

    @classmethod
    def load(cls, folder: Path, rank: int) -> LoopState:
        """Raises: ConfigError: no state of this rank (written by fewer ranks, or by an older
        dattri-ds)."""
        path = folder / cls.FILE.format(rank=rank)
        if not path.exists():
            raise ConfigError(f"{folder} has no loop state of rank {rank} ({path.name}): it was "
                              f"written by fewer processes or by a dattri-ds without resume; "
                              f"resume with the number of processes that wrote it")
        d = load_torch(path, "loop state", fix=_EARLIER)
        return cls(step=int(d["step"]), record=RunRecord.from_dict(d["record"]), rng=d["rng"],
                   layout=dict(d["layout"]), origin=tuple(d.get("origin", (0, 0))),
                   per_step=int(d.get("per_step", 0)), run=dict(d.get("run", {})))

    def restore(self, selector=None) -> None:
        """Continue from this state right before the first step: the selector's state and
        log (when the checkpoint holds one and ``selector`` runs), then this rank's RNG."""
        if self.selection is not None and selector is not None:
            state = self.selection.state
            if self.selection_copied:  # another rank's state: its statistics count there
                state = {**state, "log": selector.state_dict()["log"]}
            selector.load_state_dict(state, self.selection.log)
        self.restore_rng()

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


def check_resume(cfg: RunConfig, out: Path | str, ds_config: dict | None = None) -> None:
    """Refuse, before any process starts, what a resume cannot reproduce: no complete
    checkpoint to continue from (``resume_tag``), a file of it cut or damaged (named), one
    written by another backend, on another process layout (but by DeepSpeed, which reshards
    it), under a ZeRO stage DeepSpeed's universal checkpoint cannot convert from, for
    another model (``run_record``) or for other data (the flags naming it:
    ``check_same_data``; ``resume`` compares the fingerprints once the data is open); and,
    with online selection, a selection config other than the checkpoint's (its selector
    state would not fit or would choose differently).

    Raises:
        ConfigError: naming the checkpoint, the difference (both values) and the flag.
    """
    if not cfg.train.resume:
        return
    out = Path(out)
    tag = resume_tag(out, cfg.train.resume)
    if tag is None:
        return
    folder = check_checkpoint(out / "checkpoints" / tag, f"--resume {tag} checkpoint", _EARLIER)
    _check_same_run(out, tag, LoopState.load(folder, 0), cfg, ds_config or {})
    saved = SelectionCheckpoint.config_of(folder) if cfg.selection.enabled else None
    if saved is None:
        return  # written without selection: ``resume`` starts a fresh selector (warned)
    diff = config_difference(saved, selection_config(cfg))
    if diff is not None:
        key, was, now = diff
        raise ConfigError(f"--resume {tag}: the checkpoint was written with {key}={was!r}, "
                          f"this run has {key}={now!r}; a selector's state continues only "
                          f"under the settings that wrote it: set {key} back to {was!r}, or "
                          f"start a fresh run (drop --resume)")


def zero_stage(ds_config: dict) -> int:
    """The ZeRO stage of a DeepSpeed JSON (DeepSpeed's default 0 when it names none)."""
    zero = ds_config.get("zero_optimization")
    return zero.get("stage", 0) if isinstance(zero, dict) else 0


def run_record(cfg: RunConfig, stage: int | None, data: dict | None = None) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it, for ``check_resume``: the
    backend, the ZeRO stage (DeepSpeed; None otherwise), the model (the content of its config
    file and the ``--init-from`` run) and the data: what the flags named (``data_source``)
    and the identity of the examples (``data``: ``data_record``; None for examples a caller
    tokenized itself)."""
    tc = cfg.train
    src = Path(tc.model_path) / "config.json" if tc.model_path else Path(tc.model_config)
    try:
        config = read_json(src, "model config")
    except ConfigError:  # the model's own error follows when it is built
        config = None
    return {"backend": cfg.engine.backend, "zero_stage": stage,
            "model": {"config": config,
                      "init_from": str(Path(tc.init_from).resolve()) if tc.init_from else None},
            "data": None if data is None else {"source": data_source(tc), "record": data}}


def check_same_data(flag: str, was: dict | None, tc: TrainConfig,
                    record: dict | None = None) -> None:
    """Refuse to continue a checkpoint on other data: the flags that name it (``record``
    None: at start) or, once the data is open, its fingerprints (``record``).

    Raises:
        ConfigError: naming each difference (both sides) and the flags that fix it.
    """
    if not was or (record is None and "source" not in was):
        return
    if record is None:
        now, old, keys = data_source(tc), was["source"], SOURCE_FLAGS
    else:
        now, old = record, was.get("record") or {}
        keys = {"fingerprint": "--train-data / --data-path (the data changed)",
                "tokenizer": SOURCE_FLAGS["tokenizer"]}
    diffs = [(k, old.get(k), now.get(k)) for k in keys if old.get(k) != now.get(k)]
    if diffs:
        shown = "; ".join(f"{k}={a!r} there, {b!r} here" for k, a, b in diffs)
        flags = ", ".join(dict.fromkeys(keys[k] for k, _, _ in diffs))
        raise ConfigError(f"{flag}: the checkpoint was trained on other data: {shown}. Fix: "
                          f"pass the {flags} that run used, or start over (drop --resume, pass "
                          f"--force)")


def _written_by(folder: Path) -> str | None:
    """The backend whose files a checkpoint folder holds (older checkpoints record none)."""
    if (folder / "training_state.pt").exists():
        return "torch"
    if (folder / "megatron_consolidated.pt").exists():
        return "megatron"
    return "deepspeed" if any(folder.glob("*model_states.pt")) else None


def _check_same_run(out: Path, tag: str, saved: LoopState, cfg: RunConfig, ds: dict) -> None:
    """``check_resume``'s comparison of the checkpoint's ``run_record`` and layout with this
    run's (before any process group: the layout from ``WORLD_SIZE``)."""
    backend = cfg.engine.backend
    now = run_record(cfg, zero_stage(ds) if backend == "deepspeed" else None)
    was = {"backend": _written_by(out / "checkpoints" / tag), **saved.run}
    flag, fresh = f"--resume {tag}", (f"start a new run from its weights (--init-from {out} "
                                      f"--init-checkpoint {tag} --out NEW_DIR)")
    if was["backend"] not in (None, backend):
        other = "megatron" not in (was["backend"], backend)
        raise ConfigError(f"{flag}: the checkpoint was written by --backend {was['backend']}, "
                          f"this run has --backend {backend}; a checkpoint resumes only on the "
                          f"backend that wrote it. Fix: pass --backend {was['backend']}"
                          + (f", or {fresh}" if other else ""))
    layout = {"dp": data_parallel_world(cfg.engine),
              "tp": cfg.engine.tensor_model_parallel_size}
    moved = saved.layout != layout
    if moved and backend != "deepspeed":
        raise ConfigError(f"{flag}: the checkpoint was written with the process layout "
                          f"{saved.layout}, this run has {layout}, and --backend {backend} "
                          f"resumes only on the layout that wrote it. Fix: resume with the "
                          f"same number of processes and parallel sizes (elastic resume onto "
                          f"another world size runs on --backend deepspeed)")
    s0, s1 = was.get("zero_stage"), now["zero_stage"]
    if s0 is not None and s0 != s1 and not {s0, s1} <= {1, 2}:
        raise ConfigError(f"{flag}: the checkpoint was written with ZeRO stage {s0}, this run "
                          f"has stage {s1} (zero_optimization.stage); DeepSpeed's universal "
                          f"checkpoint converts stages 1 and 2 into each other only. Fix: set "
                          f"zero_optimization.stage to {s0}, or {fresh}")
    if moved and backend == "deepspeed" and (s1 if s0 is None else s0) == 0:
        raise ConfigError(f"{flag}: the checkpoint was written with the process layout "
                          f"{saved.layout} under ZeRO stage 0, this run has {layout}; "
                          f"DeepSpeed's universal checkpoint reshards ZeRO 1-3 checkpoints "
                          f"only. Fix: resume on the number of processes that wrote it, or "
                          f"{fresh}")
    diffs = _differences(was.get("model"), now["model"])
    if diffs:
        raise ConfigError(f"{flag}: the checkpoint was written for another model: "
                          f"{'; '.join(diffs[:4])}"
                          f"{f' (and {len(diffs) - 4} more)' if len(diffs) > 4 else ''}. "
                          f"Fix: pass the --model-config that run "
                          f"used, or start over (drop --resume, pass --force)")
    check_same_data(flag, was.get("data"), cfg.train)


#: Model keys that say what kind of model it is: shown before any other difference.
_FIRST = ("model_type", "architectures", "kind")


def _differences(was: dict | None, now: dict) -> list[str]:
    """``key=<there> there, <here> here`` for each model key that differs (none when the
    checkpoint recorded no model); the model's kind (``_FIRST``) first, then by name."""
    if not was:
        return []
    flat = [({**(w.get("config") or {}), **{k: v for k, v in w.items() if k != "config"}})
            for w in (was, now)]
    keys = sorted(set(flat[0]) | set(flat[1]),
                  key=lambda k: (_FIRST.index(k) if k in _FIRST else len(_FIRST), k))
    return [f"{k}={flat[0].get(k)!r} there, {flat[1].get(k)!r} here" for k in keys
            if flat[0].get(k) != flat[1].get(k)]


def resume(backend: Backend, cfg: RunConfig, out: Path, rank: int,
           data: dict | None = None) -> LoopState | None:
    """With ``train.resume``: check the checkpoint fits this run (its data: ``data``, the
    ``data_record`` of this run's examples), load the backend's state
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
    check_same_data(f"--resume {tag}", state.run.get("data"), cfg.train, data)
    saved_dp = state.layout["dp"]
    elastic = state.layout != backend.layout()
    restaged = state.run.get("zero_stage", backend.zero_stage) != backend.zero_stage
    if (elastic or restaged) and rank == 0:
        logger.info("--resume %s: converting the checkpoint (process layout %s, ZeRO stage %s) "
                    "onto %s, stage %s", tag, state.layout, state.run.get("zero_stage"),
                    backend.layout(), backend.zero_stage)
    selection = None
    if cfg.selection.enabled and SelectionCheckpoint.config_of(folder) is not None:
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
    if elastic or restaged:
        backend.load_resharded(out / "checkpoints", tag, state.layout)
    else:
        backend.load(out / "checkpoints", tag)
    if elastic:
        _rollback_store(cfg, out, rank, state.step)
    logger.info("resuming from %s at step %d", tag, state.step)
    return replace(state, selection=selection)


def check_shared_out(out: Path, rank: int) -> None:
    """Every rank sees the ``--out`` that rank 0 wrote to (several nodes need it on a shared
    file system): rank 0 writes a token there, every rank reads it back (collective; a no-op
    in one process).

    Raises:
        ConfigError: on every rank, naming the ranks and hosts that do not see it.
    """
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
    if not cfg.capture_enabled:
        return
    if rank == 0:
        dropped = rollback_to_step(cfg.store_config(out).path, step)
        if dropped:
            logger.info("--resume: dropped %d stored rows of steps >= %d (written after the "
                        "checkpoint by the stopped run)", sum(dropped.values()), step)
    if dist.is_initialized():
        dist.barrier()


def _trim_dropped_logs(log: Path | None, world: int, saved: int, step: int) -> None:
    """Elastic resume onto fewer ranks: the selection logs of the ranks that no longer run
    keep only their records of the steps before the checkpoint."""
    for r in range(world, saved):
        path = log_file(log, r) if log is not None else None
        if path is not None and path.exists():
            write_atomic(path, "".join(log_lines_before(path, step)))


def selection_config(cfg: RunConfig) -> dict:
    """The resolved selection config as JSON data (what a checkpoint records)."""
    return json.loads(json.dumps(asdict(cfg.selection)))

