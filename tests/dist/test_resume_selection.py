"""Resume with online selection: a run stopped and resumed == an uninterrupted run, bit for bit.

Invariant: ``--resume`` with ``--online-selection`` restores, next to the weights, optimizer,
schedule, step and RNG (tests/dist/test_resume.py), the selector's state (smoothing memory,
content-prior stream counts, the target's cached rows and refresh clock, the uniform
baseline's draw counter, the statistics) and continues its log, so the resumed run chooses
exactly what the uninterrupted one chooses: equal per-step losses, equal
``selection.jsonl`` records (chosen ids and scores), equal selection summary and equal final
weights (``torch.equal``). The gradient runs stop between two target refreshes
(``refresh_every`` 3, stop at step 2), so recomputing the cached target instead of
restoring it would change the choices of step 2. Checked for ``--backend torch`` (one
process; the gradient score ``score="alignment"`` with smoothing and the content prior, the
same with another uniform share and no forward reuse, the content score, the cascade's
shortlist, the seeded uniform baseline) and ``--backend deepspeed`` ZeRO-3 on 2 gloo ranks
(the gradient score, per-rank logs). Breaks when any component is not restored, e.g. a fresh
smoothing memory or content-prior stream after the resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _deps import require

from _dist import run

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
STEPS, HALF = 4, 2


def _train(rank, world, argv):
    from dattri_ds.launch.train import main

    return main(argv)


def _argv(tmp: Path, backend: str, out: Path, steps: int, *extra: str) -> list[str]:
    cfg = json.loads((ROOT / "configs/zero3_cpu.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    cfg["optimizer"]["params"]["lr"] = 0.01
    cfg["scheduler"]["params"].update(warmup_num_steps=2, total_num_steps=8)
    cfg["dattri_ds"] = {}
    (tmp / "ds.json").write_text(json.dumps(cfg))
    model = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64,
             "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.0,
             "tie_word_embeddings": False}
    (tmp / "model.json").write_text(json.dumps(model))
    return ["--backend", backend, "--deepspeed_config", str(tmp / "ds.json"),
            "--model-config", str(tmp / "model.json"), "--out", str(out), "--steps", str(steps),
            "--save-every", str(HALF), "--train-data", str(ROOT / "data/tiny/train.jsonl"),
            "--max-docs", "48", "--seq-len", "32", "--vocab-size", "512", "--log-every", "1",
            "--online-selection", "--target-data", str(ROOT / "data/tiny/target.jsonl"),
            "--target-max-docs", "8", *extra]


#: The gradient score's flags of every gradient variant (refresh between stop and resume).
GRADIENT = ("--selection-score", "alignment", "--refresh-every", "3",
            "--selection-smooth-memory", "12")


def _weights(backend: str, out: Path) -> dict[str, torch.Tensor]:
    folder = out / "checkpoints" / f"step{STEPS}"
    if backend == "torch":
        from safetensors.torch import load_file
        return load_file(str(folder / "model.safetensors"))
    from dattri_ds.integrations.checkpoints import load_state_dict
    return load_state_dict(out / "checkpoints", f"step{STEPS}")


def _logs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("selection*.jsonl"))}


def _timeless(summary: dict) -> dict:
    """A selection summary less its measured CPU seconds (the only field a clock sets)."""
    return {k: _timeless(v) if isinstance(v, dict) else v for k, v in summary.items()
            if not k.endswith("cpu_s")}


def _check_equal(tmp_path: Path, backend: str, world: int, *extra: str) -> dict:
    full, part = tmp_path / "full", tmp_path / "part"
    ref = run(_train, world, timeout=300, argv=_argv(tmp_path, backend, full, STEPS, *extra))
    run(_train, world, timeout=300, argv=_argv(tmp_path, backend, part, HALF, *extra))
    with open(next(part.glob("selection*.jsonl")), "a", encoding="utf-8") as fh:
        fh.write('{"step": 2, "chosen": []}\n{"step": 3, "torn')  # written after the
        # checkpoint by a run that then crashed: dropped on resume
    sums = run(_train, world, timeout=300,
               argv=_argv(tmp_path, backend, part, STEPS, "--resume", "latest", *extra))
    assert (part / "checkpoints" / f"step{HALF}" / "selection_state.rank00000.pt").exists()
    la, lb = ([r["loss"] for r in json.loads((d / "trajectory.json").read_text())["lrs"]]
              for d in (full, part))
    assert len(la) == STEPS and la == lb, (la, lb)
    logs_a, logs_b = _logs(full), _logs(part)
    assert logs_a and logs_a == logs_b
    assert _timeless(ref[0]["selection"]) == _timeless(sums[0]["selection"])
    wa, wb = _weights(backend, full), _weights(backend, part)
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
    return ref[0]["selection"]


@pytest.mark.parametrize("variant", ["alignment", "no_reuse", "content", "cascade", "random"])
def test_torch_resume_with_selection_equals_uninterrupted(tmp_path, variant):
    """One process, ``--backend torch``: 4 steps in one go == 2 steps, then ``--resume
    latest`` to 4 (losses, selection log, selection summary, weights bitwise)."""
    require("deepspeed", "deepspeed")  # the JSON's lr schedule is DeepSpeed's class
    extra = {"alignment": GRADIENT,
             "no_reuse": (*GRADIENT, "--selection-uniform-mix", "0.25",
                          "--selection-reuse-forward", "off"),
             "content": ("--selection-score", "content"),
             "cascade": (*GRADIENT, "--selection-shortlist", "1.5", "--candidate-multiple", "3"),
             "random": ("--random-selection",)}[variant]
    summary = _check_equal(tmp_path, "torch", 1, *extra)
    if variant in ("alignment", "content"):
        assert summary["score"] == variant
    if variant == "alignment":
        assert summary["target_refreshes"] == 2  # steps 0 and 3: the resume falls between


def test_zero3_resume_with_selection_equals_uninterrupted(tmp_path):
    """DeepSpeed ZeRO-3 on 2 gloo ranks (a log and a state per rank): resumed ==
    uninterrupted, bitwise."""
    require("deepspeed", "deepspeed")
    _check_equal(tmp_path, "deepspeed", 2, *GRADIENT)
    assert (tmp_path / "part" / "selection.dp1.jsonl").exists()


def test_resume_under_another_selection_config_is_refused(tmp_path):
    """A resume whose resolved selection config differs from the checkpoint's is refused at
    start with one line naming the key, both values and the fix; the same config passes."""
    from dattri_ds.errors import ConfigError
    from dattri_ds.launch.config import RunConfig
    from dattri_ds.launch.resume import LoopState, check_resume, selection_config
    from dattri_ds.launch.runlog import RunRecord
    from dattri_ds.selection.state import SelectionCheckpoint

    sel = {"enabled": True, "target_data": "t.jsonl"}
    cfg = RunConfig.from_dict({"train": {"resume": "latest"}, "selection": sel})
    folder = tmp_path / "checkpoints" / "step2"
    SelectionCheckpoint.write(folder, 0, {"format": 1}, selection_config(cfg))
    LoopState(step=2, record=RunRecord(), rng={}, layout={"dp": 1, "tp": 1}).save(folder, 0)
    (tmp_path / "trajectory.json").write_text(json.dumps(
        {"checkpoints": [{"tag": "step2", "step": 2, "lr": 0.1}], "lrs": []}))
    check_resume(cfg, tmp_path)
    other = RunConfig.from_dict({"train": {"resume": "latest"},
                                 "selection": {**sel, "uniform_mix": 0.25}})
    with pytest.raises(ConfigError, match=r"^--resume step2: the checkpoint was written with "
                       r"selection\.uniform_mix=0\.5, this run has selection\.uniform_mix=0\.25"
                       r"[^\n]*drop --resume\)$"):
        check_resume(other, tmp_path)
