"""Fork-based multi-process runner for gloo tests (heavy imports happen once, in the parent).

``run(fn, world_size=2, **kwargs)`` forks ``world_size`` workers, each with RANK, WORLD_SIZE,
MASTER_ADDR/PORT set and one intra-op thread, calls ``fn(rank, world, **kwargs)`` and
returns the per-rank results in rank order, or raises with every failing rank's traceback.
The parent never initializes a process group.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _portable(obj):
    """Tensors travel as numpy arrays: a tensor put on a queue is shared through a file
    descriptor that dies with the worker."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    return obj


def _worker(rank, world, port, fn, kwargs, q):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        q.put((rank, True, _portable(fn(rank, world, **kwargs))))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn, world_size: int = 2, timeout: float = 180, **kwargs):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, kwargs, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, ok, value = q.get(timeout=timeout)
            (results if ok else errors)[rank] = value
    except queue.Empty:
        errors["timeout"] = f"workers did not finish within {timeout}s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{e}" for r, e in errors.items()))
    return [results[r] for r in range(world_size)]


def tiny_run_files(tmp, stage: int = 3, dropout: float = 0.1, **batch) -> list[str]:
    """``--deepspeed_config`` / ``--model-config`` flags of the launch tests' tiny run:
    ``configs/zero<stage>_cpu.json`` at lr 0.01 (warm-up 2 of 8 steps, capture projected to
    32) with ``batch`` keys replacing its batch settings (a ``None`` value drops the key),
    and a 2-layer 32-wide GPT-2 (``dropout`` on residuals and embeddings), written to
    ``tmp``."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = json.loads((root / f"configs/zero{stage}_cpu.json").read_text())
    for key, value in batch.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    cfg["optimizer"]["params"]["lr"] = 0.01
    cfg["scheduler"]["params"].update(warmup_num_steps=2, total_num_steps=8)
    cfg["dattri_ds"]["capture"]["projection"]["dim"] = 32
    (Path(tmp) / "ds.json").write_text(json.dumps(cfg))
    model = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64,
             "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": 0.0,
             "tie_word_embeddings": False}
    (Path(tmp) / "model.json").write_text(json.dumps(model))
    return ["--deepspeed_config", str(Path(tmp) / "ds.json"), "--model-config",
            str(Path(tmp) / "model.json")]
