"""Fuzz the output door: every path a tool or launch writes is checked at start, and a write
that fails halfway (disk full) is one line that loses nothing committed.

Invariant: an output path that is an existing file where a folder is expected (or a folder
where a file is), lies under a file, cannot be created (``/sys``: refused even to root),
or would overwrite an earlier result without ``--force`` ends the command at start with
exit 2 and exactly one ``dattri-ds: error:`` line naming the path (or ``--force``), no
traceback, no raw exception class. A write that runs out of space (a small RLIMIT_FSIZE,
SIGXFSZ ignored so ``write`` returns EFBIG) ends with exit 1 and one line naming the path
and saying that nothing committed was lost, and the resumed collect loses no committed row.
Covered: collect ``--out`` and its per-checkpoint store path, attribute ``--out``, fit
``--out``, report's attribution folder (and its writes), launch ``--out`` and ``store.path``.
"""

from __future__ import annotations

import json
import resource
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from _doors import ROOT, classify, failures, in_process, subprocess_cli, tally

UNWRITABLE = "/sys/dattri_ds_door_test/out"  # EPERM even for root


def _tiny_model(path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                               n_head=2)).save_pretrained(path)
    return path


def _tokens(path: Path, n: int) -> str:
    g = torch.Generator().manual_seed(1)
    with open(path, "w") as fh:
        for i in range(n):
            ids = torch.randint(4, 64, (9,), generator=g).tolist()
            fh.write(json.dumps({"id": f"t{i}", "input_ids": ids}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny model folder, token-id data and queries, a collected store, an attribution
    and a factors file (the earlier results the overwrite cases would clobber)."""
    from dattri_ds.tools import attribute, collect, fit

    tmp = tmp_path_factory.mktemp("doors")
    e = {"tmp": tmp, "model": str(_tiny_model(tmp / "m")),
         "data": _tokens(tmp / "data.jsonl", 16), "queries": _tokens(tmp / "q.jsonl", 2)}
    e["file"] = tmp / "a_file"
    e["file"].write_text("x")
    e["store"] = tmp / "grads"
    code, err = in_process(collect.main, _collect_argv(e, e["store"]))
    assert code == 0, err
    e["attr"] = tmp / "attr"
    code, err = in_process(attribute.main, _attr_argv(e, e["attr"]))
    assert code == 0, err
    e["factors"] = tmp / "f.pt"
    code, err = in_process(fit.main, _fit_argv(e, e["factors"]))
    assert code == 0, err
    return e


def _collect_argv(e, out, *extra) -> list[str]:
    return ["--model", e["model"], "--data", e["data"], "--out", str(out),
            "--projection-dim", "16", "--batch-size", "4", "--flush-every", "4", *extra]


def _attr_argv(e, out, *extra) -> list[str]:
    return ["--model", e["model"], "--store", str(e["store"]), "--queries", e["queries"],
            "--method", "graddot", "--out", str(out), *extra]


def _fit_argv(e, out, *extra) -> list[str]:
    return ["--model", e["model"], "--data", e["data"], "--kfac-only", "--out", str(out),
            *extra]


def _tool_cases(e) -> list[tuple[str, object, list[str], str]]:
    """(name, tool main, argv, needle) of every in-process output case."""
    from dattri_ds.tools import attribute, collect, fit, report

    f, tmp = e["file"], e["tmp"]
    under = f / "sub" / "out"
    tag_file = tmp / "tagfile_root"
    tag_file.mkdir(exist_ok=True)
    (tag_file / Path(e["model"]).name).write_text("x")  # the store path <out>/<tag> is a file
    dir_pt = tmp / "folder.pt"
    dir_pt.mkdir(exist_ok=True)
    bad_report = tmp / "attr_copy"
    if not bad_report.exists():
        shutil.copytree(e["attr"], bad_report)
        (bad_report / "report.md").mkdir()  # the report file is a folder
    return [
        ("collect --out existing file", collect.main, _collect_argv(e, f), str(f)),
        ("collect --out under a file", collect.main, _collect_argv(e, under), str(f)),
        ("collect --out unwritable", collect.main, _collect_argv(e, UNWRITABLE), "/sys"),
        ("collect store path is a file", collect.main, _collect_argv(e, tag_file),
         str(tag_file / Path(e["model"]).name)),
        ("attribute --out existing file", attribute.main, _attr_argv(e, f), str(f)),
        ("attribute --out under a file", attribute.main, _attr_argv(e, under), str(f)),
        ("attribute --out unwritable", attribute.main, _attr_argv(e, UNWRITABLE), "/sys"),
        ("attribute --out overwrites", attribute.main, _attr_argv(e, e["attr"]), "--force"),
        ("fit --out is a folder", fit.main, _fit_argv(e, dir_pt), str(dir_pt)),
        ("fit --out under a file", fit.main, _fit_argv(e, under / "f.pt"), str(f)),
        ("fit --out unwritable", fit.main, _fit_argv(e, UNWRITABLE + "/f.pt"), "/sys"),
        ("fit --out overwrites", fit.main, _fit_argv(e, e["factors"]), "--force"),
        ("report file is a folder", report.main,
         ["--attribution", str(bad_report), "--train-data", e["data"]],
         str(bad_report / "report.md")),
    ]


def _launch_cases(e) -> list[tuple[str, list[str], str]]:
    cfg = json.loads((ROOT / "configs/zero2_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    path = e["tmp"] / "ds.json"
    path.write_text(json.dumps(cfg))
    small = ["--train-data", str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "16",
             "--seq-len", "16", "--vocab-size", "128", "--steps", "1"]
    old = e["tmp"] / "old_run"
    old.mkdir(exist_ok=True)
    (old / "trajectory.json").write_text(json.dumps({"checkpoints": [], "lrs": []}))
    f, base = e["file"], [str(ROOT / "launch/train.py"), "--deepspeed_config", str(path)]
    return [
        ("launch --out existing file", [*base, "--out", str(f), *small], str(f)),
        ("launch --out under a file", [*base, "--out", str(f / "run"), *small], str(f)),
        ("launch --out unwritable", [*base, "--out", UNWRITABLE, *small], "/sys"),
        ("launch --out holds a run", [*base, "--out", str(old), *small], "--force"),
        ("launch store.path is a file", [*base, "--out", str(e["tmp"] / "r2"), "--capture",
                                         "--store-path", str(f), *small], str(f)),
    ]


def _fsize_limit(nbytes: int):
    def limit() -> None:  # in the child: write() past the limit returns EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


def _disk_full_cases(e) -> list[tuple[str, list[str], int, str]]:
    cli = "-m dattri_ds.tools.cli".split()
    tmp = e["tmp"]
    report_dir = tmp / "attr_full"
    if not report_dir.exists():
        shutil.copytree(e["attr"], report_dir)
    return [
        ("report disk full", [*cli, "report", "--attribution", str(report_dir),
                              "--train-data", e["data"]], 200, str(report_dir)),
        ("collect disk full", [*cli, "collect", *_collect_argv(e, tmp / "full")], 6000,
         str(tmp / "full")),
        ("fit disk full", [*cli, "fit", *_fit_argv(e, tmp / "full_f.pt")], 4000,
         str(tmp / "full_f.pt")),
        ("attribute disk full", [*cli, "attribute", *_attr_argv(e, tmp / "full_attr")], 100,
         str(tmp / "full_attr")),
    ]


def test_output_door(env):
    """Every output case ends in one clear line (exit 2 at start, exit 1 for a full disk
    that also says nothing committed was lost); prints the tally."""
    results = []
    for name, main, argv, needle in _tool_cases(env):
        code, err = in_process(main, argv)
        results.append((name, classify(code, err, needle), err))
    from dattri_ds.launch import train

    for name, argv, needle in _launch_cases(env):  # refused before any process group
        code, err = in_process(train.main, argv[1:])
        results.append((name, classify(code, err, needle), err))
    for name, argv, limit, needle in _disk_full_cases(env):
        code, err = subprocess_cli(argv, preexec_fn=_fsize_limit(limit))
        verdict = classify(code, err, needle)
        if verdict == "clear" and "nothing committed was lost" not in err:
            verdict = "raw"
        results.append((name, verdict, err))
    print("output door:", tally(results))
    for name, _, err in results:
        print(f"  {name}: {err.strip().splitlines()[-1][:300]}")
    assert not failures(results), "\n".join(failures(results))


def test_force_overwrites_and_accepted_outputs(env):
    """``--force`` lets attribute and fit replace an earlier result; a fresh nested --out is
    created (known-good outputs stay accepted)."""
    from dattri_ds.tools import attribute, fit

    code, err = in_process(attribute.main, _attr_argv(env, env["attr"], "--force"))
    assert code == 0, err
    code, err = in_process(fit.main, _fit_argv(env, env["factors"], "--force"))
    assert code == 0, err
    code, err = in_process(attribute.main, _attr_argv(env, env["tmp"] / "new/deep/attr"))
    assert code == 0, err


def test_disk_full_collect_resumes_without_losing_committed_rows(env):
    """A collect that hits a full disk keeps every row it committed: the resumed run (no
    limit) ends with all 16 examples, the rows committed before the failure unchanged."""
    from dattri_ds.store import GradientStore

    out = env["tmp"] / "full_resume"
    argv = ["-m", "dattri_ds.tools.cli", "collect", *_collect_argv(env, out)]
    code, err = subprocess_cli(argv, preexec_fn=_fsize_limit(6000))
    assert code == 1, err
    store_path = out / Path(env["model"]).name
    with GradientStore.open(store_path) as s:
        before = dict(zip(s.ids, s.read(slice(None)).numpy()))
    assert 0 < len(before) < 16, len(before)
    code, err = subprocess_cli(argv)
    assert code == 0, err
    with GradientStore.open(store_path) as s:
        after = dict(zip(s.ids, s.read(slice(None)).numpy()))
    assert len(after) == 16
    for sid, row in before.items():
        np.testing.assert_array_equal(after[sid], row)


def test_a_refusal_after_the_output_door_leaves_no_new_folder(tmp_path):
    """A command refused after its ``--out`` was checked (created) removes the folders it
    created while they are empty; a folder that existed before, or that holds a file, stays."""
    from dattri_ds.cli.exits import run
    from dattri_ds.errors import ConfigError
    from dattri_ds.io.outputs import check_dir

    def refused(out: Path, keep: bool):
        def main(argv):
            check_dir(out, flag="--out")
            if keep:
                (out / "written").write_text("x")
            raise ConfigError("--data-path x was prepared with another tokenizer. Fix: y")
        return main

    assert run(refused(tmp_path / "new" / "out", False), []) == 2
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    assert run(refused(tmp_path / "old" / "out", False), []) == 2
    assert (tmp_path / "old").is_dir() and not (tmp_path / "old" / "out").exists()
    assert run(refused(tmp_path / "kept", True), []) == 2
    assert (tmp_path / "kept" / "written").is_file()
