"""Progress of long jobs: one line per phase with its wall and CPU time, counts and ETA inside.

``phase(name)`` times a phase of a job (the main job's training, collect, fit, attribute,
report) and logs one line when it starts and one when it ends, with wall seconds and CPU
seconds of this process and of the child processes it waited for::

    with phase("collect", "3 checkpoints x 700 examples"):
        ...
    # [phase] collect: 3 checkpoints x 700 examples
    # [phase] collect: done in 41.2 s wall, 39.8 CPU-s (this process 39.8, children 0.0)

``bar(total, desc)`` counts work inside a phase: a tqdm bar on a terminal, else a log line
at most every ``every_s`` seconds (and at the end) with the count, the rate and the ETA, so
a job whose output goes to a file still shows it is moving. ``PHASES`` keeps every finished
phase's timing for the job's summary.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["phase", "bar", "PhaseTime", "PHASES", "cpu_seconds"]

logger = logging.getLogger("dattri_ds.tools.progress")


def cpu_seconds() -> tuple[float, float]:
    """``(this process, waited-for children)`` CPU seconds (user + system) so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@dataclass(frozen=True)
class PhaseTime:
    """One finished phase."""

    name: str
    wall_s: float
    cpu_s: float
    """CPU seconds of this process in the phase."""
    child_cpu_s: float
    """CPU seconds of the child processes the phase waited for (e.g. training ranks)."""

    def line(self) -> str:
        return (f"{self.name}: done in {self.wall_s:.1f} s wall, "
                f"{self.cpu_s + self.child_cpu_s:.1f} CPU-s (this process {self.cpu_s:.1f}, "
                f"children {self.child_cpu_s:.1f})")


#: Every phase finished in this process, in order.
PHASES: list[PhaseTime] = []


def _emit(text: str) -> None:
    """A progress line: logged when logging is configured, else printed to stderr."""
    if logging.getLogger().handlers or logger.handlers:
        logger.info("[phase] %s", text)
    else:
        print(f"[phase] {text}", file=sys.stderr, flush=True)


@contextmanager
def phase(name: str, detail: str = "") -> Iterator[None]:
    """Time the ``with`` block as phase ``name``; one line at its start and one at its end
    (appended to ``PHASES``)."""
    _emit(f"{name}: {detail}" if detail else f"{name}: start")
    t0, (c0, k0) = time.perf_counter(), cpu_seconds()
    yield
    c1, k1 = cpu_seconds()
    done = PhaseTime(name, time.perf_counter() - t0, c1 - c0, k1 - k0)
    PHASES.append(done)
    _emit(done.line())


class _LineBar:
    """tqdm's ``update``/``close`` as log lines: count, rate and ETA every ``every_s``."""

    def __init__(self, total: int, desc: str, every_s: float) -> None:
        self.total, self.desc, self.every_s = total, desc, every_s
        self.n, self.t0 = 0, time.perf_counter()
        self._last = self.t0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._last >= self.every_s and self.n < self.total:
            self._last = now
            _emit(self._text(now))

    def set_postfix(self, **_: object) -> None:
        """Accepted for tqdm compatibility (nothing shown)."""

    def _text(self, now: float) -> str:
        el = now - self.t0
        rate = self.n / el if el > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else float("inf")
        pct = 100 * self.n / self.total if self.total else 100.0
        return (f"{self.desc}: {self.n}/{self.total} ({pct:.0f}%), {el:.0f} s elapsed, "
                f"{rate:.1f}/s, ETA {eta:.0f} s")

    def close(self) -> None:
        _emit(self._text(time.perf_counter()))


def bar(total: int, desc: str | None, every_s: float = 10.0):
    """A progress counter with ``update(n)`` and ``close()``: tqdm on a terminal, else
    ``_LineBar`` log lines; None when ``desc`` is None (no progress wanted)."""
    if desc is None:
        return None
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, dynamic_ncols=True)
    return _LineBar(total, desc, every_s)
