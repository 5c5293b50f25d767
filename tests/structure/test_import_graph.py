"""The package's import graph has no cycle and never points upwards, lazy imports included.

Invariant: importing any module of ``dattri_ds`` (with ``selection``, ``launch`` and
``tools`` installed as ``dattri_ds.selection`` / ``.launch`` / ``.tools``, setup.py
``package_dir``) never re-enters a module that is still initialising, whatever module is
imported first; and the layers depend one way only: ``dattri_ds <- selection <- launch``,
``dattri_ds <- tools`` (the README's two applications, ``tools/main_job.py`` and
``tools/demo.py``, sit on top and may use the training loop). Read from the source with
``ast`` (no import runs). Two graphs: the *load-time* graph (an ``import`` executed when
the module loads: module body, class bodies, ``if``/``try`` at top level) must have no
cycle, or an import order fails; the *full* graph adds every import inside a function (a
lazy import is still a dependency) and must have no cycle either and never point upwards.
Only ``if TYPE_CHECKING:`` imports are not edges. Third-party packages (deepspeed,
megatron, transformers, imported lazily inside ``dattri_ds/integrations``) are never
package modules, so they are not edges of either graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: package name -> folder under the repository root, as setup.py installs them
FOLDERS = {"dattri_ds": "dattri_ds", "dattri_ds.selection": "selection",
           "dattri_ds.launch": "launch", "dattri_ds.tools": "tools"}
PACKAGE_DIRS = {pkg: ROOT / folder for pkg, folder in FOLDERS.items()}
#: layer of a module -> the layers it may import at module level
ALLOWED = {"core": {"core"}, "selection": {"core", "selection"},
           "launch": {"core", "selection", "launch"}, "tools": {"core", "selection", "tools"},
           "apps": {"core", "selection", "launch", "tools", "apps"}}
#: The applications on top of every layer (they train with launch's loop and call the tools).
APPS = ("dattri_ds.tools.main_job", "dattri_ds.tools.demo")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of the installed packages in the tree
    ``root`` (this checkout by default)."""
    out: dict[str, Path] = {}
    for pkg, sub in FOLDERS.items():
        folder = root / sub
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


def _all_imports(body: list[ast.stmt], typing: bool = False):
    """Every import statement of the module, in functions too (typing-only ones only when
    ``typing``)."""
    typing_only: set[int] = set()
    tree = ast.Module(body=body, type_ignores=[])
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not typing:
            typing_only.update(id(n) for part in node.body for n in ast.walk(part))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
            yield node


def _typed_imports(body: list[ast.stmt]):
    return _all_imports(body, typing=True)


def edges(mods: dict[str, Path], lazy: bool = False,
          typing: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at load time (``lazy``: anywhere;
    ``typing``: anywhere, ``if TYPE_CHECKING:`` imports included)."""
    found = _typed_imports if typing else _all_imports if lazy else _load_time_imports
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in found(ast.parse(path.read_text(), str(path)).body):
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
    if name in APPS:
        return "apps"
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


def test_no_import_cycle_counting_lazy_imports():
    """No cycle even through imports inside functions: a lazy import that closes a circle
    only hides it from the load-time graph (modules that need each other are one module,
    or one of them holds what the other needs)."""
    cycle = find_cycle(edges(modules(), lazy=True))
    assert cycle is None, "import cycle through lazy imports: " + " -> ".join(cycle or [])


def test_lazy_imports_are_edges():
    """The checker itself: an import inside a function (not under TYPE_CHECKING) is an edge
    of the full graph and not of the load-time one."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\n"
           "def f():\n    import c\n    if TYPE_CHECKING:\n        import d\n")
    body = ast.parse(src).body
    lazy = {a.name for n in _all_imports(body) for a in n.names}
    assert lazy == {"TYPE_CHECKING", "c"}
    assert {a.name for n in _load_time_imports(body) for a in n.names} == {"TYPE_CHECKING"}


def test_cycle_finder_finds_a_cycle():
    """The checker itself: a planted cycle is reported with its members in order."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_never_flow_upwards():
    """``dattri_ds`` imports none of selection/launch/tools; selection imports neither
    launch nor tools; tools never imports launch (the layers of the repository); lazy
    imports inside functions count."""
    graph = edges(modules(), lazy=True)
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                 if layer_of(t) not in ALLOWED[layer_of(m)])
    assert not bad, "imports flowing upwards (dattri_ds <- selection <- launch, " \
                    "dattri_ds <- tools):\n" + "\n".join(bad)


# ---- the core's rooms: folders (and the few root modules) ----------------------------------

#: The core's floors, lowest first: a room imports only rooms on lower floors (typing-only
#: imports included). Root modules are rooms of their own.
FLOORS = (
    {"errors"},
    {"registry", "distributed", "sample_id", "io", "cli"},
    {"gradient"},
    {"layers"},
    {"ops"},
    {"capture", "data", "eval"},
    {"store", "methods", "integrations", "models", "plan"},
)
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
MAX_ROOT_MODULES = 8


def room_of(name: str) -> str | None:
    """The core room of module ``name`` (``dattri_ds.ops.cost`` -> ``ops``; a root module is
    its own room); None outside the core or for the package itself."""
    if layer_of(name) != "core" or name == "dattri_ds":
        return None
    return name.split(".")[1]


def room_edges(typing: bool = False) -> dict[str, set[str]]:
    """Room -> the other core rooms its modules import (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for m, targets in edges(modules(), lazy=True, typing=typing).items():
        r = room_of(m)
        if r is None:
            continue
        graph.setdefault(r, set()).update(
            t for t in map(room_of, targets) if t is not None and t != r)
    return graph


def test_every_core_room_has_a_floor():
    """Each folder and root module of the core is placed on a floor (a new room must be)."""
    assert set(room_edges()) <= set(FLOOR), sorted(set(room_edges()) - set(FLOOR))


def test_no_cycle_between_core_rooms():
    """No circle between the core's folders, lazy imports included (``capture`` never imports
    ``integrations``: adapters register themselves)."""
    cycle = find_cycle(room_edges())
    assert cycle is None, "folder-level import cycle: " + " -> ".join(cycle or [])


def test_core_rooms_import_only_lower_floors():
    """A room imports only rooms on lower floors, typing-only imports included."""
    bad = sorted(f"{r} -> {t}" for r, ts in room_edges(typing=True).items() for t in ts
                 if FLOOR.get(t, 99) >= FLOOR.get(r, -1))
    assert not bad, "imports up (or across) the core's floors:\n" + "\n".join(bad)


def test_package_root_is_small():
    """The package root holds at most MAX_ROOT_MODULES modules (the rest live in rooms)."""
    loose = sorted(p.name for p in (ROOT / "dattri_ds").glob("*.py"))
    assert len(loose) <= MAX_ROOT_MODULES, loose
