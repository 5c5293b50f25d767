"""Optional dependencies of test modules: skipped locally when missing, a failure in CI.

A suite guarded by ``pytest.importorskip`` vanishes silently when its dependency failed to
install, and CI stays green. ``require`` skips only outside CI; with ``CI`` set (``.ci/run``
and every hosted CI set ``CI=true``) a missing dependency fails collection, naming the
package and the extra that installs it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

__all__ = ["require", "in_ci"]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``; if missing, skip (local run) or fail (CI) naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        msg = f"{module} is not installed ({e}); pip install -e '.[{extra}]'"
        if in_ci():
            pytest.fail(f"CI must run every suite: {msg}", pytrace=False)
        pytest.skip(msg, allow_module_level=True)
