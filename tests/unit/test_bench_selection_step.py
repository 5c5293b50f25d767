"""benchmarks/selection_step.py times the shipped loop, not a loop of its own.

Invariants: the benchmark's report has every phase and a positive selection/plain ratio;
and the two runs it times (two threads taking turns, backend and selector instrumented)
train exactly what ``launch.train.train_in_process`` trains on the same config and data:
the same chosen examples at every step and the same losses, so its numbers are those of
the code users run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "dist"))
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")  # the lr schedule of configs/zero3_cpu.json

from benchmarks import selection_step as S  # noqa: E402

ARGV = ["--quick", "--steps", "2", "--warmup", "1", "--set", "score=alignment",
        "--set", "candidate_multiple=2"]


def _reference(rank: int, world: int, argv: list[str], out: str) -> dict:
    """Both configs of the benchmark, each trained by ``train_in_process``."""
    from dattri_ds.launch.train import train_in_process

    args = S.parse_args(argv)
    ds, plain, sel, data, tok, target = S.run_inputs(args, 1, Path(out) / "inputs")
    for name, cfg in (("plain", plain), ("selection", sel)):
        train_in_process(ds, cfg, data, tok, Path(out) / name, target=target)
    return {}


def _trained(folder: Path) -> tuple[list[float], list[list[str]] | None]:
    losses = [r["loss"] for r in json.loads((folder / "trajectory.json").read_text())["lrs"]]
    log = folder / "selection.jsonl"
    chosen = [json.loads(line)["chosen"] for line in log.read_text().splitlines()] \
        if log.exists() else None
    return losses, chosen


@pytest.mark.slow
def test_report_has_every_phase_and_trains_what_the_loop_trains(tmp_path, capsys):
    """Every phase row and both ratios > 0; plain and selection runs equal train_in_process's
    (losses to 1e-6, chosen ids exactly)."""
    import _dist

    S.main([*ARGV, "--keep", str(tmp_path / "bench")])
    printed = capsys.readouterr().out
    for phase in (*S.PHASES, "total"):
        assert any(line.strip().startswith(phase + " ") for line in printed.splitlines()), \
            (phase, printed)
    ratios = json.loads(printed.strip().splitlines()[-1])
    assert ratios["ratio_mean"] > 0 and ratios["ratio_median"] > 0
    assert ratios["resolved"]["score"] == "alignment"

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _dist.run(_reference, world_size=1, timeout=300, argv=ARGV, out=str(tmp_path / "ref"))
    for name in ("plain", "selection"):
        got_loss, got_chosen = _trained(tmp_path / "bench" / "rank0" / name)
        want_loss, want_chosen = _trained(tmp_path / "ref" / name)
        assert len(got_loss) == 3  # warm-up + measured steps
        assert got_loss == pytest.approx(want_loss, abs=1e-6), name
        assert got_chosen == want_chosen, name
    assert _trained(tmp_path / "bench" / "rank0" / "selection")[1] is not None
