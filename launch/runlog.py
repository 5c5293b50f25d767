"""RunLog: the bookkeeping every training backend shares, so the loops only train.

Per step: the learning rate and loss (``trajectory.json``'s ``lrs``), the log line, held-out
evaluation points, checkpoints (the backend saves; the log records tag, step and lr for
TracIn and rewrites ``trajectory.json``), the progress bar; at the end, the summary.

A step's loss may stay on the device (a 0-d tensor): it is read, with every step's loss not
yet read, in one copy when the step's results are needed anyway (its log line every
``train.log_every`` steps, an evaluation, a checkpoint, the last step, the progress bar), so
a GPU step waits on the host only there (docs/kernels.md). A float is recorded at once.

Non-finite losses: each is warned about; ``train.max_nonfinite_steps`` consecutive ones fail
the run with NonFiniteTrainingError, after ``summary.json`` records ``status: failed``, the
step reached (``steps``: the step at which the losses were read, which with device losses
is the first step after the divergence that logs, evaluates or checkpoints; never a
checkpoint of a diverged run is written), the cause (``diverged``, at ``diverged_at_step``)
and why (every rank sees the same all-reduced loss, so all ranks stop at the same step).
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dattri_ds.errors import DattriDSError
from dattri_ds.launch.config import TrainConfig, dump_json

__all__ = ["RunLog", "RunRecord", "NonFiniteTrainingError", "make_run_id", "record_failure"]

logger = logging.getLogger("dattri_ds.launch")


class NonFiniteTrainingError(DattriDSError, RuntimeError):
    """Training produced ``train.max_nonfinite_steps`` consecutive NaN/inf losses."""


def make_run_id(fingerprint: str, out: Path) -> str:
    """The id of a run: its model/data fingerprint and its output directory (equal on every
    rank without communication). Stores record it; tools refuse stores of other runs."""
    h = hashlib.blake2b(f"{fingerprint}|{Path(out).resolve()}".encode(), digest_size=8)
    return f"run:{h.hexdigest()}"


@dataclass(kw_only=True)
class RunRecord:
    """What a run has recorded so far: saved with every checkpoint, restored on resume."""

    lrs: list[dict] = field(default_factory=list)
    """Per optimizer step: ``{"step", "lr", "loss"}`` (``trajectory.json``'s ``lrs``)."""

    checkpoints: list[dict] = field(default_factory=list)
    """Per checkpoint: ``{"tag", "step", "lr"}``."""

    evals: list[dict] = field(default_factory=list)
    """Held-out evaluation points: ``{"step", "examples", "target_loss", ...}``."""

    seen: int = 0
    """Training examples consumed (over all data-parallel ranks)."""

    loss: float = float("nan")
    """The last step's loss."""

    nonfinite: int = 0
    """Consecutive non-finite steps up to now."""

    nonfinite_total: int = 0
    """Non-finite steps in all."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunRecord:
        return cls(**d)


class RunLog:
    """Bookkeeping of one training run (rank 0 writes files and draws the bar).

    A fresh run evaluates at step 0; a resumed one (``record`` given) continues the record
    of its checkpoint instead.
    """

    def __init__(self, tc: TrainConfig, out: Path, rank: int,
                 evaluator: Callable[[], float] | None = None,
                 run_id: str | None = None, record: RunRecord | None = None) -> None:
        self.tc, self.out, self.rank, self.evaluator = tc, out, rank, evaluator
        self.run_id = run_id
        self.record = record if record is not None else RunRecord()
        if record is None and evaluator is not None:
            self.record.evals.append({"step": 0, "examples": 0, **_losses(evaluator())})
        self._pending: list[tuple[int, torch.Tensor | float, float, int]] = []
        self.bar = _progress(tc.steps, rank)
        if self.bar is not None and self.record.lrs:
            self.bar.update(len(self.record.lrs))
        self.t0 = time.perf_counter()
        self._seen0 = self.record.seen
        _ACTIVE[:] = [weakref.ref(self)]

    def end_step(self, step: int, loss: torch.Tensor | float, lr: float, examples: int,
                 save: Callable[[str, int, float], None]) -> None:
        """Record optimizer step ``step`` (0-based); ``save(tag, step + 1, lr)`` checkpoints.
        ``loss``: a float, or a 0-d tensor read when the step's results are needed (module
        docstring).

        Raises:
            NonFiniteTrainingError: a step read here is the ``train.max_nonfinite_steps``-th
                consecutive one with a NaN/inf loss (``summary.json`` is written first).
        """
        tc, n, rec = self.tc, step + 1, self.record
        self._pending.append((step, loss, lr, examples))
        due = (n % tc.log_every == 0 or n == tc.steps or self.bar is not None
               or (self.evaluator is not None and n % tc.eval_every == 0)
               or (tc.save_every and n % tc.save_every == 0))
        if not due and not isinstance(loss, float):
            return
        self._read_losses(n)
        loss = rec.loss
        if n % tc.log_every == 0 or n == tc.steps:
            logger.info("step %d/%d loss %.4f lr %.2e %.1f ex/s", n, tc.steps, loss, lr,
                        (rec.seen - self._seen0) / (time.perf_counter() - self.t0))
        if self.evaluator is not None and (n % tc.eval_every == 0 or n == tc.steps):
            rec.evals.append({"step": n, "examples": rec.seen, **_losses(self.evaluator())})
            logger.info("step %d %s", n, " ".join(
                f"{k.replace('_', ' ')} {v:.4f}" for k, v in rec.evals[-1].items()
                if k.endswith("_loss")))
        if (tc.save_every and n % tc.save_every == 0) or n == tc.steps:
            tag = f"step{n}"
            rec.checkpoints.append({"tag": tag, "step": n, "lr": lr})
            try:
                save(tag, n, lr)  # the record saved with it includes this checkpoint
            except BaseException:  # not written: listed nowhere (summary.json included)
                rec.checkpoints.pop()
                raise
            if self.rank == 0:
                dump_json(self.out / "trajectory.json",
                          {"checkpoints": rec.checkpoints, "lrs": rec.lrs})
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}")

    def _read_losses(self, reached: int) -> None:
        """Record the pending steps, their device losses read in one copy; ``reached``: the
        step the run is at (a divergence found here stops it there)."""
        pending, self._pending = self._pending, []
        held = [x for _, x, _, _ in pending if not isinstance(x, float)]
        read = iter(torch.stack([x.detach().reshape(()).double() for x in held]).tolist()
                    if held else [])
        rec = self.record
        for step, x, lr, examples in pending:
            loss = x if isinstance(x, float) else next(read)
            self._check_finite(step + 1, loss, reached)
            rec.loss = loss
            rec.lrs.append({"step": step, "lr": lr, "loss": loss})
            rec.seen += examples

    def _check_finite(self, n: int, loss: float, reached: int) -> None:
        rec = self.record
        if math.isfinite(loss):
            rec.nonfinite = 0
            return
        rec.nonfinite += 1
        rec.nonfinite_total += 1
        limit = self.tc.max_nonfinite_steps
        logger.warning("step %d: the loss is %s (%d consecutive non-finite step(s)%s)", n, loss,
                       rec.nonfinite, f", the run fails at {limit}" if limit else "")
        if not limit or rec.nonfinite < limit:
            return
        reason = (f"{rec.nonfinite} consecutive optimizer steps ({n - rec.nonfinite + 1}.."
                  f"{n}) had a non-finite loss (last: {loss}): training diverged. Lower the "
                  f"learning rate, enable gradient clipping or loss scaling, or pass "
                  f"--max-nonfinite-steps (now {limit}; 0 = never fail)")
        if self.rank == 0:
            dump_json(self.out / "summary.json",
                      {**self.summary(steps=reached), "status": "failed", "cause": "diverged",
                       "diverged_at_step": n - rec.nonfinite + 1, "error": reason})
        raise NonFiniteTrainingError(reason)

    def summary(self, steps: int | None = None, **extra) -> dict:
        """Close the bar; the run summary (``extra`` adds backend-specific fields).

        ``steps`` is the optimizer steps the run reached (default: the steps recorded), next
        to ``steps_requested`` (``train.steps``): a run that stopped early says where.
        """
        if self.bar is not None:
            self.bar.close()
        rec = self.record
        reached = len(rec.lrs) if steps is None else steps
        return {"status": "ok", "cause": None, "run_id": self.run_id, "steps": reached,
                "steps_requested": self.tc.steps,
                "examples": rec.seen, "final_loss": rec.loss,
                "nonfinite_steps": rec.nonfinite_total,
                "seconds": round(time.perf_counter() - self.t0, 2),
                "checkpoints": [c["tag"] for c in rec.checkpoints], "eval": rec.evals,
                **extra}


#: The RunLog of the run this process trains (for ``record_failure``).
_ACTIVE: list[weakref.ref[RunLog]] = []


def record_failure(err: BaseException) -> None:
    """Rank 0 of a run that raised: ``summary.json`` says ``status: failed``, the step the
    run reached (``steps``; its checkpoints are listed), the cause (``write_failed`` for a
    failed write, ``interrupted``, else ``error``), the error's text and type. A
    diverged run has written its summary already; before the first step nothing is written.
    """
    log = _ACTIVE[0]() if _ACTIVE else None
    if log is None or log.rank != 0 or isinstance(err, NonFiniteTrainingError):
        return
    cause = ("interrupted" if isinstance(err, KeyboardInterrupt) else
             "write_failed" if isinstance(err, OSError) else "error")
    try:
        dump_json(log.out / "summary.json", {
            **log.summary(), "status": "failed", "cause": cause,
            "error": " ".join(str(err).split()) or type(err).__name__,
            "error_type": type(err).__name__})
    except OSError:  # the disk that failed the run may refuse the summary too
        logger.warning("could not write %s", log.out / "summary.json")


def _losses(got: float | dict[str, float]) -> dict[str, float]:
    """An evaluator's result as ``{"target_loss": ...}`` (a float is the target loss)."""
    return dict(got) if isinstance(got, dict) else {"target_loss": got}


def _progress(total: int, rank: int):
    if rank != 0 or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc="train", dynamic_ncols=True)
