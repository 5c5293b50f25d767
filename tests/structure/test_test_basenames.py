"""Every test file has a unique basename.

The test folders are not packages, so pytest imports each test file as a top-level module
named by its basename: two files with the same name stop the whole run at collection
("import file mismatch").
"""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_file_basenames_are_unique():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
    assert len(seen) > 50  # the walk found the suite
