"""The selection log's files: one ``selection.jsonl`` per data-parallel rank (the ``Log``
stage, selection/stages.py, writes them).

DP rank 0 writes ``selection.jsonl``; with several DP ranks each writes its own
(``log_file``: ``selection.dp1.jsonl``) and ``read_selection_log`` merges them.
"""

from __future__ import annotations

import json
from pathlib import Path

from dattri_ds.distributed import ParallelContext
from dattri_ds.selection.config import SelectionConfig

__all__ = ["log_file", "writes_log", "remove_stale_logs", "read_selection_log"]

def log_file(log_path: str | Path, dp_rank: int) -> Path:
    """The selection log of a data-parallel rank: ``log_path`` itself for rank 0, else
    ``<stem>.dp<rank><suffix>`` next to it (``selection.dp1.jsonl``)."""
    p = Path(log_path)
    return p if dp_rank == 0 else p.with_name(f"{p.stem}.dp{dp_rank}{p.suffix}")


def writes_log(config: SelectionConfig, ctx: ParallelContext) -> bool:
    """Whether this rank writes a selection log (``log_scores`` on): every DP rank (each
    chooses from its own candidates)."""
    return config.log_scores


def remove_stale_logs(log_path: str | Path, writers: int) -> None:
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
