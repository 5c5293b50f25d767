"""``dattri-ds <subcommand>``: one console command for the tool scripts.

    dattri-ds prepare | collect | fit | attribute | report | lds | plan | curate  [options]   (see --help of each)

Errors print one line ``dattri-ds: error: <message>`` (exit 2: usage or config, 1: runtime);
``--debug`` or ``DATTRI_DS_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import importlib
import sys

from dattri_ds.cli.exits import run
from dattri_ds.errors import UsageError

COMMANDS = {
    "collect": "dattri_ds.tools.collect",
    "fit": "dattri_ds.tools.fit",
    "attribute": "dattri_ds.tools.attribute",
    "report": "dattri_ds.tools.report",
    "lds": "dattri_ds.tools.lds",
    "plan": "dattri_ds.tools.plan",
    "curate": "dattri_ds.tools.curate",
    "prepare": "dattri_ds.tools.prepare",
}
#: Former subcommand names -> the one that does their job now (one line names it).
RENAMED = {"select": "curate"}


def main(argv: list[str] | None = None) -> int:
    """The ``dattri-ds`` console command; errors print one line (see dattri_ds/cli/exits.py)."""
    return run(_dispatch, argv)


def help_text() -> str:
    """The module docstring as plain text (reST ``literals`` without their backticks) and
    one line per subcommand (its own description)."""
    lines = [__doc__.strip().replace("``", ""), "", "subcommands:"]
    for name, module in COMMANDS.items():
        try:
            doc = (importlib.import_module(module).__doc__ or "").strip().splitlines()[0]
        except Exception:  # noqa: BLE001 - a subcommand that cannot import still shows its name
            doc = ""
        lines.append(f"  {name:<10} {doc.replace('``', '')}")
    return "\n".join(lines) + "\n"


def _dispatch(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(help_text())
        return
    if argv[0] in RENAMED:
        new = RENAMED[argv[0]]
        raise UsageError(f"'dattri-ds {argv[0]}' is now 'dattri-ds {new}' (same flags; see "
                         f"dattri-ds {new} --help)")
    if argv[0] not in COMMANDS:
        raise UsageError(f"unknown subcommand '{argv[0]}'; choose one of {sorted(COMMANDS)} "
                         f"(see dattri-ds --help)")
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
