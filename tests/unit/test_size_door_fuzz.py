"""Fuzz the size door: a huge value of any size-like setting ends launch at start.

Invariant: every size-like leaf of the ``"dattri_ds"`` block (token, vocabulary, document,
row, batch, candidate, step and byte counts), set to an absurd value, is refused while the
config is parsed (its declared range): exit 2, exactly one ``dattri-ds: error:`` line naming
the key, no traceback, no raw exception class. A value inside the declared range that
cannot fit in this machine's memory (a sequence of 2^20 tokens, 1000 candidates per
example, a micro-batch of 10^6) is refused by the planner at start, naming the knob (JSON
key and flag), the need and the limit; ``--skip-memory-check`` lets an expert run it anyway.
Parse and plan only: nothing trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _doors import ROOT, classify, failures, in_process, tally

from dattri_ds.io import schema
from dattri_ds.launch.args import flag_name, load_run_config, parse_args
from dattri_ds.launch.config import RunConfig

#: Numeric leaves that are not sizes (seeds, label values, scales, scores, shares).
NOT_SIZES = {"train.seed", "capture.ignore_index", "capture.backward_scale",
             "capture.label_shift", "capture.projection.seed", "selection.projection.seed",
             "capture.projection.kron_speedup", "selection.projection.kron_speedup",
             "selection.content_weight", "selection.uniform_mix"}


def size_leaves() -> list[schema.Leaf]:
    out = []
    for leaf in schema.leaves(RunConfig):
        members, _ = schema._split_optional(leaf.hint)
        if members[0] in (int, float) and leaf.key not in NOT_SIZES:
            out.append(leaf)
    return out


def _start(argv: list[str]) -> None:
    """What launch does at start before any process group or model exists."""
    args = parse_args(argv)
    load_run_config(args.deepspeed_config, args.overrides)


#: The shipped tiny GPT-2 with 2^20 positions: long sequences reach the planner (the tiny
#: model's own 256 positions refuse them first, naming --seq-len: tests/unit/test_launch_inputs.py).
LONG = {"model_type": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 128, "n_positions": 2 ** 20}


def _long_model(tmp: Path) -> str:
    path = tmp / "model_long.json"
    path.write_text(json.dumps(LONG))
    return str(path)


def _ds(tmp: Path, block: dict, micro: int = 2) -> str:
    cfg = json.loads((ROOT / "configs/zero2_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=1)
    cfg.setdefault("dattri_ds", {}).update(block)
    path = tmp / f"ds{len(list(tmp.iterdir()))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _nest(path: tuple[str, ...], value) -> dict:
    for k in reversed(path):
        value = {k: value}
    return value


SELECT = {"selection": {"enabled": True, "target_data": str(ROOT / "data/tiny/target.jsonl")}}


def _cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    cases = []
    for leaf in size_leaves():
        members, _ = schema._split_optional(leaf.hint)
        for huge in ((10 ** 12, 10 ** 30) if members[0] is int else (1e12, 1e300)):
            block = _nest(leaf.path, huge)
            # engine sizes are cross-checked by their flags (launch/engine.py names those)
            needle = flag_name(leaf) if leaf.path[0] == "engine" else f"dattri_ds.{leaf.key}"
            cases.append((f"{leaf.key}={huge:g}", ["--deepspeed_config", _ds(tmp, block)],
                          needle))
    long = _long_model(tmp)
    plan = [("train.seq_len 2^20", {"train": {"seq_len": 2 ** 20, "model_config": long}}, 2,
             "train.seq_len"),
            # the gradient probe forwards every candidate (content scoring forwards none)
            ("candidate_multiple 1000 (probe)", {**SELECT, "selection": {
                **SELECT["selection"], "candidate_multiple": 1000.0, "score": "alignment"},
              "train": {"seq_len": 1024, "model_config": long}}, 64,
             "selection.candidate_multiple"),
            ("micro-batch 10^6", {}, 10 ** 6, "train_micro_batch_size_per_gpu")]
    for name, block, micro, needle in plan:
        cases.append((f"planner: {name}", ["--deepspeed_config", _ds(tmp, block, micro)],
                      needle))
    return cases


def test_size_door(tmp_path):
    """Every huge size ends at start with one clear line naming its key; prints the tally."""
    results = []
    for name, argv, needle in _cases(tmp_path):
        code, err = in_process(_start, argv)
        results.append((name, classify(code, err, needle), err))
    print("size door:", tally(results))
    assert not failures(results), "\n".join(failures(results))


def test_planner_message_names_knob_need_limit_and_override(tmp_path):
    """The planner's refusal names the JSON key, its flag, the bytes needed and available,
    and the expert override; with the override the same config is accepted."""
    argv = ["--deepspeed_config", _ds(tmp_path, {"train": {"seq_len": 2 ** 20,
                                                           "model_config": _long_model(tmp_path)}})]
    code, err = in_process(_start, argv)
    line = err.strip().splitlines()[-1]
    assert code == 2, err
    for word in ("dattri_ds.train.seq_len", "--seq-len", "GB", "available",
                 "--skip-memory-check"):
        assert word in line, (word, line)
    code, err = in_process(_start, [*argv, "--skip-memory-check"])
    assert code == 0, err


@pytest.mark.parametrize("block", [{}, {"train": {"seq_len": 256}}, SELECT,
                                   {"capture_enabled": True}])
def test_ordinary_runs_pass_the_planner(tmp_path, block):
    """The shipped settings and ordinary variations are not refused (no false alarm)."""
    code, err = in_process(_start, ["--deepspeed_config", _ds(tmp_path, block)])
    assert code == 0, err


@pytest.mark.parametrize("flags,needle", [({"batch_size": 10 ** 6}, "--batch-size"),
                                          ({"batch_size": 8}, "--seq-len")])
def test_tools_ask_the_planner(tmp_path, flags, needle):
    """collect/fit run ``plan.check_tool`` at start: a batch of 10^6 examples or sequences
    of 2^22 tokens of a GPT-2 config cannot fit, and the refusal names the flag; with
    ``--skip-memory-check`` (or ordinary sizes) it passes."""
    from argparse import Namespace

    from transformers import GPT2Config

    from dattri_ds.plan import check_tool

    GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000).save_pretrained(tmp_path)
    seq = 2 ** 22 if needle == "--seq-len" else 256
    args = Namespace(projection_dim=64, projection="sparse", skip_memory_check=False, **flags)
    code, err = in_process(lambda argv: check_tool(tmp_path, args, seq_len=seq,
                                                   examples=10 ** 6), [])
    assert classify(code, err, needle) == "clear" and code == 2, err
    args.skip_memory_check = True
    assert check_tool(tmp_path, args, seq_len=seq, examples=10 ** 6) is None
    small = Namespace(projection_dim=64, projection="sparse", skip_memory_check=False,
                      batch_size=8)
    assert check_tool(tmp_path, small, seq_len=256, examples=100).fits


@pytest.mark.parametrize("cap", [0, 1 << 20, 1 << 33])
def test_memory_check_plans_the_run_projection_cache(tmp_path, monkeypatch, cap):
    """Launch's memory check plans the projection matrices under the run's own
    ``capture.projection.cache_bytes`` (the planner caps resident matrices there)."""
    import dattri_ds.plan as plan

    seen = []
    monkeypatch.setattr(plan, "check_fits", lambda model, spec, *a, **k: seen.append(spec))
    _start(["--deepspeed_config", _ds(tmp_path, {"capture_enabled": True}),
            "--capture-projection-cache-bytes", str(cap)])
    assert [s.projection_cache_bytes for s in seen] == [cap]
