"""Tool flags under the launchers.

Invariant: collect and fit accept what ``deepspeed`` appends (``--local_rank=N``) and the
torchrun-safe ``--run-dir`` (same destination as ``--run``); exactly one of --run-dir and
--model is required, and the error says so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dattri_ds.errors import ConfigError


@pytest.mark.parametrize("tool", ["collect", "fit"])
def test_launcher_flags_parse(tool):
    """--local_rank=0 (deepspeed) and --run-dir (torchrun) parse; --run still works."""
    import importlib

    parser = importlib.import_module(f"dattri_ds.tools.{tool}").build_parser()
    a = parser.parse_args(["--run-dir", "R", "--out", "o", "--local_rank=0"])
    b = parser.parse_args(["--run", "R", "--out", "o", "--local-rank", "1"])
    assert a.run == b.run == "R"


def test_run_or_model_required():
    """Neither --run-dir nor --model: a ConfigError naming both flags."""
    from dattri_ds.tools import collect

    with pytest.raises(ConfigError, match="exactly one of --run-dir.*--model"):
        collect.main(["--out", "o"])


#: Every flag collect, fit and attribute had before their flags were generated, with its
#: default: generation must keep each name and default (--data: None since issue 37, the
#: run's own training data, not a cwd-relative corpus).
KEPT = {
    "collect": {"--projection": "auto", "--projection-dim": 4096, "--seed": 0, "--whiten": None,
                "--dtype": "float32", "--flush-every": 256, "--batch-size": 8,
                "--max-docs": None, "--data": None, "--factors": None,
                "--checkpoints": None},
    "fit": {"--projection-dim": None, "--seed": None, "--damping": None,
            "--damping-mode": None, "--power": None, "--kfac-only": False, "--batch-size": 8,
            "--max-docs": None, "--checkpoint": None, "--store": None, "--force": False},
    "attribute": {"--method": "ekfac-trajectory", "--weighting": None, "--top-k": 10,
                  "--block-rows": 1024, "--truncate": False, "--per-token": False,
                  "--query-max-docs": None, "--checkpoints": None, "--factors": None,
                  "--force": False},
}


def _actions(tool: str) -> dict:
    import importlib

    p = importlib.import_module(f"dattri_ds.tools.{tool}").build_parser()
    return {s: a for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("tool", sorted(KEPT))
def test_existing_flags_keep_their_names_and_defaults(tool):
    """Generating the flags from the config dataclasses kept every flag and default."""
    actions = _actions(tool)
    for flag, default in KEPT[tool].items():
        assert flag in actions, (tool, flag)
        assert actions[flag].default == default, (tool, flag, actions[flag].default)


@pytest.mark.parametrize("tool,table", [("collect", "COLLECT"), ("fit", "FIT"),
                                        ("attribute", "ATTRIBUTE")])
def test_flags_are_generated_from_config_fields(tool, table):
    """Each config flag takes its type, range, choices and default from its dataclass field:
    a ``Literal`` field's choices are its values, a registry-checked field's are the
    registry's names (attribute --method: every registered attributor), a numeric one
    parses by the field's rule, and every field of the tool's own options dataclass has a
    flag. Breaks if a flag table is written by hand again and drifts from the fields."""
    import dataclasses
    import typing

    from dattri_ds.methods import registered_attributors
    from dattri_ds.ops.projection import KINDS
    from dattri_ds.io.schema import FlagType
    from dattri_ds.tools import configs

    actions = _actions(tool)
    flags = getattr(configs, table)
    for spec in flags:
        a = actions[spec.name]
        hint = typing.get_type_hints(spec.cls)[spec.field]
        base = [m for m in typing.get_args(hint) if m is not type(None)] or [hint]
        if typing.get_origin(hint) is typing.Literal:
            base = [hint]
        if typing.get_origin(base[0]) is typing.Literal:
            assert a.choices == list(typing.get_args(base[0])), spec.name
        elif base[0] in (int, float):
            assert isinstance(a.type, FlagType) and a.type.hint is base[0], spec.name
            f = next(f for f in dataclasses.fields(spec.cls) if f.name == spec.field)
            assert a.type.meta.get("bounds") == f.metadata.get("bounds"), spec.name
    owned = {"collect": configs.CollectOptions, "fit": configs.FitOptions,
             "attribute": configs.AttributeOptions}[tool]
    for f in dataclasses.fields(owned):
        assert "--" + f.name.replace("_", "-") in actions, f.name
    if tool == "attribute":
        assert actions["--method"].choices == sorted(registered_attributors())
    if tool == "collect":
        assert actions["--projection"].choices == list(KINDS)


def test_a_new_option_field_is_a_new_flag():
    """A field added to a tool's options dataclass becomes a strict flag with its default and
    range, with no flag table edited."""
    import argparse
    from dataclasses import dataclass, field

    from dattri_ds.io.schema import bounds
    from dattri_ds.tools.configs import add_flags, option_flags

    @dataclass(frozen=True, kw_only=True)
    class Toy:
        block_size: int = field(default=3, metadata=bounds(ge=2))
        """Rows per block."""
        verbose: bool = False
        """Say more."""

    p = argparse.ArgumentParser()
    add_flags(p, option_flags(Toy))
    assert Toy(**vars(p.parse_args([]))) == Toy()
    assert Toy(**vars(p.parse_args(["--block-size", "5", "--verbose"]))) == Toy(
        block_size=5, verbose=True)
    with pytest.raises(SystemExit):
        p.parse_args(["--block-size", "1"])


def test_lds_methods_are_the_registry():
    """benchmarks/lds.py runs every registered attribution method (no copied list)."""
    import importlib.util

    from dattri_ds.methods import registered_attributors

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "lds.py"
    spec = importlib.util.spec_from_file_location("bench_lds", path)
    lds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lds)
    assert sorted(lds.METHODS) == sorted(registered_attributors())


def test_tools_given_a_run_read_its_own_training_data(tmp_path, monkeypatch):
    """collect/fit without --data read the run's train.train_data and max_docs from its
    resolved config (relative paths from the current folder or the project, made
    absolute); --data and --max-docs override; a model folder without --data is a
    ConfigError naming --data. Breaks if a cwd-relative corpus default comes back."""
    import json

    from dattri_ds.tools.provenance import training_data
    from dattri_ds.tools.sources import HFModelDir, Run

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model/config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "own.jsonl").write_text("")
    (run / "resolved_dattri_ds_config.json").write_text(json.dumps(
        {"train": {"train_data": ["own.jsonl"], "max_docs": 200, "seq_len": 16}}))
    monkeypatch.chdir(tmp_path)
    own = str(tmp_path / "own.jsonl")
    got = training_data("--data", None, source=Run.open(run))
    assert (got.data, got.max_docs, got.where) == (own, 200, "the run's training data")
    assert got.record == (run / "resolved_dattri_ds_config.json", "train.train_data")
    assert got.describe(3) == f"{own} (3 documents, the run's training data)"
    assert training_data("--data", None, max_docs=50, source=Run.open(run)).max_docs == 50
    got = training_data("--data", "other.jsonl", source=Run.open(run))
    assert (got.data, got.max_docs, got.record) == ("other.jsonl", None, None)
    assert got.describe(2) == "other.jsonl (2 documents)"
    (tmp_path / "own.jsonl").unlink()
    with pytest.raises(ConfigError, match="own.jsonl.*--data"):
        training_data("--data", None, source=Run.open(run))
    with pytest.raises(ConfigError, match="--data is needed"):
        training_data("--data", None, source=HFModelDir(tmp_path / "hf"))


def test_one_resolver_reads_every_record_in_order(tmp_path, monkeypatch):
    """``tools.provenance.training_data`` is the one place the training documents are
    found: an attribution's own --train-data first, else the store it read, whose collect
    record (in the store folder or its parent) names --data and the seq_len; a given flag
    keeps that seq_len; nothing recorded names the flag. Breaks if attribute, report and
    curate resolve them differently again."""
    import json

    from dattri_ds.tools.provenance import training_data, write_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("")
    grads, att = tmp_path / "grads", tmp_path / "att"
    (grads / "step2").mkdir(parents=True)
    write_config(grads, "collect", argparse.Namespace(data="a.jsonl", max_docs=7, seq_len=12))
    for store in (grads, grads / "step2"):  # a folder of stores, or one store in it
        got = training_data("--pool", None, store=store)
        assert (got.files, got.max_docs, got.seq_len, got.where) == (
            (str(tmp_path / "a.jsonl"),), 7, 12, "collect's --data")
    assert training_data("--train-data", "b.jsonl", store=grads).seq_len == 12
    write_config(att, "attribute", argparse.Namespace(train_data=None, store=str(grads)))
    assert training_data("--train-data", None, attribution=att).data == str(tmp_path / "a.jsonl")
    write_config(att, "attribute", argparse.Namespace(train_data="b.jsonl", store=str(grads)))
    assert training_data("--train-data", None, attribution=att).data == str(tmp_path / "b.jsonl")
    (att / "attribute_config.json").write_text(json.dumps({"store": str(tmp_path / "none")}))
    with pytest.raises(ConfigError, match="--train-data is needed.*attribute_config.json"):
        training_data("--train-data", None, attribution=att)
