"""launch/train.py's start checks: inputs nobody here wrote, each one `dattri-ds: error:` line.

Invariants: a bad input is refused before any process group or file of the run exists, by
one line that names the input (flag and value) and a fix that works: a sequence longer than
the model's positions (both numbers named), a target or held-out file of whitespace only,
an ``--init-from`` run without a tokenizer (or ``--init-checkpoint`` alone), and a
``--resume`` whose checkpoint was deleted or half written (only checkpoints that exist are
listed, and ``latest`` is suggested only when it would work). Ranks of one launch that fail
alike print the line once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dattri_ds.cli.exits import run
from dattri_ds.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _errors(capsys, argv: list[str]) -> tuple[int, list[str]]:
    from dattri_ds.launch.train import main

    code = run(main, argv)
    err = capsys.readouterr().err
    return code, [ln for ln in err.splitlines() if ln.startswith("dattri-ds: error: ")]


def _base(tmp: Path, *extra: str, positions: int = 256) -> list[str]:
    (tmp / "model.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16,
         "n_positions": positions}))
    return ["--backend", "torch", "--deepspeed_config", str(ROOT / "configs/zero0_cpu.json"),
            "--model-config", str(tmp / "model.json"), "--train-data",
            str(ROOT / "data/tiny/train.jsonl"), "--out", str(tmp / "run"), *extra]


def _docs(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "source": "s", "title": "t",
                                        "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def test_seq_len_longer_than_the_model_is_refused_naming_both(tmp_path, capsys):
    """`--seq-len 100000` on a model of 256 positions: one line with both numbers, the
    model config and the fix (not an IndexError at the first forward, nor the planner's
    memory verdict); nothing written."""
    code, errors = _errors(capsys, _base(tmp_path, "--seq-len", "100000"))
    assert code == 2 and len(errors) == 1, errors
    assert "--seq-len 100000" in errors[0] and "256 positions" in errors[0]
    assert "model.json" in errors[0] and "--seq-len 256 or less" in errors[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("score", ["content", "alignment"])
def test_whitespace_target_is_refused_at_start(tmp_path, capsys, score):
    """A --target-data file whose texts are all whitespace would rank candidates against an
    empty target (content and gradient scores alike): refused at start, naming the flag and
    the file. A held-out --eval-data file of whitespace likewise."""
    blank = _docs(tmp_path / "blank.jsonl", ["   ", "\n\t\n", " "])
    code, errors = _errors(capsys, _base(tmp_path, "--online-selection", "--target-data",
                                         str(blank), "--selection-score", score))
    assert code == 2 and len(errors) == 1, errors
    assert f"--target-data {blank}" in errors[0] and "whitespace" in errors[0]
    assert not (tmp_path / "run").exists()
    code, errors = _errors(capsys, _base(tmp_path, "--eval-every", "1", "--eval-data",
                                         str(blank)))
    assert code == 2 and f"--eval-data {blank}" in errors[0], errors
    mixed = _docs(tmp_path / "mixed.jsonl", [" ", "\n", "a real target text"])
    code, errors = _errors(capsys, _base(tmp_path, "--online-selection", "--target-data",
                                         str(mixed), "--target-max-docs", "2"))
    assert code == 2 and "the 2 texts it reads (documents 0..1)" in errors[0], errors
    code, errors = _errors(capsys, _base(tmp_path, "--online-selection", "--target-data",
                                         str(mixed), "--eval-every", "1"))  # eval skips 64
    assert code == 2 and "holds 3 documents" in errors[0] and "--eval-skip" in errors[0]


def test_init_from_refusals(tmp_path, capsys):
    """--init-from a folder without a tokenizer, and --init-checkpoint without
    --init-from, are one line each naming the flag and the fix."""
    (tmp_path / "empty").mkdir()
    code, errors = _errors(capsys, _base(tmp_path, "--init-from", str(tmp_path / "empty")))
    assert code == 2 and len(errors) == 1, errors
    assert "has no tokenizer" in errors[0] and "--out folder of a launch" in errors[0]
    code, errors = _errors(capsys, _base(tmp_path, "--init-checkpoint", "latest"))
    assert code == 2 and "pass --init-from RUN_DIR" in errors[0], errors
    code, errors = _errors(capsys, _base(tmp_path, "--init-from", str(tmp_path / "nope")))
    assert code == 2 and str(tmp_path / "nope") in errors[0], errors


def _run_folder(tmp: Path, listed: list[str], folders: list[str]) -> Path:
    for tag in folders:
        (tmp / "checkpoints" / tag).mkdir(parents=True)
    (tmp / "trajectory.json").write_text(json.dumps(
        {"checkpoints": [{"tag": t, "step": int(t[4:]), "lr": 0.1} for t in listed],
         "lrs": []}))
    return tmp


def test_resume_latest_after_the_latest_checkpoint_was_deleted(tmp_path):
    """trajectory.json lists step2 and step4, step4's folder was deleted: `--resume latest`
    fails listing only step2 and suggesting `--resume step2` (not `latest`, which just
    failed); `--resume step2` works."""
    from dattri_ds.launch.resume import resume_tag

    out = _run_folder(tmp_path, ["step2", "step4"], ["step2"])
    with pytest.raises(ConfigError) as e:
        resume_tag(out, "latest")
    msg = str(e.value)
    assert "'step4'" in msg and "missing" in msg and "exist: ['step2']" in msg
    assert "pass --resume step2" in msg and "--resume latest to" not in msg
    assert resume_tag(out, "step2") == "step2"
    with pytest.raises(ConfigError, match=r"\['step2'\]") as e:
        resume_tag(out, "step4")
    assert "'latest'" not in str(e.value)


def test_half_written_checkpoint_is_skipped(tmp_path):
    """A checkpoint folder that trajectory.json does not list was being written when the run
    stopped: `latest` is the newest listed one; naming it explicitly is refused with the
    complete ones; with none complete, `latest` restarts at step 0 (None) when the folder
    holds a run, and is refused when it holds none."""
    from dattri_ds.launch.resume import Checkpoints, resume_tag

    out = _run_folder(tmp_path / "a", ["step2"], ["step2", "step4"])
    assert resume_tag(out, "latest") == "step2"
    assert Checkpoints.of(out).incomplete == ("step4",)
    with pytest.raises(ConfigError, match=r"step4 is incomplete.*\['step2'\].*--resume step2"):
        resume_tag(out, "step4")
    first = tmp_path / "b"
    (first / "checkpoints" / "step4").mkdir(parents=True)
    assert resume_tag(first, "latest") is None
    (tmp_path / "c").mkdir()
    with pytest.raises(ConfigError, match="holds no run to continue"):
        resume_tag(tmp_path / "c", "latest")


def test_errors_of_one_launch_print_once(tmp_path, monkeypatch):
    """Ranks of one launch (same parent, same rendezvous) reporting the same line: the first
    prints it, the others do not; another line, another launch or a single process prints."""
    from dattri_ds.cli.noise import first_report

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert first_report("x") is True and first_report("x") is True  # one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "12345")
    assert first_report("line a") is True
    assert first_report("line a") is False
    assert first_report("line b") is True
    monkeypatch.setenv("MASTER_PORT", "12346")
    assert first_report("line a") is True


def test_warnings_of_one_launch_show_once(tmp_path, monkeypatch):
    """warn_once_per_launch: with two ranks of one launch warning the same text, the text is
    shown once; another text is shown; a single process shows every warning."""
    import warnings

    from dattri_ds.cli.noise import warn_once_per_launch

    shown: list[str] = []
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(warnings, "showwarning", lambda m, *a, **k: shown.append(str(m)))
    warn_once_per_launch()
    warn_once_per_launch()  # idempotent: one wrapper
    texts = ("unknown key 'x'", "unknown key 'x'", "unknown key 'y'")
    for text in texts:  # a single process: every one
        warnings.showwarning(UserWarning(text), UserWarning, "ds.json", 1)
    assert shown == list(texts)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "23456")
    for text in texts:  # what warnings.warn calls on each rank
        warnings.showwarning(UserWarning(text), UserWarning, "ds.json", 1)
    assert shown[3:] == ["unknown key 'x'", "unknown key 'y'"]


# ---- --resume checks what it resumes (backend, ZeRO stage, layout, model) ------------------
def _checkpoint(out: Path, run: dict, files: tuple[str, ...], layout: dict | None = None,
                tag: str = "step2") -> Path:
    """A run folder whose trajectory lists ``tag``: the loop's state (recording ``run`` and
    ``layout``) and small torch files named as a backend names them."""
    import torch

    from dattri_ds.launch.resume import LoopState
    from dattri_ds.launch.runlog import RunRecord

    folder = out / "checkpoints" / tag
    folder.mkdir(parents=True)
    for name in files:
        torch.save({"x": torch.zeros(4)}, folder / name)
    LoopState(step=2, record=RunRecord(), rng={}, layout=layout or {"dp": 1, "tp": 1},
              run=run).save(folder, 0)
    (out / "trajectory.json").write_text(json.dumps(
        {"checkpoints": [{"tag": tag, "step": 2, "lr": 0.1}], "lrs": []}))
    return folder


def _snapshot(out: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in sorted(out.rglob("*"))}


DS_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


def _record(tmp: Path, backend: str, stage: int | None, **model) -> dict:
    from dattri_ds.launch.args import load_run_config
    from dattri_ds.launch.resume import run_record

    _, cfg = load_run_config(ROOT / "configs/zero0_cpu.json", {
        ("train", "model_config"): str(tmp / "model.json"), ("engine", "backend"): backend})
    rec = run_record(cfg, stage)
    rec["model"]["config"] = {**rec["model"]["config"], **model}
    return rec


def test_resume_on_another_backend_is_one_line_before_any_engine(tmp_path, capsys):
    """A --backend torch checkpoint resumed with --backend deepspeed (the case that died
    with DeepSpeed's bare AssertionError): one line naming both backends and the fixes
    (--backend torch, or --init-from its weights), the run folder untouched."""
    argv = _base(tmp_path, "--resume", "latest")  # writes model.json
    out = tmp_path / "run"
    _checkpoint(out, _record(tmp_path, "torch", None),
                ("training_state.pt",))
    before = _snapshot(out)
    argv[argv.index("torch")] = "deepspeed"
    code, errors = _errors(capsys, argv)
    assert code == 2 and len(errors) == 1, errors
    for needle in ("--resume step2", "written by --backend torch", "--backend deepspeed",
                   "pass --backend torch", f"--init-from {out} --init-checkpoint step2"):
        assert needle in errors[0], (needle, errors[0])
    assert _snapshot(out) == before


def test_resume_checks_zero_stage_layout_and_model(tmp_path, monkeypatch):
    """ZeRO 3 -> 2 and a ZeRO-0 checkpoint on another world size are refused (DeepSpeed's
    universal checkpoint converts neither), ZeRO 1 -> 2 is accepted (converted); a Megatron
    checkpoint of TP=2 on TP=1, a model config that differs (the key and both values named),
    and an old checkpoint without a record (the backend read from its files) are refused."""
    from dattri_ds.launch.args import load_run_config
    from dattri_ds.launch.resume import check_resume

    _base(tmp_path)  # model.json
    flags = {("train", "model_config"): str(tmp_path / "model.json"),
             ("train", "resume"): "latest"}

    def check(out: Path, config: str, backend: str = "deepspeed") -> str | None:
        ds, cfg = load_run_config(ROOT / f"configs/{config}.json",
                                  {**flags, ("engine", "backend"): backend})
        try:
            check_resume(cfg, out, ds)
        except ConfigError as e:
            return str(e)
        return None

    z3 = tmp_path / "z3"
    _checkpoint(z3, _record(tmp_path, "deepspeed", 3), DS_FILES)
    msg = check(z3, "zero2_cpu")
    assert "ZeRO stage 3, this run has stage 2" in msg and "stages 1 and 2" in msg, msg
    assert check(z3, "zero3_cpu") is None
    z1 = tmp_path / "z1"
    _checkpoint(z1, _record(tmp_path, "deepspeed", 1), DS_FILES)
    assert check(z1, "zero2_cpu") is None
    z0 = tmp_path / "z0"
    _checkpoint(z0, _record(tmp_path, "deepspeed", 0), DS_FILES[:1], layout={"dp": 2, "tp": 1})
    msg = check(z0, "zero0_cpu")
    assert "under ZeRO stage 0" in msg and "{'dp': 2, 'tp': 1}" in msg, msg
    tp2 = tmp_path / "tp2"
    _checkpoint(tp2, _record(tmp_path, "megatron", None), ("megatron_consolidated.pt",),
                layout={"dp": 1, "tp": 2})
    msg = check(tp2, "zero1_cpu", "megatron")
    assert "written with the process layout {'dp': 1, 'tp': 2}" in msg, msg
    wide = tmp_path / "wide"
    _checkpoint(wide, _record(tmp_path, "deepspeed", 3, n_embd=64), DS_FILES)
    msg = check(wide, "zero3_cpu")
    assert "another model: n_embd=64 there, 16 here" in msg and "--model-config" in msg, msg
    family = tmp_path / "family"  # another family: its kind leads, the rest are counted
    _checkpoint(family, _record(tmp_path, "deepspeed", 3, model_type="llama", a=1, b=2, c=3,
                                d=4, e=5), DS_FILES)
    msg = check(family, "zero3_cpu")
    assert "another model: model_type='llama' there, 'gpt2' here; a=1 there" in msg, msg
    assert "(and 2 more). Fix: pass the --model-config" in msg, msg
    old = tmp_path / "old"
    _checkpoint(old, {}, DS_FILES)
    msg = check(old, "zero0_cpu", "torch")
    assert "written by --backend deepspeed" in msg, msg
