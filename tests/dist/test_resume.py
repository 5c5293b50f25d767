"""Resume through launch/train.py: a run stopped after 2 steps and resumed == an uninterrupted run.

Invariant: ``--resume step2`` continues a run from its checkpoint with the weights, the
optimizer state (AdamW moments), the lr schedule, the step (data position), every rank's RNG
state and the run record of the steps before it, so that the resumed run trains exactly what
the uninterrupted run trains: per-step losses, the final weights and the per-example
gradients it stores agree (fp32, relative error <= 1e-6; in practice bitwise). Checked for
``--backend megatron`` with TP=2 (2 gloo ranks; format of
dattri_ds/integrations/megatron_checkpoint.py; the DeepSpeed JSON's ZeRO block is ignored) and
``--backend deepspeed`` with ZeRO-2 and ZeRO-3 and dropout on (2 gloo ranks; DeepSpeed's own
checkpoints plus the loop's per-rank state).
Breaks if any of them is not restored: e.g. fresh AdamW moments after the resume change the
step-3 update far beyond the tolerance.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from _deps import require
import torch

from reference import rel_err

from _dist import run, tiny_run_files

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
STEPS, HALF, TOL = 4, 2, 1e-6


def _train(rank, world, argv):
    from dattri_ds.launch.train import main

    return main(argv)


def _argv(tmp: Path, backend: str, out: Path, steps: int, *extra: str, tp: int = 2,
          stage: int = 2) -> list[str]:
    # Megatron ignores the dropout (transformer_kwargs)
    files = tiny_run_files(tmp, stage, train_micro_batch_size_per_gpu=2,
                           gradient_accumulation_steps=2)
    parallel = ["--tensor-model-parallel-size", str(tp)] if backend == "megatron" else []
    return ["--backend", backend, *parallel, *files, "--out", str(out), "--steps", str(steps),
            "--save-every", str(HALF), "--capture", "--train-data",
            str(ROOT / "data/tiny/train.jsonl"), "--max-docs", "32", "--seq-len", "32",
            "--vocab-size", "512", "--log-every", "1", "--eval-every", "1", "--eval-data",
            str(ROOT / "data/tiny/target.jsonl"), "--eval-max-docs", "4", *extra]


def _weights(backend: str, out: Path, tag: str) -> dict[str, torch.Tensor]:
    if backend == "megatron":
        from dattri_ds.integrations.megatron_checkpoint import read_consolidated
        return read_consolidated(out / "checkpoints" / tag)
    from dattri_ds.integrations.checkpoints import load_state_dict
    return load_state_dict(out / "checkpoints", tag)


@pytest.mark.parametrize("backend,stage", [("megatron", 1), ("deepspeed", 2), ("deepspeed", 3)])
def test_resumed_run_equals_uninterrupted(tmp_path, backend, stage):
    """4 steps in one go == 2 steps, then ``--steps 4 --resume step2`` on the same --out:
    losses of all 4 steps, held-out losses, final weights and the stored gradients (rel. err
    <= 1e-6). Megatron: resuming with another process layout (1 process) is refused before
    the run's files are touched."""
    if backend == "megatron":
        require("megatron.core", "megatron")
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|Torch Norm).*")
        import megatron.core  # noqa: F401  (imported once in the parent, before forking)
    else:
        require("deepspeed", "deepspeed")
    full, part = tmp_path / "full", tmp_path / "part"
    ref = run(_train, 2, timeout=300, argv=_argv(tmp_path, backend, full, STEPS, stage=stage))
    run(_train, 2, timeout=300, argv=_argv(tmp_path, backend, part, HALF, stage=stage))
    model_config = (part / "model/config.json").read_bytes()
    if backend == "megatron":  # DeepSpeed resumes on another world size: test_elastic.py
        with pytest.raises(AssertionError, match="written with the process layout"):
            run(_train, 1, timeout=300, argv=_argv(tmp_path, backend, part, STEPS, "--resume",
                                                   "latest", tp=1, stage=stage))
    assert (part / "model/config.json").read_bytes() == model_config
    sums = run(_train, 2, timeout=300, argv=_argv(tmp_path, backend, part, STEPS, "--resume",
                                                    "latest", stage=stage))
    assert sums[0]["checkpoints"] == [f"step{HALF}", f"step{STEPS}"]
    assert sums[0]["examples"] == STEPS * 2 * 2 * (2 if backend == "deepspeed" else 1)
    ea, eb = ([e[k] for e in s[0]["eval"] for k in ("step", "examples", "target_loss")]
              for s in (ref, sums))
    assert len(ea) == 3 * (STEPS + 1) and rel_err(torch.tensor(eb), torch.tensor(ea)) <= TOL

    la = [r["loss"] for r in json.loads((full / "trajectory.json").read_text())["lrs"]]
    lb = [r["loss"] for r in json.loads((part / "trajectory.json").read_text())["lrs"]]
    assert len(la) == len(lb) == STEPS
    assert rel_err(torch.tensor(lb), torch.tensor(la)) <= TOL, (la, lb)

    wa, wb = _weights(backend, full, f"step{STEPS}"), _weights(backend, part, f"step{STEPS}")
    assert wa.keys() == wb.keys()
    errs = {k: rel_err(wb[k].double(), wa[k].double()) for k in wa if wa[k].is_floating_point()}
    assert max(errs.values()) <= TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]

    from dattri_ds.store import GradientStore

    with GradientStore.open(full / "grad_store") as a, GradientStore.open(part / "grad_store") as b:
        assert len(b) == len(set(b.ids)) == len(a) and set(a.ids) == set(b.ids)
        assert rel_err(b.read([b.index_of(i) for i in a.ids]), a.read(slice(None))) <= TOL


def test_resume_refusals(tmp_path):
    """A resume that cannot reproduce the run is refused at start, naming the fix: from a
    tag the run does not have (another selection config: test_resume_selection.py)."""
    from dattri_ds.errors import ConfigError
    from dattri_ds.launch.resume import resume_tag

    (tmp_path / "checkpoints" / "step2").mkdir(parents=True)
    (tmp_path / "trajectory.json").write_text(json.dumps(
        {"checkpoints": [{"tag": "step2", "step": 2, "lr": 0.1}], "lrs": []}))
    assert resume_tag(tmp_path, "latest") == "step2"
    with pytest.raises(ConfigError, match=r"no checkpoint 'step3'.*\['step2'\]"):
        resume_tag(tmp_path, "step3")
