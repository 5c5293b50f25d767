"""One error path for every command line: ``dattri-ds: error: <message>`` and an exit code.

``launch/train.py``, ``python tools/<x>.py`` and ``dattri-ds <cmd>`` run their ``main``
through :func:`run`: a ConfigError (argparse's errors raised as UsageError) or a
StoreMismatchError exits 2, any other error 1, each as one stderr line without traceback
unless ``--debug`` / ``DATTRI_DS_DEBUG=1`` (docs/training.md, "Configuration, flags and
errors").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dattri_ds.errors import (CREATED_FOLDERS, ConfigError, DattriDSError, StoreMismatchError,
                              UsageError)

__all__ = ["run", "DEBUG_ENV", "EXIT_USAGE", "EXIT_RUNTIME"]

DEBUG_ENV = "DATTRI_DS_DEBUG"
EXIT_USAGE = 2
#: Errors a changed flag or config fixes: exit EXIT_USAGE.
USAGE_ERRORS = (ConfigError, StoreMismatchError)
EXIT_RUNTIME = 1
PROG = "dattri-ds"


@contextlib.contextmanager
def _argparse_raises() -> Iterator[None]:
    """Make ``ArgumentParser.error`` raise UsageError (instead of printing usage and exiting)
    while ``main`` runs, so argparse's errors take the same one-line path."""
    original = argparse.ArgumentParser.error

    def error(self: argparse.ArgumentParser, message: str) -> Any:
        raise UsageError(f"{message} (see {self.prog} --help)")

    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]


def message(err: BaseException) -> str:
    """The one-line text of an error (unexpected error types are named)."""
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, DattriDSError):
        return text
    return f"{type(err).__name__}: {text} (unexpected; rerun with --debug for the traceback)"


def _remove_created_if_empty() -> None:
    """Remove the output folders this command created that are still empty, deepest first
    (a folder another rank wrote into is kept)."""
    while CREATED_FOLDERS:
        with contextlib.suppress(OSError):
            Path(CREATED_FOLDERS.pop()).rmdir()


def run(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> int:
    """Call ``main(argv)``; return the process exit code (0, 1 runtime error, 2 usage,
    config or store-mismatch error) after printing a failure as one line. ``--debug`` is
    removed from ``argv``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    CREATED_FOLDERS.clear()  # the folders earlier commands of this process made are theirs
    try:
        with _argparse_raises():
            main(argv)
    except Exception as err:  # noqa: BLE001 - the one place errors become exit codes
        _remove_created_if_empty()  # a refusal leaves no empty --out behind
        if debug:
            raise
        from dattri_ds.cli.noise import first_report

        line = f"{PROG}: error: {message(err)}\n"
        if first_report(line):  # ranks of one launch failing alike: the line once
            sys.stderr.write(line)
        return EXIT_USAGE if isinstance(err, USAGE_ERRORS) else EXIT_RUNTIME
    return 0
