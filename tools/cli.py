"""``dattri-ds <subcommand>``: one console command for the tool scripts.

    dattri-ds collect | fit | attribute | report | lds  [options]   (see --help of each)
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "collect": "dattri_ds.tools.collect",
    "fit": "dattri_ds.tools.fit",
    "attribute": "dattri_ds.tools.attribute",
    "report": "dattri_ds.tools.report",
    "lds": "dattri_ds.tools.lds",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown subcommand '{argv[0]}'; choose one of {sorted(COMMANDS)}")
            return 2
        return 0
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
