"""Elastic resume: a DeepSpeed run saved on W ranks continues on W' != W (2->1, 1->2, 2->3).

The checkpoint is converted once to DeepSpeed's universal format and loaded resharded
(weights, fp32 master copy, Adam moments and step, lr schedule); the loop continues the data
stream at the example where the checkpoint stopped (``LoopState.origin``), every rank r
continues the selector state of rank r mod W, and the gradient store continues (shards of
W ranks, then W').

Invariants:

* Same global batch (``train_batch_size`` fixed, DeepSpeed derives the accumulation from
  the world size, 2 ranks x 2 micro-batches -> 1 rank x 4): every step trains the same
  micro-batches as the uninterrupted 2-rank run, so losses, lrs, final weights and stored
  rows equal it up to float summation order (rel. err <= 1e-5). Breaks when the optimizer
  moments, the lr schedule or the data position is not carried (fresh Adam moments change
  step 3 by far more).
* Another global batch (1->2, 2->3 with micro-batch and accumulation fixed), where the data
  order is partitioned by world size and no equality is possible: no example of the stream
  is skipped or repeated (every candidate the run drew lies in the epoch's first P
  positions, P = the slots all steps consumed, and the stored rows are the chosen examples,
  each exactly once), the lr sequence is the uninterrupted run's (the schedule counts
  steps), the loss stays within noise of the uninterrupted run's, the selector's target
  refresh clock is carried (2 refreshes at steps 0 and 3, not a fresh one at the resumed
  step), and the merged selection log holds W records a micro-batch before and W' after.
  The stopped run went one step past its checkpoint: the rows and log records it wrote
  after the checkpoint are dropped (``store.shard.rollback_to_step``), so the store holds
  exactly the examples the resumed trajectory trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _deps import require

from reference import rel_err

from _dist import run, tiny_run_files

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
STEPS, HALF, TOL = 4, 2, 1e-5
GRADIENT = ("--selection-score", "alignment", "--refresh-every", "3",
            "--selection-smooth-memory", "12")


def _train(rank, world, argv):
    from dattri_ds.launch.train import main

    return main(argv)


def _argv(tmp: Path, out: Path, steps: int, *extra: str, batch: dict,
          stage: int = 3) -> list[str]:
    files = tiny_run_files(tmp, stage, dropout=0.0,
                           **{"gradient_accumulation_steps": None, **batch})
    return [*files, "--out", str(out), "--steps", str(steps), "--save-every",
            str(HALF), "--capture", "--train-data", str(ROOT / "data/tiny/train.jsonl"),
            "--max-docs", "96", "--seq-len", "32", "--vocab-size", "512", "--log-every", "1",
            *extra]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in json.loads((out / "trajectory.json").read_text())["lrs"]]


def _lrs(out: Path) -> list[float]:
    return [r["lr"] for r in json.loads((out / "trajectory.json").read_text())["lrs"]]


def _stored(out: Path):
    from dattri_ds.store import GradientStore

    return GradientStore.open(out / "grad_store", require_complete=True)  # duplicates raise


@pytest.mark.parametrize("stage", [2, 3])
def test_elastic_2_to_1_same_global_batch_equals_uninterrupted(tmp_path, stage):
    """ZeRO-2 and ZeRO-3: 2 ranks x 2 micro-batches for 2 steps, then ``--resume latest`` on
    1 rank x 4 micro-batches (the universal checkpoint) == 4 steps on 2 ranks: losses, lrs,
    final weights, the stored rows (rel. err <= 1e-5), each stored id once."""
    require("deepspeed", "deepspeed")
    batch = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    full, part = tmp_path / "full", tmp_path / "part"
    run(_train, 2, timeout=300, argv=_argv(tmp_path, full, STEPS, batch=batch, stage=stage))
    run(_train, 2, timeout=300, argv=_argv(tmp_path, part, HALF, batch=batch, stage=stage))
    sums = run(_train, 1, timeout=300, argv=_argv(tmp_path, part, STEPS, "--resume", "latest",
                                                  batch=batch, stage=stage))
    assert sums[0]["world"] == 1 and sums[0]["checkpoints"] == [f"step{HALF}", f"step{STEPS}"]
    assert (part / "checkpoints" / f"step{HALF}" / "universal" / f"step{HALF}" / "zero").is_dir()
    assert _lrs(part) == _lrs(full)
    la, lb = _losses(full), _losses(part)
    assert len(la) == STEPS and rel_err(torch.tensor(lb), torch.tensor(la)) <= TOL, (la, lb)

    from dattri_ds.integrations.checkpoints import load_state_dict

    wa = load_state_dict(full / "checkpoints", f"step{STEPS}")
    wb = load_state_dict(part / "checkpoints", f"step{STEPS}")
    assert wa.keys() == wb.keys()
    keys = [k for k in wa if wa[k].is_floating_point()]
    flat_a, flat_b = (torch.cat([w[k].double().flatten() for k in keys]) for w in (wa, wb))
    assert rel_err(flat_b, flat_a) <= 1e-6
    # per tensor 1e-4: the key part of c_attn.bias gets a gradient of float noise only (the
    # softmax ignores it), which Adam's normalisation lifts to ~3e-5 of the tensor
    errs = {k: rel_err(wb[k].double(), wa[k].double()) for k in keys}
    assert max(errs.values()) <= 1e-4, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    with _stored(full) as a, _stored(part) as b:
        assert len(b) == len(set(b.ids)) == len(a) == STEPS * 8 and set(a.ids) == set(b.ids)
        assert rel_err(b.read([b.index_of(i) for i in a.ids]), a.read(slice(None))) <= TOL


def _stream(n: int, seed: int, slots: int) -> list[int]:
    """Example indices of the first ``slots`` positions of the stream (epoch permutations
    seeded ``seed * 1000 + epoch``, launch/loop.py)."""
    out: list[int] = []
    epoch = 0
    while len(out) < slots:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        out += perm.tolist()
        epoch += 1
    return out[:slots]


@pytest.mark.parametrize("before,after", [(1, 2), (2, 3)])
def test_elastic_resume_with_selection_keeps_the_invariants(tmp_path, before, after):
    """ZeRO-3 with capture and gradient selection (alignment, smoothing, target refresh
    every 3 steps) saved on ``before`` ranks at step 2 and resumed on ``after`` ranks to
    step 4: the invariants of the module docstring."""
    require("deepspeed", "deepspeed")
    from dattri_ds.data.packed import PackedDataset

    batch = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    sel = ("--online-selection", "--target-data", str(ROOT / "data/tiny/target.jsonl"),
           "--target-max-docs", "8", *GRADIENT)
    full, part = tmp_path / "full", tmp_path / "part"
    ref = run(_train, before, timeout=300, argv=_argv(tmp_path, full, STEPS, *sel, batch=batch))
    # the stopped run went one step past its checkpoint: its rows and log of step 2 go
    run(_train, before, timeout=300, argv=_argv(tmp_path, part, HALF + 1, *sel, batch=batch))
    kept = [r for r in map(json.loads, (part / "selection.jsonl").read_text().splitlines())
            if r["step"] < HALF]
    sums = run(_train, after, timeout=300,
               argv=_argv(tmp_path, part, STEPS, "--resume", f"step{HALF}", *sel, batch=batch))
    assert sums[0]["world"] == after and sums[0]["examples"] == 2 * 2 * (
        HALF * before + (STEPS - HALF) * after)
    assert _lrs(part) == _lrs(full)
    la, lb = _losses(full), _losses(part)
    assert la[:HALF] == lb[:HALF] and max(abs(a - b) for a, b in zip(la, lb)) < 0.1, (la, lb)
    assert ref[0]["selection"]["target_refreshes"] == sums[0]["selection"][
        "target_refreshes"] == 2

    from dattri_ds.selection import read_selection_log

    records = read_selection_log(part / "selection.jsonl")
    assert [r for r in records if r["dp_rank"] == 0 and r["step"] < HALF] == kept
    per_step = [sum(r["step"] == s for r in records) for s in range(STEPS)]
    assert per_step == [2 * before] * HALF + [2 * after] * (STEPS - HALF)
    n_cand = len(records[0]["candidate_scores"])
    slots = 2 * n_cand * (HALF * before + (STEPS - HALF) * after)
    data = PackedDataset.of_record(json.loads((part / "data.json").read_text())["record"])
    seed = json.loads((part / "resolved_dattri_ds_config.json").read_text())["train"]["seed"]
    drawn = {data.example_id(i) for i in _stream(len(data), seed, slots)}
    chosen = [c.split("#")[0] for r in records for c in r["chosen"]]
    assert len(chosen) == len(set(chosen)) == sums[0]["examples"]  # none repeated
    assert set(chosen) <= drawn, sorted(set(chosen) - drawn)  # none from past the stream
    with _stored(part) as store:
        stored = [i.split("@")[0] for i in store.ids]
        assert sorted(stored) == sorted(chosen)
        steps = [int(i.split("@")[1].split("#")[0]) for i in store.ids]
        assert [steps.count(s) for s in range(STEPS)] == [
            2 * 2 * before] * HALF + [2 * 2 * after] * (STEPS - HALF)


#: launch/train.py, killed (SIGKILL, global rank 0) after training step 2, before its end:
#: the checkpoint of step 2 is complete, the rows of step 2 are buffered, not committed.
KILLER = """
import os, signal, sys
from dattri_ds.launch import runlog

_end = runlog.RunLog.end_step
def end_step(self, step, *a, **k):
    if step == 2 and os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return _end(self, step, *a, **k)
runlog.RunLog.end_step = end_step
from dattri_ds.cli.exits import run
from dattri_ds.launch.train import main
sys.exit(run(main))
"""


def test_preempted_two_node_run_resumes_on_one_rank(tmp_path):
    """Preemption: a 2-node run (torchrun ``--nnodes 2``) is killed with SIGKILL during
    step 3, after its step-2 checkpoint, with the rows of steps 0-1 captured under the
    default ``flush_every`` (512, so nothing was committed during training); ``--resume
    latest`` on 1 rank (same global batch) ends with the store, losses and weights of the
    uninterrupted 2-rank run: the checkpoint committed the rows of its steps (none lost),
    the rows of the killed step were never committed or are rolled back (none twice)."""
    require("deepspeed", "deepspeed")
    from test_multinode import nodes

    batch = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    full, part = tmp_path / "full", tmp_path / "part"
    run(_train, 2, timeout=300, argv=_argv(tmp_path, full, STEPS, batch=batch))
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    done = nodes(str(killer), _argv(tmp_path, part, STEPS, batch=batch))
    assert any(d.returncode != 0 for d in done)
    assert json.loads((part / "trajectory.json").read_text())["checkpoints"][-1]["tag"] == \
        f"step{HALF}"
    run(_train, 1, timeout=300, argv=_argv(tmp_path, part, STEPS, "--resume", "latest",
                                           batch=batch))
    la, lb = _losses(full), _losses(part)
    assert len(lb) == STEPS and rel_err(torch.tensor(lb), torch.tensor(la)) <= TOL, (la, lb)
    with _stored(full) as a, _stored(part) as b:
        assert len(b) == len(set(b.ids)) == len(a) == STEPS * 8 and set(a.ids) == set(b.ids)
        assert rel_err(b.read([b.index_of(i) for i in a.ids]), a.read(slice(None))) <= TOL


def test_zero_stage_1_to_2_resume_is_converted(tmp_path):
    """A ZeRO-1 checkpoint resumed under ZeRO-2 (what DeepSpeed's universal checkpoint can
    convert; check_resume refuses 0 <-> 1-3 and 3 <-> 1/2 at start) continues the run:
    losses, lrs and final weights equal the uninterrupted ZeRO-1 run's (rel. err <= 1e-5),
    the stored rows too. Breaks if the stage change loads nothing or fresh Adam moments."""
    require("deepspeed", "deepspeed")
    batch = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    full, part = tmp_path / "full", tmp_path / "part"
    run(_train, 1, timeout=300, argv=_argv(tmp_path, full, STEPS, batch=batch, stage=1))
    run(_train, 1, timeout=300, argv=_argv(tmp_path, part, HALF, batch=batch, stage=1))
    run(_train, 1, timeout=300, argv=_argv(tmp_path, part, STEPS, "--resume", "latest",
                                           batch=batch, stage=2))
    assert (part / "checkpoints" / f"step{HALF}" / "universal" / f"step{HALF}" / "zero").is_dir()
    assert _lrs(part) == _lrs(full)
    la, lb = _losses(full), _losses(part)
    assert len(lb) == STEPS and rel_err(torch.tensor(lb), torch.tensor(la)) <= TOL, (la, lb)
    from dattri_ds.integrations.checkpoints import load_state_dict

    wa = load_state_dict(full / "checkpoints", f"step{STEPS}")
    wb = load_state_dict(part / "checkpoints", f"step{STEPS}")
    assert wa.keys() == wb.keys()
    errs = {k: rel_err(wb[k].double(), wa[k].double()) for k in wa if wa[k].is_floating_point()}
    assert max(errs.values()) <= TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    with _stored(full) as a, _stored(part) as b:
        assert len(b) == len(set(b.ids)) == len(a) and set(a.ids) == set(b.ids)
