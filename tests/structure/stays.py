"""Stay counter: how many times one call moves between the files of a package.

    python tests/structure/stays.py SCENARIO.py --during NAME [--root dattri_ds] [--show]

While the first call of the function ``NAME`` (defined under ``--root``) is running, every
Python ``call`` and ``return`` event (``sys.setprofile``) in a file under the root is
recorded by file. A *stay* is a maximal run of consecutive recorded events in one file; a
*return* is a stay in a file already visited in the window. Few stays means a reader can
follow the call: each file entered about once per layer and pass, returning only to its
caller. Same definition as the shared ``hops.py`` tool, written for the repository's tests.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from dataclasses import dataclass, field


@dataclass
class Trace:
    """The stays of one window: ``(file relative to the root's parent, first function)``."""

    stays: list[tuple[str, str]] = field(default_factory=list)

    @property
    def files(self) -> int:
        return len({f for f, _ in self.stays})

    @property
    def returns(self) -> int:
        return len(self.stays) - self.files

    def summary(self, name: str) -> str:
        return (f"{name}: {len(self.stays)} stays in {self.files} files, "
                f"{self.returns} returns to a file already visited")


class _Recorder:
    """A ``sys.setprofile`` hook that opens a window at the first call of ``during``."""

    def __init__(self, root: str, during: str) -> None:
        self.root = os.path.abspath(root) + os.sep
        self.base = os.path.dirname(self.root.rstrip(os.sep))
        self.during = during
        self.depth = 0
        self.closed = False
        self.trace = Trace()

    def _ours(self, filename: str) -> bool:
        return filename.startswith(self.root)

    def __call__(self, frame, event, arg) -> None:
        if self.closed or event not in ("call", "return"):
            return
        code = frame.f_code
        target = code.co_name == self.during and self._ours(code.co_filename)
        if self.depth == 0 and not (target and event == "call"):
            return
        if target:
            self.depth += 1 if event == "call" else -1
        if self._ours(code.co_filename):
            rel = os.path.relpath(code.co_filename, self.base)
            stays = self.trace.stays
            if not stays or stays[-1][0] != rel:
                stays.append((rel, code.co_name))
        if self.depth == 0:
            self.closed = True


def count(script: str, during: str, root: str = "dattri_ds") -> Trace:
    """Run ``script`` and return the stays of the first call of ``during`` under ``root``.

    Raises:
        RuntimeError: the function was never called by the script.
    """
    rec = _Recorder(root, during)
    argv = sys.argv
    sys.argv = [script]
    sys.setprofile(rec)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.setprofile(None)
        sys.argv = argv
    if not rec.trace.stays:
        raise RuntimeError(f"{during!r} under {root} was never called by {script}")
    return rec.trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("script")
    p.add_argument("--during", required=True)
    p.add_argument("--root", default="dattri_ds")
    p.add_argument("--show", action="store_true")
    a = p.parse_args()
    trace = count(a.script, a.during, a.root)
    if a.show:
        for f, fn in trace.stays:
            print(f"  {f}:{fn}")
    print(trace.summary(a.during))


if __name__ == "__main__":
    main()
