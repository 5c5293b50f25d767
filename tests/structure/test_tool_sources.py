"""The tools read every model source through one declared protocol, and import at the top.

Invariants: ``Run``, ``HFModelDir`` and ``HFCheckpoints`` each implement every member the
``Source`` protocol (tools/sources/base.py) declares; no tool tests a source's type
(``isinstance`` on a source class, ``hasattr`` on a source): where sources differ, the
difference is a member's answer. Package modules are imported at the top of the tool files
(at most ``MAX_LAZY`` imports of ``dattri_ds`` modules inside functions; only third-party
deepspeed, megatron, transformers and matplotlib stay lazy). Read from the source with
``ast`` where possible.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SOURCES = ("Run", "HFModelDir", "HFCheckpoints")
#: The most package-module imports allowed inside functions of tools/.
MAX_LAZY = 10


def _members(cls: type) -> set[str]:
    """The public names a class declares: its attributes and annotated fields."""
    return {n for n in [*vars(cls), *vars(cls).get("__annotations__", {})]
            if not n.startswith("_")}


@pytest.mark.parametrize("name", SOURCES)
def test_every_source_implements_the_protocol(name):
    """A member added to ``Source`` and missing from one source fails here, before a tool
    meets the missing attribute with that source."""
    import dattri_ds.tools.sources as sources

    declared = _members(sources.Source)
    assert {"root", "model", "checkpoint", "default_tags", "training_record",
            "vocab_size"} <= declared
    cls = getattr(sources, name)
    have = {n for n in declared if hasattr(cls, n) or n in getattr(cls, "__dataclass_fields__",
                                                                      {})}
    assert have == declared, f"{name} lacks {sorted(declared - have)}"


def _tool_files() -> list[Path]:
    return sorted(p for p in TOOLS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_tool_tests_a_source_by_type():
    """No ``isinstance(x, Run | HFModelDir | HFCheckpoints)`` and no ``hasattr(source, ...)``
    (or ``run``) in tools/: the protocol says what a source answers."""
    bad = []
    for path in _tool_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id == "isinstance" and len(node.args) == 2 and any(
                    isinstance(n, ast.Name) and n.id in SOURCES
                    for n in ast.walk(node.args[1])):
                bad.append(f"{path.name}:{node.lineno} isinstance on a source class")
            if node.func.id in ("hasattr", "getattr") and node.args and isinstance(
                    node.args[0], ast.Name) and node.args[0].id in ("source", "run", "owner"):
                bad.append(f"{path.name}:{node.lineno} {node.func.id}({node.args[0].id}, ...)")
    assert not bad, "sources tested by type:\n" + "\n".join(bad)


def _lazy_package_imports(path: Path) -> list[str]:
    """``file:line module`` of every import of a package module inside a function."""
    inside: dict[int, ast.stmt] = {}
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update((id(n), n) for n in ast.walk(fn)
                          if isinstance(n, (ast.Import, ast.ImportFrom)))
    out = []
    for node in sorted(inside.values(), key=lambda n: n.lineno):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""]
        out += [f"{path.name}:{node.lineno} {n}" for n in names
                if n == "dattri_ds" or n.startswith("dattri_ds.")]
    return out


def test_package_imports_stay_at_the_top():
    """Package modules are imported at the top of tool files, where the import graph test
    and a reader see them; at most ``MAX_LAZY`` inside functions."""
    lazy = [x for p in _tool_files() for x in _lazy_package_imports(p)]
    assert len(lazy) <= MAX_LAZY, f"{len(lazy)} lazy package imports:\n" + "\n".join(lazy)


def test_the_counter_counts_imports_inside_functions(tmp_path):
    """The checker itself: imports inside functions are counted, top-level ones are not."""
    f = tmp_path / "t.py"
    f.write_text("import dattri_ds\nfrom dattri_ds import x\n"
                 "def g():\n    from dattri_ds.store import a\n    import torch\n"
                 "    def h():\n        import dattri_ds.io.files\n")
    got = _lazy_package_imports(f)
    assert sorted(x.split()[1] for x in got) == ["dattri_ds.io.files", "dattri_ds.store"]
