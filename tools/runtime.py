"""The tools' process: ranks, log lines, third-party noise and the first line a tool prints."""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os

import torch
import torch.distributed as dist

from dattri_ds.cli.noise import setup_logging as _setup_noise

__all__ = ["logger", "setup_logging", "quiet_stdout", "init_distributed", "announce"]

logger = logging.getLogger("dattri_ds.tools")

#: ``--verbose``: third-party output (DeepSpeed's checkpoint consolidation banners,
#: transformers' warnings and progress bars, the per-layer projection table) is shown.
VERBOSE = False


def setup_logging(rank: int = 0, verbose: bool = False) -> None:
    """The tools' log lines (rank 0 at INFO, other ranks WARNING); third-party logging,
    warnings and progress bars kept to errors unless ``verbose`` (``dattri_ds.cli.noise``, as
    launch/train.py does)."""
    global VERBOSE
    VERBOSE = verbose
    _setup_noise(rank, verbose)


@contextlib.contextmanager
def quiet_stdout():
    """A context in which third-party prints and progress bars (DeepSpeed's ``zero_to_fp32``
    banners, its "Loading checkpoint shards" / "Gathering sharded weights" bars) are dropped
    unless ``--verbose`` (their logging is kept to errors by ``setup_logging``); an error
    raised inside still propagates."""
    if VERBOSE:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def init_distributed() -> tuple[int, int]:
    """(rank, world) under torchrun/deepspeed (gloo on CPU), (0, 1) for a plain process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            atexit.register(_shutdown_distributed)
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shutdown_distributed() -> None:
    """Destroy the group this process created (local, no collective: a rank that failed must
    not make its peers wait): a gloo group left to interpreter shutdown can abort a rank
    ("terminate called without an active exception") after its work is done, which launchers
    report as a failed run."""
    if dist.is_initialized():
        dist.destroy_process_group()


def announce(tool: str, **parts) -> None:
    """The first line a tool prints: what it reads and does (data, checkpoints, projection,
    method), ``key value`` pairs in order; None values are left out."""
    logger.info("%s: %s", tool, "; ".join(f"{k.replace('_', ' ')} {v}" for k, v in parts.items()
                                        if v is not None))
