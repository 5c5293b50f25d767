"""Fuzz the offline tools' numeric and boolean flags (issue 13).

Every tool's ``build_parser()`` is read for its flags; malformed values are generated from each
flag's declared rule (its :class:`~dattri_ds.io.schema.FlagType`: type and range) and fed through
``dattri_ds.cli.exits.run(<tool main>, argv)``. Each must exit 2 with exactly one
``dattri-ds: error:`` line naming the flag, before any work starts (the parser is checked to
reject the value first, so a missed rejection fails here instead of starting a run).
"""

from __future__ import annotations

import argparse
import importlib

import pytest

from dattri_ds.cli.exits import run
from dattri_ds.io.schema import FlagType

#: tool -> the required flags (pointing nowhere: a parse that wrongly succeeded fails fast).
#: ``lds`` is absent: it has no numeric flag (``test_lds_command_has_no_numeric_flag``).
TOOLS = {
    "collect": ["--out", "/nonexistent/out"],
    "fit": ["--out", "/nonexistent/out"],
    "attribute": ["--store", "/nonexistent/s", "--queries", "/nonexistent/q",
                  "--out", "/nonexistent/out"],
    "report": ["--attribution", "/nonexistent/a"],
    "plan": ["--model", "/nonexistent/m.json"],
    "curate": ["--store", "/nonexistent/s", "--out", "/nonexistent/out"],
    "demo": [],
}

NOT_NUMBERS = ["abc", "", "true", "0x10", "1,5", "[1]", "null"]
NON_FINITE = ["nan", "inf", "-inf", "NaN", "1e999"]


def _module(tool: str):
    return importlib.import_module(f"dattri_ds.tools.{tool}")


def _actions(tool: str) -> list[argparse.Action]:
    return [a for a in _module(tool).build_parser()._actions if a.option_strings]


def _is_bool(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                               argparse.BooleanOptionalAction))


def _bad_values(t: FlagType) -> list[str]:
    """Malformed texts for one flag, generated from its declared type and range."""
    bad = list(NOT_NUMBERS) + list(NON_FINITE)
    if t.hint is int:
        bad += ["2.5", "1e3", "3.0"]
    b = t.meta.get("bounds", {})
    step = 1 if t.hint is int else 0.5
    if "ge" in b:
        bad += [str(b["ge"] - step), str(b["ge"] - 1000)]
    if "gt" in b:
        bad += [str(b["gt"]), str(b["gt"] - step)]
    if "le" in b:
        bad += [str(b["le"] + step)]
    if "lt" in b:
        bad += [str(b["lt"]), str(b["lt"] + step)]
    return bad


def _good_value(t: FlagType) -> str:
    """A text the flag's rule allows (its lowest allowed value, or the middle of (gt, lt))."""
    b = t.meta.get("bounds", {})
    if "ge" in b:
        return str(b["ge"])
    if "gt" in b and "lt" in b:
        return str((b["gt"] + b["lt"]) / 2)
    if "gt" in b:
        return str(b["gt"] + 1)
    return "7"


CASES = [(tool, a) for tool in TOOLS for a in _actions(tool)
         if isinstance(a.type, FlagType) or _is_bool(a)]


def test_every_numeric_tool_flag_is_strict():
    """No tool flag parses with plain ``int``/``float`` (which accept 0, negatives, nan, inf
    silently): each numeric flag has a FlagType, and each tool has some strict flags."""
    loose = [(tool, a.option_strings[0]) for tool in TOOLS for a in _actions(tool)
             if a.type in (int, float)]
    assert loose == []
    for tool in TOOLS:
        assert any(isinstance(a.type, FlagType) for a in _actions(tool)), tool


def test_lds_command_has_no_numeric_flag():
    """``dattri-ds lds`` takes files and choices only; a numeric flag added later must join
    ``TOOLS`` (and so the strictness checks above)."""
    from dattri_ds.tools import lds

    assert not [a for a in lds.build_parser()._actions if a.type in (int, float)
                or isinstance(a.type, FlagType)]


@pytest.mark.parametrize("tool,action", CASES,
                         ids=[f"{t}{a.option_strings[0]}" for t, a in CASES])
def test_malformed_flag_value_is_one_line_usage_error(tool, action, capsys):
    """A malformed value of a numeric flag (or any value given to a boolean switch) exits 2
    with one ``dattri-ds: error:`` line naming the flag, without a traceback, at parse time."""
    flag = action.option_strings[0]
    if isinstance(action.type, FlagType):
        values = _bad_values(action.type)
    else:
        values = ["1", "yes", "true", "0"]
    main, base = _module(tool).main, TOOLS[tool]
    for value in values:
        argv = base + [f"{flag}={value}"]
        with pytest.raises(SystemExit) as exc:  # the parser itself refuses: no work starts
            _module(tool).build_parser().parse_args(argv)
        assert exc.value.code == 2, (argv, exc.value.code)
        capsys.readouterr()
        assert run(main, argv) == 2, argv
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("dattri-ds: error: "), (argv, err)
        assert flag in lines[0] and "Traceback" not in err, (argv, err)
        if isinstance(action.type, FlagType):
            assert "expected " in lines[0], (argv, err)  # says what is allowed
        assert out == "", (argv, out)


@pytest.mark.parametrize("tool,action", [c for c in CASES if isinstance(c[1].type, FlagType)],
                         ids=[f"{t}{a.option_strings[0]}" for t, a in CASES
                              if isinstance(a.type, FlagType)])
def test_allowed_flag_value_parses_to_its_type(tool, action):
    """The lowest allowed value of each flag parses, to the flag's type (int or float), so the
    strict rules do not refuse documented values (a list flag: each of its values)."""
    flag, t = action.option_strings[0], action.type
    args = _module(tool).build_parser().parse_args(TOOLS[tool] + [flag, _good_value(t)])
    got = getattr(args, action.dest)
    if action.nargs in ("+", "*"):
        assert isinstance(got, list) and len(got) == 1, (flag, got)
        got = got[0]
    assert type(got) is t.hint and got == t.hint(_good_value(t)), (flag, got)
