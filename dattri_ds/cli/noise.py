"""What a command prints: our own lines, third-party chatter only on request, each error once.

``setup_logging(rank, verbose)`` logs ours at INFO on rank 0 and keeps DeepSpeed,
Megatron-core and transformers to errors unless ``verbose``; ``first_report(text)`` lets the
ranks of one launch print an error line once per host (docs/training.md). Only the standard
library is imported here; the libraries are configured if installed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path

__all__ = ["setup_logging", "quiet_third_party", "first_report", "warn_once_per_launch",
           "THIRD_PARTY"]

#: Libraries whose logging and Python warnings are hidden unless ``--verbose``.
THIRD_PARTY = ("deepspeed", "megatron", "transformers", "apex", "transformer_engine")
#: An error marker older than this belongs to an earlier launch (seconds).
_MARKER_TTL = 600.0


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_third_party() -> None:
    """Hide the libraries' INFO/WARNING logging and their Python warnings (errors stay)."""
    pattern = r"(" + "|".join(THIRD_PARTY) + r")(\.|$)"
    for category in (UserWarning, FutureWarning, DeprecationWarning, RuntimeWarning):
        warnings.filterwarnings("ignore", category=category, module=pattern)
    for name in (*THIRD_PARTY, "DeepSpeed"):  # DeepSpeed's own logger is "DeepSpeed"
        log = logging.getLogger(name)
        log.setLevel(logging.ERROR)
        if _errors_only not in log.filters:  # kept when a library resets its level on import
            log.addFilter(_errors_only)
    try:  # transformers resets its root logger's level when it first configures it
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is an optional extra
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" bars of every from_pretrained


def setup_logging(rank: int, verbose: bool = False) -> None:
    """Log lines as ``HH:MM:SS message``: ours at INFO on rank 0 (WARNING elsewhere), the
    libraries' only at ERROR unless ``verbose`` (then everything at INFO on rank 0)."""
    ours = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=ours if verbose else logging.WARNING,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("dattri_ds").setLevel(ours)
    if not verbose:
        quiet_third_party()


def warn_once_per_launch() -> None:
    """Show each Python warning text once per launch on a host (``first_report``): ranks
    that read the same config warn alike at start (an unknown DeepSpeed key, a setting
    without effect), and one copy per rank only repeats it. Idempotent."""
    original = warnings.showwarning
    if getattr(original, "_dattri_ds_once", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if first_report(f"warning|{category.__name__}|{message}"):
            original(message, category, filename, lineno, file, line)

    show._dattri_ds_once = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def _launch_id() -> str | None:
    """What the ranks of one launch share on a host (None: a single process)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    return "|".join([str(os.getppid()), os.environ.get("MASTER_ADDR", ""),
                     os.environ.get("MASTER_PORT", ""),
                     os.environ.get("TORCHELASTIC_RUN_ID", "")])


def first_report(text: str) -> bool:
    """True when this process should print the error line ``text``: always for a single
    process; among the ranks of one launch on this host, only for the first to report that
    line (an exclusive marker file in the temp folder, expired after 10 minutes)."""
    launch = _launch_id()
    if launch is None:
        return True
    folder = Path(tempfile.gettempdir()) / f"dattri-ds-errors-{os.getuid()}"
    key = hashlib.blake2b(f"{launch}|{text}".encode(), digest_size=12).hexdigest()
    marker = folder / key
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if marker.exists() and time.time() - marker.stat().st_mtime > _MARKER_TTL:
            marker.unlink(missing_ok=True)  # an earlier launch with the same parent pid
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    except OSError:  # no writable temp folder: print rather than lose the line
        return True
    os.close(fd)
    _prune(folder)
    return True


def _prune(folder: Path) -> None:
    """Remove the markers of earlier launches (older than the TTL)."""
    now = time.time()
    for old in folder.iterdir():
        try:
            if now - old.stat().st_mtime > _MARKER_TTL:
                old.unlink()
        except OSError:  # another rank removed it first
            pass
