"""Two "nodes" on one host: torchrun with ``--nnodes 2`` equals one node of the same world size.

Each node is its own ``torchrun --nnodes 2 --nproc_per_node P --rdzv_backend c10d
--rdzv_endpoint 127.0.0.1:PORT`` process (started by the test, as on two machines), so
every node's processes have ``LOCAL_RANK`` 0..P-1 while their global ranks run 0..2P-1, and
the c10d rendezvous, not ``--node_rank``, decides which node holds global rank 0.

Invariant: nothing of ours depends on the local rank, the node, or which node holds rank 0:
* ``launch/train.py`` under DeepSpeed ZeRO-3 with ``--capture --online-selection`` on 2
  nodes x 1 process equals the same run as one node with 2 processes bit for bit: per-step
  losses, the selection logs (chosen ids and scores of every rank), the final weights and
  the gradient store (every shard's ids and rows);
* ``dattri-ds collect`` on 2 nodes x 2 processes equals 4 processes on one node (each
  global rank writes its own shard: ids and rows equal), and ``dattri-ds fit`` on 2 nodes x
  1 process equals 2 processes on one node (the factors, every tensor equal).
Breaks when a shard, log or file is named by the local rank (two nodes' rank-0 processes
would then write one shard: the shard lock refuses, or rows go missing), or when a step
runs on a per-node rather than global reduction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _deps import require

from _dist import free_port, run, tiny_run_files

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the torchrun command
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TINY = str(ROOT / "data/tiny/train.jsonl")


def nodes(script: str, argv: list[str], n_nodes: int = 2, per_node: int = 1,
          timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run ``script argv`` as ``n_nodes`` torchrun agents of ``per_node`` processes each,
    meeting at a c10d rendezvous on this host; every agent's exit and output."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", str(n_nodes), "--nproc_per_node", str(per_node), "--node_rank",
         str(i), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--max_restarts", "0",
         script, *argv], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for i in range(n_nodes)]
    done = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def _ok(done: list[subprocess.CompletedProcess]) -> None:
    assert all(d.returncode == 0 for d in done), "\n".join(
        f"--- node {i} (exit {d.returncode}) ---\n{d.stdout[-3000:]}" for i, d in enumerate(done))


def _train(rank, world, argv):
    from dattri_ds.launch.train import main

    return main(argv)


def _tool(rank, world, name, argv):
    import importlib

    return importlib.import_module(f"dattri_ds.tools.{name}").main(argv)


def train_argv(tmp: Path, out: Path, steps: int, *extra: str) -> list[str]:
    files = tiny_run_files(tmp, 3, train_micro_batch_size_per_gpu=2,
                           gradient_accumulation_steps=2)
    return [*files, "--out", str(out), "--steps", str(steps), "--save-every",
            "2", "--capture", "--train-data", TINY, "--max-docs", "48", "--seq-len", "32",
            "--vocab-size", "512", "--log-every", "1", *extra]


def same_store(a: Path, b: Path) -> None:
    """Two stores hold the same shards: ids and rows of every shard equal."""
    from dattri_ds.store import GradientStore
    from dattri_ds.store.format import list_shards

    assert [p.rank for p in list_shards(a)] == [p.rank for p in list_shards(b)]
    with GradientStore.open(a, require_complete=True) as sa, \
            GradientStore.open(b, require_complete=True) as sb:
        assert sa.ids == sb.ids and len(sa) > 0
        assert torch.equal(sa.read(slice(None)), sb.read(slice(None)))


def test_two_nodes_train_equals_one_node(tmp_path):
    """ZeRO-3, ``--capture --online-selection``, dropout on: 2 nodes x 1 process == 1 node x
    2 processes (losses, selection logs, weights, store), bit for bit."""
    require("deepspeed", "deepspeed")
    one, two = tmp_path / "one", tmp_path / "two"
    sel = ("--online-selection", "--target-data", str(ROOT / "data/tiny/target.jsonl"),
           "--target-max-docs", "8")
    script = str(ROOT / "launch/train.py")  # fresh processes on both sides (dropout RNG)
    _ok(nodes(script, train_argv(tmp_path, one, 3, *sel), n_nodes=1, per_node=2))
    _ok(nodes(script, train_argv(tmp_path, two, 3, *sel)))
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert sb["world"] == 2 and sa["examples"] == sb["examples"] == 3 * 2 * 2 * 2
    assert sa["selection"] == sb["selection"]
    la, lb = (json.loads((d / "trajectory.json").read_text())["lrs"] for d in (one, two))
    assert la == lb
    logs = sorted(p.name for p in two.glob("selection*.jsonl"))
    assert logs == ["selection.dp1.jsonl", "selection.jsonl"]
    assert all((one / n).read_bytes() == (two / n).read_bytes() for n in logs)
    from dattri_ds.integrations.checkpoints import load_state_dict

    wa, wb = (load_state_dict(d / "checkpoints", "step3") for d in (one, two))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    same_store(one / "grad_store", two / "grad_store")


def test_two_nodes_of_two_train_equals_one_node(tmp_path):
    """2 nodes x 2 processes (local ranks 0, 1 on each, global 0-3), ZeRO-3 with capture and
    selection, 2 steps: equals 4 processes on one node (forked from pytest; the run seeds its
    own RNG, so the launcher does not matter) bit for bit: losses, the 4 selection logs,
    weights, the 4 store shards."""
    require("deepspeed", "deepspeed")
    one, two = tmp_path / "one", tmp_path / "two"
    sel = ("--online-selection", "--target-data", str(ROOT / "data/tiny/target.jsonl"),
           "--target-max-docs", "8", "--max-docs", "96")  # 64 candidate slots in one epoch
    run(_train, 4, timeout=300, argv=train_argv(tmp_path, one, 2, *sel))
    _ok(nodes(str(ROOT / "launch/train.py"), train_argv(tmp_path, two, 2, *sel), per_node=2))
    la, lb = (json.loads((d / "trajectory.json").read_text())["lrs"] for d in (one, two))
    assert la == lb and len(la) == 2
    logs = sorted(p.name for p in two.glob("selection*.jsonl"))
    assert len(logs) == 4
    assert all((one / n).read_bytes() == (two / n).read_bytes() for n in logs)
    from dattri_ds.integrations.checkpoints import load_state_dict

    wa, wb = (load_state_dict(d / "checkpoints", "step2") for d in (one, two))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    same_store(one / "grad_store", two / "grad_store")


def test_two_nodes_megatron_tp_equals_one_node(tmp_path):
    """``--backend megatron`` with tensor parallelism 2 across the two nodes (each node one
    TP rank), ``--capture --online-selection``: equals TP=2 on one node bit for bit (losses,
    selection log, consolidated weights, store)."""
    require("megatron.core", "megatron")
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("--backend", "megatron", "--tensor-model-parallel-size", "2", "--online-selection",
             "--target-data", str(ROOT / "data/tiny/target.jsonl"), "--target-max-docs", "8")
    script = str(ROOT / "launch/train.py")
    _ok(nodes(script, train_argv(tmp_path, one, 2, *extra), n_nodes=1, per_node=2))
    _ok(nodes(script, train_argv(tmp_path, two, 2, *extra)))
    la, lb = (json.loads((d / "trajectory.json").read_text())["lrs"] for d in (one, two))
    assert la == lb and len(la) == 2
    assert (one / "selection.jsonl").read_bytes() == (two / "selection.jsonl").read_bytes()
    from dattri_ds.integrations.megatron_checkpoint import read_consolidated

    wa, wb = (read_consolidated(d / "checkpoints" / "step2") for d in (one, two))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    same_store(one / "grad_store", two / "grad_store")


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run(_train, 1, timeout=300, argv=train_argv(tmp_path, run_dir, 2))
    return run_dir


def test_two_nodes_of_two_collect_equals_one_node(tmp_path):
    """``collect`` on 2 nodes x 2 processes (local ranks 0, 1 on each) == 4 processes on
    one node: the same 4 shards, every shard's ids and rows equal."""
    require("deepspeed", "deepspeed")
    run_dir = _run_dir(tmp_path)
    collect = ["--run-dir", str(run_dir), "--data", TINY, "--max-docs", "16",
               "--projection-dim", "32", "--batch-size", "4", "--checkpoints", "step2"]
    run(_tool, 4, timeout=300, name="collect", argv=[*collect, "--out", str(tmp_path / "c1")])
    _ok(nodes(str(ROOT / "tools/collect.py"), [*collect, "--out", str(tmp_path / "c2")],
              per_node=2))
    same_store(tmp_path / "c1" / "step2", tmp_path / "c2" / "step2")


def test_two_nodes_fit_equals_one_node(tmp_path):
    """``fit`` on 2 nodes x 1 process == 2 processes on one node: every factor equal."""
    require("deepspeed", "deepspeed")
    run_dir = _run_dir(tmp_path)
    fit = ["--run-dir", str(run_dir), "--data", TINY, "--max-docs", "16", "--checkpoint",
           "step2"]
    run(_tool, 2, timeout=300, name="fit", argv=[*fit, "--out", str(tmp_path / "f1.pt")])
    _ok(nodes(str(ROOT / "tools/fit.py"), [*fit, "--out", str(tmp_path / "f2.pt")]))
    fa, fb = (torch.load(tmp_path / f, weights_only=False) for f in ("f1.pt", "f2.pt"))
    _same_nested(fa, fb)


def _same_nested(a, b, where: str = "factors") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same_nested(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _blind_rank(rank, world, out):
    import torch.distributed as dist

    from dattri_ds.errors import ConfigError
    from dattri_ds.launch.resume import check_shared_out

    dist.init_process_group("gloo")
    if rank == 1:  # this "node" mounts another file system at the same path
        Path.read_text = lambda self, *a, **k: (_ for _ in ()).throw(FileNotFoundError(self))
    try:
        check_shared_out(Path(out), rank)
    except ConfigError as err:
        return str(err)
    return None


def test_out_not_shared_is_refused_on_every_rank(tmp_path):
    """A rank that cannot read what rank 0 wrote to --out (no shared file system) makes
    every rank refuse at start, naming that rank and its host, instead of failing later
    on one node while the others wait in a collective; a shared --out passes."""
    got = run(_blind_rank, 2, timeout=120, out=str(tmp_path))
    assert got[0] == got[1] and "rank 1 on" in got[0] and "is not shared" in got[0]
    assert not list(tmp_path.glob(".shared.*"))  # the token file is removed


@pytest.mark.parametrize("selection", [False, True], ids=["plain", "selection"])
def test_a_step_past_the_end_of_an_epoch_stores_every_occurrence(tmp_path, selection):
    """4 ranks x 2 micro-batches x 4 candidates over 33-63 windows (10 documents at 64 tokens):
    step 1's 32 slots run past the end of epoch 0, so windows of its tail come back at the
    head of epoch 1 in the same step, trained by two ranks (or twice by one). Each occurrence is stored under its
    own id (``<doc>@1+1#<hash>`` for the second, docs/multinode.md), so the store opens
    without duplicates. Without selection it holds all 64 slots of the 2 steps; with it
    (2 of 4 candidates trained) 32 rows, each the id of the candidate slot it was chosen
    from."""
    require("deepspeed", "deepspeed")
    from dattri_ds.data import PackedDataset
    from dattri_ds.launch.loop import step_slots
    from dattri_ds.sample_id import SampleId
    from dattri_ds.store import GradientStore

    out, micro = tmp_path / "run", 2 if selection else 4
    files = tiny_run_files(tmp_path, 1, train_micro_batch_size_per_gpu=micro,
                           gradient_accumulation_steps=2)
    sel = ["--online-selection", "--target-data", str(ROOT / "data/tiny/target.jsonl")]
    run(_train, 4, timeout=400, argv=[
        *files, "--out", str(out), "--steps", "2", "--capture", "--train-data", TINY,
        "--max-docs", "10", "--seq-len", "64", "--vocab-size", "512", *(sel if selection
                                                                       else [])])
    data = PackedDataset.of_record(json.loads((out / "data.json").read_text())["record"])
    assert 32 < len(data) < 64, len(data)  # step 1 runs past the end of epoch 0
    slots = set()
    for step in (0, 1):
        index, repeats = step_slots(len(data), step, 4, 2, 4, seed=0)
        slots |= {(data.docs[i].id, step, r) for i, r in zip(index.flatten().tolist(),
                                                             repeats.flatten().tolist())}
    assert any(r for _, _, r in slots)  # the case this test is about: a document twice
    with GradientStore.open(out / "grad_store", require_complete=True) as store:
        ids = [SampleId.parse(i) for i in store.ids]  # duplicates="raise": none
    assert len(ids) == len(set(ids)) == 2 * 2 * 4 * micro
    assert {(i.doc, i.step, i.repeat) for i in ids} <= slots
    if not selection:
        assert {(i.doc, i.step, i.repeat) for i in ids} == slots
