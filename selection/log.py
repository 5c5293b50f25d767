"""The log stage: every selection's chosen ids and scores to ``selection.jsonl``, and the
run statistics of ``OnlineSelector.summary``.

DP rank 0 writes ``selection.jsonl``; with several DP ranks each writes its own
(``log_file``: ``selection.dp1.jsonl``) and ``read_selection_log`` merges them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from dattri_ds.distributed import ParallelContext, all_reduce_sum
from dattri_ds.selection.config import SelectionConfig
from dattri_ds.selection.step import StepState

__all__ = ["Log", "log_file", "writes_log", "read_selection_log"]

_KEYS = ("steps", "candidates", "chosen", "score_sum", "chosen_score_sum")


def log_file(log_path: str | Path, dp_rank: int) -> Path:
    """The selection log of a data-parallel rank: ``log_path`` itself for rank 0, else
    ``<stem>.dp<rank><suffix>`` next to it (``selection.dp1.jsonl``)."""
    p = Path(log_path)
    return p if dp_rank == 0 else p.with_name(f"{p.stem}.dp{dp_rank}{p.suffix}")


def writes_log(config: SelectionConfig, ctx: ParallelContext) -> bool:
    """Whether this rank writes a selection log (``log_scores`` on): every DP rank (each
    chooses from its own candidates)."""
    return config.log_scores


def _remove_stale_logs(log_path: str | Path, writers: int) -> None:
    """Delete ``<stem>.dp<r><suffix>`` for ``r >= writers`` (files no rank of this run owns)."""
    p = Path(log_path)
    for f in p.parent.glob(f"{p.stem}.dp*{p.suffix}"):
        rank = f.name[len(p.stem) + 3:len(f.name) - len(p.suffix)]
        if rank.isdigit() and int(rank) >= writers:
            f.unlink(missing_ok=True)


def read_selection_log(log_path: str | Path) -> list[dict]:
    """Every record of a run's selection log, all DP ranks' files merged, ordered by
    ``(step, dp_rank)`` (a rank's micro-batches keep their order). Missing log: ``[]``."""
    p = Path(log_path)
    files = [p] if p.exists() else []
    files += sorted(p.parent.glob(f"{p.stem}.dp*{p.suffix}"))
    records = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            records += [json.loads(line) for line in fh if line.strip()]
    return sorted(records, key=lambda r: (r["step"], r.get("dp_rank", 0)))


class Log:
    """The last stage: counts the selection into the run statistics and writes its record.

    Args:
        config: the selection settings (``log_scores``).
        ctx: data-parallel group.
        log_path: the run's ``selection.jsonl`` (None: no log), rewritten by every run
            (training restarts at step 0); rank 0 removes logs of ranks a previous, wider
            run left behind.
    """

    def __init__(self, config: SelectionConfig, ctx: ParallelContext,
                 log_path: str | Path | None) -> None:
        self.ctx = ctx
        if log_path is not None and ctx.dp_rank == 0:
            _remove_stale_logs(log_path, ctx.dp_world)
        self._file = open(log_file(log_path, ctx.dp_rank), "w", encoding="utf-8") if (
            log_path is not None and writes_log(config, ctx)) else None
        self.stats = {"steps": 0, "candidates": 0, "chosen": 0, "score_sum": 0.0,
                      "chosen_score_sum": 0.0}

    def __call__(self, state: StepState) -> StepState:
        sel, st = state.selection, self.stats
        st["steps"] += 1
        st["candidates"] += sel.scores.numel()
        st["chosen"] += sel.indices.numel()
        st["score_sum"] += float(sel.scores.sum())
        finite = sel.chosen_scores[torch.isfinite(sel.chosen_scores)]
        st["chosen_score_sum"] += float(finite.sum())
        if self._file is not None:
            record = {
                "step": state.step, "dp_rank": self.ctx.dp_rank, "chosen": list(sel.chosen_ids),
                "chosen_scores": [round(float(s), 6) if math.isfinite(s) else None
                                  for s in sel.chosen_scores.tolist()],
                "candidate_scores": [round(float(s), 6) for s in sel.scores]}
            if sel.probed is not None:
                record["probed"] = sel.probed.tolist()
            self._file.write(json.dumps(record) + "\n")
        return state

    def totals(self, device: torch.device | str) -> dict:
        """The run statistics summed over the data-parallel ranks (collective)."""
        local = torch.tensor([float(self.stats[k]) for k in _KEYS], dtype=torch.float64,
                             device=device)
        total = all_reduce_sum(local, self.ctx.dp_group, self.ctx.dp_world).tolist()
        return {k: (v if k.endswith("sum") else int(round(v))) for k, v in zip(_KEYS, total)}

    def flush(self) -> None:
        """Write the log through to disk (before a checkpoint records how far it got)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def resume(self, lines: list[str] | tuple[str, ...]) -> None:
        """Continue the log with ``lines`` (a checkpoint's records before the resumed step)."""
        if self._file is not None and lines:
            self._file.writelines(line if line.endswith("\n") else line + "\n"
                                  for line in lines)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def state_dict(self) -> dict:
        return {"stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        self.stats.clear()
        self.stats.update(state["stats"])
