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
    """--init-from a folder without tokenizer.model, and --init-checkpoint without
    --init-from, are one line each naming the flag and the fix."""
    (tmp_path / "empty").mkdir()
    code, errors = _errors(capsys, _base(tmp_path, "--init-from", str(tmp_path / "empty")))
    assert code == 2 and len(errors) == 1, errors
    assert "has no tokenizer.model" in errors[0] and "--out folder of a launch" in errors[0]
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
