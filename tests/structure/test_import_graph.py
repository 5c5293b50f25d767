"""The package's module-level import graph has no cycle and never points upwards.

Invariant: importing any module of ``dattri_ds`` (with ``selection``, ``launch`` and
``tools`` installed as ``dattri_ds.selection`` / ``.launch`` / ``.tools``, setup.py
``package_dir``) never re-enters a module that is still initialising, whatever module is
imported first; and the layers depend one way only: ``dattri_ds <- selection <- launch``,
``dattri_ds <- tools``. Read from the source with ``ast`` (no import runs): an edge is an
``import`` executed when the module loads (module body, class bodies, ``if``/``try`` at top
level); imports inside functions (lazy) and under ``if TYPE_CHECKING:`` are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: package name -> folder, as setup.py installs them
PACKAGE_DIRS = {"dattri_ds": ROOT / "dattri_ds", "dattri_ds.selection": ROOT / "selection",
                "dattri_ds.launch": ROOT / "launch", "dattri_ds.tools": ROOT / "tools"}
#: layer of a module -> the layers it may import at module level
ALLOWED = {"core": {"core"}, "selection": {"core", "selection"},
           "launch": {"core", "selection", "launch"}, "tools": {"core", "selection", "tools"}}


def modules() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of the installed packages."""
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for f in sorted(folder.rglob("*.py")):
            rel = f.relative_to(folder).with_suffix("").parts
            if any(p.startswith(".") or p == "__pycache__" for p in rel):
                continue
            if pkg == "dattri_ds" and rel[0] in ("selection", "launch", "tools"):
                continue
            name = ".".join((pkg, *rel))
            out[name.removesuffix(".__init__")] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _load_time_imports(body: list[ast.stmt]):
    """Import statements executed when the module loads (not in functions, not typing-only)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _load_time_imports(node.body)
            yield from _load_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _load_time_imports(part)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _load_time_imports(node.body)


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports at load time."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _load_time_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.add(sub if sub in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[m0, m1, ..., m0]``, or None (iterative DFS)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def layer_of(name: str) -> str:
    for layer in ("selection", "launch", "tools"):
        if name == f"dattri_ds.{layer}" or name.startswith(f"dattri_ds.{layer}."):
            return layer
    return "core"


def test_every_package_folder_is_read():
    """The graph covers the core package and the three installed folders (a path change in
    setup.py would otherwise let the test pass on nothing)."""
    mods = modules()
    for pkg in PACKAGE_DIRS:
        assert pkg in mods, f"{pkg} has no __init__.py under {PACKAGE_DIRS[pkg]}"
    assert {"dattri_ds.ops.space", "dattri_ds.registry", "dattri_ds.gradient"} <= set(mods)
    assert len(mods) > 60


def test_no_import_cycle():
    """No cycle of load-time imports: an import order that re-enters a module still being
    initialised (ImportError or a half-built module) cannot exist."""
    cycle = find_cycle(edges(modules()))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle():
    """The checker itself: a planted cycle is reported with its members in order."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_never_flow_upwards():
    """``dattri_ds`` imports none of selection/launch/tools; selection imports neither
    launch nor tools; tools never imports launch (the layers of the repository)."""
    graph = edges(modules())
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                 if layer_of(t) not in ALLOWED[layer_of(m)])
    assert not bad, "imports flowing upwards (dattri_ds <- selection <- launch, " \
                    "dattri_ds <- tools):\n" + "\n".join(bad)
