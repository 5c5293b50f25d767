"""No behaviour is switched on the name of a projection kind or an attribution method.

Invariant: in the product code (dattri_ds/, selection/, launch/, tools/) no comparison
(``==``, ``!=``, ``in``, ``not in``, ``.startswith``) puts a kind, name or method value
(a variable or attribute whose name holds ``kind``, ``name`` or ``method``, or a
``["method"]`` item) against a string literal that names a registered projection kind or
attribution method. Such behaviour is a class attribute of the kind or method
(``ProjectionKind.factorized``, ``shardable``, ``per_layer``, ``Attributor.text_weight``,
...), so a new kind or method is one class (tests/structure/test_toy_kinds.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from dattri_ds.methods import registered_attributors
from dattri_ds.ops.projection import PROJECTION_KINDS

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("dattri_ds", "selection", "launch", "tools")
SUBJECT = re.compile(r"kind|name|method", re.IGNORECASE)


def _names() -> set[str]:
    return set(PROJECTION_KINDS) | set(registered_attributors())


def _literals(node: ast.AST) -> list[str]:
    """The string constants of a literal or of a tuple / list / set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _literals(e)]
    return []


def _subject(node: ast.AST) -> bool:
    """A kind / name / method value: ``kind``, ``x.kind_name``, ``summary["method"]``, ..."""
    if isinstance(node, ast.Name):
        return bool(SUBJECT.search(node.id))
    if isinstance(node, ast.Attribute):
        return bool(SUBJECT.search(node.attr))
    if isinstance(node, ast.Subscript):
        return any(SUBJECT.search(s) for s in _literals(node.slice)) or _subject(node.value)
    return False


def _prefix_test(node: ast.AST) -> bool:
    """``<kind / name / method value>.startswith(...)`` (or ``endswith``)."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith") and bool(node.args)
            and _subject(node.func.value))


def switches(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, text)`` of every comparison of a kind / name / method value with a name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            ops = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
            if not all(isinstance(op, ops) for op in node.ops):
                continue
            for a, b in ((sides[0], sides[1]), (sides[1], sides[0])):
                if _subject(a) and set(_literals(b)) & names:
                    found.append((node.lineno, ast.unparse(node)))
                    break
        elif _prefix_test(node) and any(n.startswith(p) or p.startswith(n) for p in
                                        _literals(node.args[0]) for n in names if p):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_probe_finds_name_switches():
    """The probe itself: each form it must catch, and what it must leave alone."""
    names = {"kronecker", "ekfac"}
    caught = ['if kind == "kronecker": pass', 'x = cfg.kind != "kronecker"',
              'x = pkind in ("kronecker", "dense")', 'x = args.method == "ekfac"',
              'x = summary["method"] == "ekfac"', 'x = lg.kind_name.startswith("kron")',
              'x = "ekfac" == method']
    for src in caught:
        assert switches(src, names), src
    kept = ['x = path == "dense"', 'x = kind == "other"', 'x = PROJECTION_KINDS["kronecker"]',
            'x = score == "ekfac"']
    for src in kept:
        assert not switches(src, names), src


def test_no_name_switches_on_projection_kinds_or_methods():
    names = _names()
    hits = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, text in switches(path.read_text(), names):
                hits.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert hits == [], ("behaviour switched on a projection kind or method name; make it a "
                        "class attribute of the kind or method:\n" + "\n".join(hits))
