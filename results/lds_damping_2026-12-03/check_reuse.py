"""Check that the rescored rows at the default damping (0.003, power 0.8, exact) equal the
saved ones of ../lds_suite_2026-12-03/hybrid/<X>.json (same seeds, ground truth reused), for
ekfac, ekfac-trajectory, tfidf and the hybrids at w 0.25 / 0.5.

Usage: python check_reuse.py A F G ...   (reads damp/<X>.json)
"""
from __future__ import annotations

import json
import sys

ROWS = ("ekfac", "ekfac-trajectory", "tfidf", "ekfac-trajectory+0.25*tfidf",
        "ekfac+0.5*tfidf")


def rows(path: str) -> dict:
    return {r["method"]: r["per_seed"] for r in json.load(open(path))["results"]
            if r["projection"] == "exact" and r["damping"] in (None, 0.003)
            and r.get("power") in (None, 0.8)}


for name in sys.argv[1:]:
    new, old = rows(f"damp/{name}.json"), rows(f"../lds_suite_2026-12-03/hybrid/{name}.json")
    diff = max(abs(a - b) for m in ROWS for a, b in zip(new[m], old[m]))
    print(f"{name}: {len(new['tfidf'])} seeds, max |rescored - saved| over {len(ROWS)} rows "
          f"{diff:.2e}")
