"""Tool flags under the launchers.

Invariant: collect and fit accept what ``deepspeed`` appends (``--local_rank=N``) and the
torchrun-safe ``--run-dir`` (same destination as ``--run``); exactly one of --run-dir and
--model is required, and the error says so.
"""

from __future__ import annotations

import pytest

from dattri_ds.errors import ConfigError


@pytest.mark.parametrize("tool", ["collect", "fit"])
def test_launcher_flags_parse(tool):
    """--local_rank=0 (deepspeed) and --run-dir (torchrun) parse; --run still works."""
    import importlib

    parser = importlib.import_module(f"dattri_ds.tools.{tool}").build_parser()
    a = parser.parse_args(["--run-dir", "R", "--out", "o", "--local_rank=0"])
    b = parser.parse_args(["--run", "R", "--out", "o", "--local-rank", "1"])
    assert a.run == b.run == "R"


def test_run_or_model_required():
    """Neither --run-dir nor --model: a ConfigError naming both flags."""
    from dattri_ds.tools import collect

    with pytest.raises(ConfigError, match="exactly one of --run-dir.*--model"):
        collect.main(["--out", "o"])
