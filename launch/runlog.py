"""RunLog: the bookkeeping every training backend shares, so the loops only train.

Per step: the learning rate and loss (``trajectory.json``'s ``lrs``), the log line, held-out
evaluation points, checkpoints (the backend saves; the log records tag, step and lr for
TracIn and rewrites ``trajectory.json``), the progress bar; at the end, the summary.

Non-finite losses: each is warned about; ``train.max_nonfinite_steps`` consecutive ones fail
the run with NonFiniteTrainingError, after ``summary.json`` records ``status: failed`` and
why (every rank sees the same all-reduced loss, so all ranks stop at the same step).
"""

from __future__ import annotations

import hashlib
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dattri_ds.errors import DattriDSError
from dattri_ds.launch.config import TrainConfig, dump_json

__all__ = ["RunLog", "NonFiniteTrainingError", "make_run_id"]

logger = logging.getLogger("dattri_ds.launch")


class NonFiniteTrainingError(DattriDSError, RuntimeError):
    """Training produced ``train.max_nonfinite_steps`` consecutive NaN/inf losses."""


def make_run_id(fingerprint: str, out: Path) -> str:
    """The id of a run: its model/data fingerprint and its output directory (equal on every
    rank without communication). Stores record it; tools refuse stores of other runs."""
    h = hashlib.blake2b(f"{fingerprint}|{Path(out).resolve()}".encode(), digest_size=8)
    return f"run:{h.hexdigest()}"


class RunLog:
    """Bookkeeping of one training run (rank 0 writes files and draws the bar)."""

    def __init__(self, tc: TrainConfig, out: Path, rank: int,
                 evaluator: Callable[[], float] | None = None,
                 run_id: str | None = None) -> None:
        self.tc, self.out, self.rank, self.evaluator = tc, out, rank, evaluator
        self.run_id = run_id
        self.nonfinite, self.nonfinite_total = 0, 0
        self.lrs: list[dict] = []
        self.checkpoints: list[dict] = []
        self.evals: list[dict] = []
        self.seen, self.loss = 0, float("nan")
        if evaluator is not None:
            self.evals.append({"step": 0, "examples": 0, **_losses(evaluator())})
        self.bar = _progress(tc.steps, rank)
        self.t0 = time.perf_counter()

    def end_step(self, step: int, loss: float, lr: float, examples: int,
                 save: Callable[[str, int, float], None]) -> None:
        """Record optimizer step ``step`` (0-based); ``save(tag, step + 1, lr)`` checkpoints.

        Raises:
            NonFiniteTrainingError: this is the ``train.max_nonfinite_steps``-th consecutive
                step with a NaN/inf loss (``summary.json`` is written first).
        """
        tc, n = self.tc, step + 1
        self._check_finite(n, loss)
        self.loss = loss
        self.lrs.append({"step": step, "lr": lr, "loss": loss})
        self.seen += examples
        if n % tc.log_every == 0 or n == tc.steps:
            logger.info("step %d/%d loss %.4f lr %.2e %.1f ex/s", n, tc.steps, loss, lr,
                        self.seen / (time.perf_counter() - self.t0))
        if self.evaluator is not None and (n % tc.eval_every == 0 or n == tc.steps):
            self.evals.append({"step": n, "examples": self.seen, **_losses(self.evaluator())})
            logger.info("step %d %s", n, " ".join(
                f"{k.replace('_', ' ')} {v:.4f}" for k, v in self.evals[-1].items()
                if k.endswith("_loss")))
        if (tc.save_every and n % tc.save_every == 0) or n == tc.steps:
            tag = f"step{n}"
            save(tag, n, lr)
            self.checkpoints.append({"tag": tag, "step": n, "lr": lr})
            if self.rank == 0:
                dump_json(self.out / "trajectory.json",
                          {"checkpoints": self.checkpoints, "lrs": self.lrs})
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}")

    def _check_finite(self, n: int, loss: float) -> None:
        if math.isfinite(loss):
            self.nonfinite = 0
            return
        self.nonfinite += 1
        self.nonfinite_total += 1
        limit = self.tc.max_nonfinite_steps
        logger.warning("step %d: the loss is %s (%d consecutive non-finite step(s)%s)", n, loss,
                       self.nonfinite, f", the run fails at {limit}" if limit else "")
        if not limit or self.nonfinite < limit:
            return
        reason = (f"{self.nonfinite} consecutive optimizer steps ({n - self.nonfinite + 1}.."
                  f"{n}) had a non-finite loss (last: {loss}): training diverged. Lower the "
                  f"learning rate, enable gradient clipping or loss scaling, or set "
                  f"train.max_nonfinite_steps (now {limit}; 0 = never fail)")
        if self.rank == 0:
            dump_json(self.out / "summary.json",
                      {**self.summary(), "status": "failed", "error": reason})
        raise NonFiniteTrainingError(reason)

    def summary(self, **extra) -> dict:
        """Close the bar; the run summary (``extra`` adds backend-specific fields)."""
        if self.bar is not None:
            self.bar.close()
        return {"status": "ok", "run_id": self.run_id, "steps": self.tc.steps,
                "examples": self.seen, "final_loss": self.loss,
                "nonfinite_steps": self.nonfinite_total,
                "seconds": round(time.perf_counter() - self.t0, 2),
                "checkpoints": [c["tag"] for c in self.checkpoints], "eval": self.evals,
                **extra}


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
