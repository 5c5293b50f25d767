"""Fuzz the ``"dattri_ds"`` block, DeepSpeed JSON files and launch flags, generated from the
schema (dattri_ds/io/schema.py walks the config dataclasses).

Invariant: every malformed input is refused at start, before anything trains, through the
CLI error path (dattri_ds/cli/exits.py): exit code 2 and exactly one line
``dattri-ds: error: ...`` naming the offending key path (or the file:line:column, or the
flag), no traceback, no silent acceptance. Valid inputs (the configs in configs/, every
default written out explicitly, every default given as a flag) are accepted and give the
same configuration as the defaults. Parse only: the whole module runs in seconds.
"""

from __future__ import annotations

import dataclasses
import io
import json
import typing
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any, Literal

import pytest

from dattri_ds.io import schema
from dattri_ds.cli.exits import run
from dattri_ds.launch.args import ALIASES, flag_name, load_run_config, parse_args
from dattri_ds.launch.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
LEAVES = list(schema.leaves(RunConfig))


def _nest(path: tuple[str, ...], value: Any) -> dict:
    for k in reversed(path):
        value = {k: value}
    return value


def _parse_only(argv: list[str]) -> None:
    args = parse_args(argv)
    load_run_config(args.deepspeed_config, args.overrides)


def _cli(argv: list[str]) -> tuple[int, list[str], str]:
    """(exit code, the ``dattri-ds: error:`` lines, all of stderr) of a parse-only run."""
    err = io.StringIO()
    with redirect_stderr(err):
        code = run(_parse_only, argv)
    text = err.getvalue()
    return code, [ln for ln in text.splitlines() if ln.startswith("dattri-ds: error: ")], text


def _write(tmp: Path, name: str, content: bytes | dict) -> Path:
    p = tmp / name
    p.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return p


# ---- generation ---------------------------------------------------------------------------

def _kind(leaf: schema.Leaf) -> Any:
    members, _ = schema._split_optional(leaf.hint)
    return members[0]


def _optional(leaf: schema.Leaf) -> bool:
    return schema._split_optional(leaf.hint)[1]


def bad_values(leaf: schema.Leaf) -> list[Any]:
    """JSON values of the wrong type or out of range for ``leaf``."""
    k = _kind(leaf)
    null = [] if _optional(leaf) else [None]
    out: list[Any]
    if k is bool:
        out = ["false", "true", 0, 1, 1.0, [], {}]
    elif k is int:
        out = [2.5, True, "3", [], {}, float("nan"), float("inf")]
    elif k is float:
        out = ["1.0", True, float("nan"), float("inf"), float("-inf"), [], {}]
    elif k is str:
        out = ["", 5, True, ["a"], {}]
    elif typing.get_origin(k) is Literal:
        out = ["bogus", 1, True, [], list(typing.get_args(k))[:1]]
    elif typing.get_origin(k) is tuple:
        out = [[1], [None], {}, 3, [""], ""]  # a bare non-empty string is a list of one
    else:  # pragma: no cover - a new hint kind: extend this generator
        raise AssertionError(f"no generator for {leaf.hint} ({leaf.key})")
    b = leaf.meta.get("bounds", {})
    step = 1 if k is int else 0.5
    out += [b["ge"] - step for _ in [0] if "ge" in b]
    out += [b["gt"] for _ in [0] if "gt" in b]
    out += [b["le"] + step for _ in [0] if "le" in b]
    out += [b["lt"] for _ in [0] if "lt" in b]
    out += [b["ne"] for _ in [0] if "ne" in b]
    out += [[]] if leaf.meta.get("min_items") else []
    return out + null


def bad_texts(leaf: schema.Leaf) -> list[str]:
    """Flag texts the strict flag parser must refuse for ``leaf``."""
    k = _kind(leaf)
    b = leaf.meta.get("bounds", {})
    if k is bool:
        return ["yes", "1", "False", "0"]
    if k in (int, float):
        out = ["abc", "true", "None"] + (["2.5", "1e3"] if k is int else ["nan", "inf"])
        step = 1 if k is int else 0.5
        out += [str(b["ge"] - step)] if "ge" in b else []
        out += [str(b["le"] + step)] if "le" in b else []
        out += [str(b["gt"])] if "gt" in b else []
        out += [str(b["ne"])] if "ne" in b else []
        return out
    if typing.get_origin(k) is Literal:
        return ["bogus", "None"]
    if k is str:
        return [""]
    return []  # tuple flags: every word is a valid string; a missing value is tested below


def _block_sections() -> list[tuple[str, ...]]:
    """Paths of every object in the block (the block itself, sections, nested blocks)."""
    paths = {()}
    for leaf in LEAVES:
        for i in range(1, len(leaf.path)):
            paths.add(leaf.path[:i])
    return sorted(paths)


def config_cases() -> list[tuple[str, dict, str]]:
    """(description, dattri_ds block, key path the error must name)."""
    cases = []
    for leaf in LEAVES:
        for v in bad_values(leaf):
            cases.append((f"{leaf.key}={v!r}", _nest(leaf.path, v), f"dattri_ds.{leaf.key}"))
    for sec in _block_sections():
        key = ".".join(("dattri_ds",) + sec)
        cases.append((f"unknown key in {key}", _nest(sec + ("bogus_key",), 1),
                      f"{key}.bogus_key"))
        if sec:
            cases.append((f"typo in {key}", _nest(sec + ("enabeld",), True), f"{key}.enabeld"))
            optional = sec in {leaf.path[:len(sec)] for leaf in LEAVES} and sec[-1] == \
                "projection"
            for v in ([], "x", 5, True) + (() if optional else (None,)):
                cases.append((f"{key}={v!r}", _nest(sec, v), key))
    return cases


SYNTAX = [
    (b'{"train_batch_size": 2,}', ":1:"),
    (b'{"a": 1\n "b": 2}', ":2:"),
    (b"{'a': 1}", ":1:"),
    (b'{"a": 1} // comment', ":1:"),
    (b'{"dattri_ds": {"train": {"steps": 3}', ":1:"),
    (b"", ":1:"),
    (b'{"a": tru}', ":1:"),
    (b'{\n  "dattri_ds": {\n    "train": {"steps": 03}\n  }\n}', ":3:"),
    (b'{"a": "\x01"}', ":1:"),
    (b'{"dattri_ds": {"train": {"steps": 1, "steps": 2}}}', "steps"),
]
ENCODINGS = [
    (json.dumps(BASE).encode("utf-16"), "UTF-16"),
    (json.dumps(BASE).encode("utf-32"), "UTF-32"),
    (b'{"dattri_ds": {"train": {"model_config": "caf\xe9"}}}', "UTF-8"),
    (b"\xff\x00\x01", "UTF-8"),
]


# ---- tests ----------------------------------------------------------------------------------

def test_fuzz_blocks_flags_and_files_all_refused_with_one_line_naming_the_key(tmp_path):
    """>= 300 generated malformed inputs: each exits 2 with one ``dattri-ds: error:`` line
    naming its key (or file position / flag), no traceback. Breaks if any type, range,
    unknown key, structure, syntax, encoding or flag error is accepted or leaks raw."""
    failures, n = [], 0

    def expect(desc: str, argv: list[str], needle: str) -> None:
        nonlocal n
        n += 1
        code, lines, text = _cli(argv)
        if code != 2 or len(lines) != 1 or needle not in lines[0] or "Traceback" in text:
            failures.append(f"{desc}: exit {code}, stderr {text.strip()[-300:]!r}")

    for i, (desc, block, key) in enumerate(config_cases()):
        p = _write(tmp_path, f"c{i}.json", {**BASE, "dattri_ds": block})
        expect(desc, ["--deepspeed_config", str(p)], key)
    for i, (raw, pos) in enumerate(SYNTAX):
        p = _write(tmp_path, f"s{i}.json", raw)
        expect(f"syntax {raw!r}", ["--deepspeed_config", str(p)], f"{p}" if pos != "steps"
               else "steps")
        if pos.startswith(":"):
            expect(f"position {raw!r}", ["--deepspeed_config", str(p)], f"{p}{pos}")
    for i, (raw, enc) in enumerate(ENCODINGS):
        p = _write(tmp_path, f"e{i}.json", raw)
        expect(f"encoding {enc}", ["--deepspeed_config", str(p)], f"{p}")
        expect(f"encoding name {enc}", ["--deepspeed_config", str(p)], enc)
    for desc, doc in [("top-level list", [1]), ("block list", {"dattri_ds": []}),
                      ("train list", {"dattri_ds": {"train": []}}), ("top-level str", "x")]:
        p = _write(tmp_path, "x.json", json.dumps(doc).encode())
        expect(desc, ["--deepspeed_config", str(p)], str(p) if desc.startswith("top")
               else "dattri_ds")
    expect("missing file", ["--deepspeed_config", str(tmp_path / "nope.json")], "nope.json")

    good = _write(tmp_path, "good.json", BASE)
    for leaf in LEAVES:
        flag = flag_name(leaf)
        for text in bad_texts(leaf):
            expect(f"{flag} {text!r}", ["--deepspeed_config", str(good), f"{flag}={text}"],
                   flag)
            expect(f"{flag} {text!r} key", ["--deepspeed_config", str(good), f"{flag}={text}"],
                   f"dattri_ds.{leaf.key}")
        if _kind(leaf) is not bool:
            expect(f"{flag} without a value", ["--deepspeed_config", str(good), flag], flag)
    for argv, needle in [(["--bogus-flag", "1"], "--bogus-flag"), (["--seq", "5"], "--seq"),
                         (["--capture-projection", "64"], "--capture-projection"),
                         (["--backend", "jax"], "--backend"),
                         (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size"),
                         ([], "--deepspeed_config")]:
        expect(f"argv {argv}", (["--deepspeed_config", str(good)] if argv else []) + argv,
               needle)
    assert not failures, f"{len(failures)} of {n} malformed inputs not refused cleanly:\n" + \
        "\n".join(failures[:40])
    assert n >= 300, n
    print(f"{n} malformed inputs, all refused with one line naming the key")


def test_unknown_deepspeed_key_is_warned_by_name(tmp_path):
    """A misspelt top-level DeepSpeed key is ignored by DeepSpeed: we warn, naming it; the
    known keys of configs/ give no warning."""
    p = _write(tmp_path, "ds.json", {**BASE, "train_micro_batch_size_per_gpus": 4})
    with pytest.warns(UserWarning, match="'train_micro_batch_size_per_gpus'"):
        load_run_config(p)
    import warnings
    for cfg in sorted((ROOT / "configs").glob("zero*.json")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_run_config(cfg)


def _default_block() -> dict:
    """Every leaf written out explicitly with its default value (JSON form)."""
    block: dict = {}
    for leaf in LEAVES:
        if leaf.default is dataclasses.MISSING:
            continue
        node = block
        for k in leaf.path[:-1]:
            node = node.setdefault(k, {})
        node[leaf.path[-1]] = list(leaf.default) if isinstance(leaf.default, tuple) else \
            leaf.default
    return block


def test_valid_configs_and_explicit_defaults_are_accepted(tmp_path):
    """configs/*.json load; a block with every default written out, and every default given
    as a flag, parse to the same RunConfig as no settings (projection blocks, which default
    to null, come out as their defaults). Breaks if the schema refuses a valid value."""
    for cfg in sorted((ROOT / "configs").glob("zero*.json")):
        load_run_config(cfg)
    block = _default_block()
    block["selection"]["score"] = "alignment"  # its written-out projection needs the probe
    explicit = RunConfig.from_dict(block)
    base = RunConfig.from_dict({})
    assert explicit.selection.score == "alignment" and base.selection.score == "content"
    assert dataclasses.replace(explicit, store={}, capture=dataclasses.replace(
        explicit.capture, projection=None), selection=dataclasses.replace(
        explicit.selection, projection=None, score="content")) == base
    assert explicit.store_config(tmp_path) == base.store_config(tmp_path)
    assert explicit.capture.projection == explicit.selection.projection is not None
    good = _write(tmp_path, "good.json", BASE)
    argv = ["--deepspeed_config", str(good)]
    for leaf in LEAVES:
        d = leaf.default
        if d is dataclasses.MISSING or d == ():
            continue
        if leaf.key == "selection.score":
            d = "alignment"  # as in the block above
        if isinstance(d, tuple):
            argv += [flag_name(leaf), *d]
        else:
            argv.append(f"{flag_name(leaf)}=" + ("null" if d is None else json.dumps(d).strip(
                '"') if not isinstance(d, bool) else str(d).lower()))
    args = parse_args(argv)
    _, flagged = load_run_config(good, args.overrides)
    assert flagged == explicit
    for leaf in LEAVES:  # one string where a list of strings is expected: a list of one
        if typing.get_origin(_kind(leaf)) is tuple:
            block = _nest(leaf.path, "x.jsonl")
            if leaf.path[0] == "selection":  # selection.include needs the gradient score
                block["selection"]["score"] = "alignment"
            cfg = RunConfig.from_dict(block)
            node = cfg
            for k in leaf.path:
                node = node[k] if isinstance(node, dict) else getattr(node, k)
            assert node == ("x.jsonl",), leaf.key


def test_flags_override_json_and_aliases_name_real_fields(tmp_path):
    """A flag wins over the JSON value of its key; every alias points at an existing field
    and parses the same as the generated flag."""
    keys = {leaf.key for leaf in LEAVES}
    assert set(ALIASES) <= keys, set(ALIASES) - keys
    p = _write(tmp_path, "c.json", {**BASE, "dattri_ds": {"train": {"steps": 7},
                                                          "selection": {"enabled": False}}})
    args = parse_args(["--deepspeed_config", str(p), "--steps", "3", "--online-selection",
                       "--capture-projection-dim", "64", "--store-fsync=false",
                       "--no-selection-log-scores"])
    _, cfg = load_run_config(p, args.overrides)
    assert (cfg.train.steps, cfg.selection.enabled) == (3, True)
    assert cfg.capture.projection is not None and cfg.capture.projection.dim == 64
    assert cfg.store_config(tmp_path).fsync is False and cfg.selection.log_scores is False
    for key, names in ALIASES.items():
        leaf = next(lf for lf in LEAVES if lf.key == key)
        value = {bool: "true", int: "5", float: "3", str: "x.jsonl"}.get(_kind(leaf), "x")
        got = {parse_args(["--deepspeed_config", str(p), f"{n}={value}"]).overrides[leaf.path]
               for n in (flag_name(leaf), *names)}
        assert len(got) == 1, (key, got)
