"""docs/design.md's layout is the tree as it is.

Invariant: the "Layout" block of docs/design.md equals ``layout.py``'s rendering of the
installed folders (every room and module with the first line of its docstring). A moved,
added or renamed module, or a changed one-line responsibility, breaks it until
``python tests/structure/layout.py --write`` is run.
"""

from __future__ import annotations

from layout import current, layout


def test_design_doc_layout_is_generated_from_the_folders():
    """The block between the markers is today's layout."""
    assert current() is not None, "docs/design.md lacks the layout markers"
    assert current() == layout(), \
        "docs/design.md's layout is stale: run python tests/structure/layout.py --write"
