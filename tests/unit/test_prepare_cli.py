"""``dattri-ds prepare`` on the command line: every flag comes from ``PrepareConfig``, a bad
value or input is one ``dattri-ds: error:`` line (exit 2) naming it, and a good run prints
one summary line.

Invariant: through ``dattri_ds.cli.exits.run`` (the console script's error path), each malformed
numeric flag, each missing or damaged input and each refused output exits 2 with exactly
one error line that names the flag or the path, no traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _corpora import documents, spm_file, write_jsonl  # noqa: E402
from _deps import require  # noqa: E402

require("megatron.core", "megatron")
from dattri_ds.cli.exits import run  # noqa: E402
from dattri_ds.data.prepare import PrepareConfig  # noqa: E402
from dattri_ds.tools import prepare as tool  # noqa: E402


def _fails(capsys, argv: list[str], needle: str) -> str:
    code = run(tool.main, argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("dattri-ds: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    return lines[0]


def test_every_config_field_is_a_flag():
    flags = {a.dest for a in tool.build_parser()._actions}
    assert {f.name for f in dataclasses.fields(PrepareConfig)} <= flags


@pytest.mark.parametrize("flag,value", [("--workers", "0"), ("--workers", "1.5"),
                                        ("--chunk-docs", "0"), ("--vocab-size", "4"),
                                        ("--tokenizer-sample", "-1"), ("--seed", "x"),
                                        ("--tokenizer-type", "wordpiece")])
def test_bad_flag_values_are_one_line(capsys, tmp_path, flag, value):
    _fails(capsys, ["--input", str(tmp_path / "c.jsonl"), "--output-prefix",
                    str(tmp_path / "o"), flag, value], flag)


def test_inputs_and_outputs_are_one_line(capsys, tmp_path):
    rows = documents(30, seed=6)
    write_jsonl(tmp_path / "c.jsonl", rows)
    model = spm_file(tmp_path / "t.model", [r["text"] for r in rows])
    out = str(tmp_path / "o")
    _fails(capsys, ["--input", str(tmp_path / "none.jsonl"), "--output-prefix", out],
           "none.jsonl")
    _fails(capsys, ["--input", str(tmp_path / "c.jsonl"), "--output-prefix",
                    str(tmp_path / "c.jsonl" / "o")], "--output-prefix")
    _fails(capsys, ["--input", str(tmp_path / "c.jsonl"), "--output-prefix", out,
                    "--text-field", "body"], "--text-field")
    _fails(capsys, ["--input", str(tmp_path / "c.jsonl"), "--output-prefix", out,
                    "--tokenizer", str(tmp_path / "missing.model")], "missing.model")
    ok = ["--input", str(tmp_path / "c.jsonl"), "--output-prefix", out, "--tokenizer",
          str(model), "--workers", "1"]
    assert run(tool.main, ok) == 0
    assert "prepared 30 documents" in capsys.readouterr().out
    write_jsonl(tmp_path / "d.jsonl", rows[:10])
    _fails(capsys, ["--input", str(tmp_path / "d.jsonl"), "--output-prefix", out,
                    "--tokenizer", str(model)], "--overwrite")
    changed = ["--input", str(tmp_path / "d.jsonl"), "--output-prefix", out, "--tokenizer",
               str(model), "--workers", "1"]
    assert run(tool.main, [*changed, "--force"]) == 0  # --force: the other commands' name
    assert "prepared 10 documents" in capsys.readouterr().out
