"""The training loop of launch/train.py, one for every backend: ``train``, and its data order.

The loop owns what does not depend on the engine: the data order (``step_slots``, a function
of the step, so a resumed run continues the same stream), online selection, capture tags, the
step bookkeeping (``RunLog``, launch/runlog.py: losses, lrs, evaluations, non-finite steps)
and when to checkpoint (all or nothing: launch/save.py). A ``Backend`` (launch/backend.py)
does the rest: it builds the model and optimizer, runs forward and backward of one
micro-batch, steps the optimizer, attaches capture, and saves / loads its own checkpoint.
What a checkpoint adds for the loop, and resuming from it: launch/resume.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from dattri_ds.distributed import all_reduce_sum
from dattri_ds.errors import ConfigError
from dattri_ds.launch.backend import Backend
from dattri_ds.launch.config import RunConfig
from dattri_ds.launch.data import data_record
from dattri_ds.launch.resume import LoopState, run_record, selection_config
from dattri_ds.launch.runlog import RunLog, make_run_id
from dattri_ds.launch.save import write_checkpoint
from dattri_ds.sample_id import SampleId
from dattri_ds.selection.state import SelectionCheckpoint
from dattri_ds.store import StoreCallback, seal_store

__all__ = ["train", "step_slots", "micro_batch_indices", "fingerprint", "seal_captured_store",
           "to_device"]


@functools.lru_cache(maxsize=2)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The seeded permutation of epoch ``epoch`` (kept: a step reads at most two epochs, and
    drawing ``randperm(n)`` per example cost O(n) host time per example)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


def step_slots(n: int, step: int, micro: int, gas: int, world: int, seed: int,
               origin: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """Example indices ``[gas, world, micro]`` of step ``step``'s slots, and how many earlier
    slots of the step (in stream order) hold the same example (0 but where the step runs
    past the end of an epoch: docs/multinode.md). The stream is a seeded permutation per
    epoch, laid end to end; step ``s`` begins at position
    ``origin[1] + (s - origin[0]) * micro * gas * world``; an elastic resume moves ``origin``
    to the resumed step and the position the old layout reached, so no example of the
    stream is skipped or repeated when the world size changes."""
    per_step = micro * gas * world
    start = origin[1] + (step - origin[0]) * per_step
    parts = []
    for epoch in range(start // n, (start + per_step - 1) // n + 1):
        lo = epoch * n
        parts.append(_epoch_order(n, seed, epoch)[max(start - lo, 0):start + per_step - lo])
    flat = torch.cat(parts)
    repeats = torch.zeros_like(flat)
    if len(parts) > 1:  # rank of each slot among the slots of its example, in stream order
        order = torch.argsort(flat, stable=True)
        pos = torch.arange(per_step)
        first = torch.ones(per_step, dtype=torch.bool)
        first[1:] = flat[order][1:] != flat[order][:-1]
        repeats[order] = pos - torch.cummax(torch.where(first, pos, 0), 0).values
    return flat.view(gas, world, micro), repeats.view(gas, world, micro)


def micro_batch_indices(n: int, step: int, micro: int, gas: int, rank: int, world: int,
                        seed: int, origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Example indices ``[gas, micro]`` of (step, micro-batch, rank) (``step_slots``)."""
    return step_slots(n, step, micro, gas, world, seed, origin)[0][:, rank].contiguous()


def train(backend: Backend, cfg: RunConfig, data, out: Path, tok, rank: int,
          selector=None, evaluator=None, resumed: LoopState | None = None) -> dict:
    """Train up to ``cfg.train.steps`` optimizer steps; the run summary.

    ``resumed`` (from ``resume``) continues at its step with its record and RNG state.
    Nothing here knows about capture: hooks and the selector do the work.
    """
    tc, ctx, micro, gas = cfg.train, backend.ctx, backend.micro, backend.gas
    start = resumed.step if resumed is not None else 0
    run_id = make_run_id(fingerprint(cfg, tok) + backend.fingerprint_suffix, out)
    record = data_record(data, tok)  # the examples' identity (stores, checkpoints)
    capture = _capture(backend, cfg, out, tok, run_id, start, record)
    n_cand = selector.num_candidates(micro) if selector is not None else micro
    per_step = n_cand * gas * ctx.dp_world  # candidate slots of the stream one step consumes
    origin = resumed.origin_for(per_step) if resumed is not None else (0, 0)
    ckpt_dir = out / "checkpoints"
    log = RunLog(tc, out, rank, evaluator, run_id=run_id,
                 record=resumed.record if resumed is not None else None)

    ran = run_record(cfg, backend.zero_stage, record)  # what a resume compares

    def write(folder: Path, tag: str, step: int, lr: float) -> None:
        backend.save(folder.parent, folder.name, {"tag": tag, "step": step, "lr": lr}, data)
        LoopState(step=step, record=log.record, rng=LoopState.capture_rng(),
                  layout=backend.layout(), origin=origin, per_step=per_step, run=ran
                  ).save(folder, rank)
        if selector is not None:  # every rank: under rank scope each rank's state differs
            SelectionCheckpoint.write(folder, rank, selector.state_dict(),
                                      selection_config(cfg) if rank == 0 else None)

    def save(tag: str, step: int, lr: float) -> None:
        if capture is not None:  # a checkpoint implies the rows of its steps are committed:
            for cb in capture.callbacks:  # a resume from it never recomputes them
                cb.on_detach()  # StoreCallback: commit the buffered rows
        write_checkpoint(ckpt_dir, tag, rank, lambda f: write(f, tag, step, lr),
                         [c["tag"] for c in log.record.checkpoints[:-1]])

    backend.model.train()
    if resumed is not None:
        resumed.restore(selector)  # the selector's state and log, then this rank's RNG
    else:  # dropout's stream from the seed: equal on every launch, node layout and launcher
        torch.manual_seed(tc.seed)
    for step in range(start, tc.steps):
        idx, repeats = (t[:, ctx.dp_rank] for t in step_slots(
            len(data), step, n_cand, gas, ctx.dp_world, tc.seed, origin))
        lr = backend.lr()  # the lr this step uses
        step_loss = torch.zeros((), dtype=torch.float64, device=backend.device)
        for mb in range(gas):
            batch = to_device(data.batch(idx[mb]), backend.device)
            doc_ids = [data.docs[i].id for i in idx[mb].tolist()]
            # stored ids: "<example id>@<step>[+<repeat>]#<content hash>", one per trained
            # slot; an example id names its first document (PackedDataset.example_id)
            tags = [SampleId.user_id(d, step, r) for d, r in zip(doc_ids, repeats[mb].tolist())]
            # ---- online selection: candidates -> the chosen micro-batch -----------------
            reused = None
            if selector is not None:
                sel = selector.select(batch, micro, step, user_ids=doc_ids,
                                      train_loss=backend.reuses_selection_forward)
                batch, reused = sel.batch, sel.loss
                tags = [tags[i] for i in sel.indices.tolist()]
            # ---- end of online selection -----------------------------------------------
            if capture is not None:
                capture.tag(tags)
            loss = backend.forward_backward(batch) if reused is None else \
                backend.backward_reused(reused)
            step_loss += loss.double() / gas
        backend.optimizer_step()
        all_reduce_sum(step_loss, ctx.dp_group, ctx.dp_world)
        log.end_step(step, step_loss / ctx.dp_world, lr, micro * gas * ctx.dp_world, save)
    if capture is not None:
        capture.close()
    summary = log.summary(world=dist.get_world_size(), captured=bool(capture))
    if capture is not None:  # examples dropped for a NaN/inf gradient, over the DP ranks
        dropped = torch.tensor([float(capture.skipped_examples)], device=backend.device)
        all_reduce_sum(dropped, ctx.dp_group, ctx.dp_world)
        summary["capture_dropped_examples"] = int(dropped.item())
    if selector is not None:
        summary["selection"] = selector.summary()
        selector.close()
    dist.barrier()
    if capture is not None:
        seal_captured_store(cfg.store_config(out).path, rank)
    return {**summary, **backend.summary()}


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A host batch on the compute device without a host sync: pinned and copied
    non-blocking to a GPU (a copy from pageable memory waits for the stream)."""
    pin = torch.device(device).type == "cuda"
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=True)
            for k, v in batch.items()}


def _capture(backend: Backend, cfg: RunConfig, out: Path, tok, run_id: str, start: int,
             record: dict | None):
    """Capture on every rank; one store shard per data-parallel rank (``store_writer``), its
    manifest recording the data (``record``)."""
    if not cfg.capture_enabled:
        return None
    if cfg.capture.projection is None:
        raise ConfigError("--capture stores projected gradients: pass --capture-projection-dim "
                          "256 (or set dattri_ds.capture.projection in the DeepSpeed JSON)")
    ctx, cbs = backend.ctx, []
    if backend.store_writer():
        cbs.append(StoreCallback(cfg.store_config(out), projection=cfg.capture.projection,
                                 fingerprint=fingerprint(cfg, tok) + backend.fingerprint_suffix,
                                 rank=ctx.dp_rank, world=ctx.dp_world, capture=cfg.capture,
                                 run_id=run_id, data=record))
    return backend.attach_capture(cfg, cbs, start)


def fingerprint(cfg: RunConfig, tok) -> str:
    """Identity of the trained model family recorded in stores: config + tokenizer + seed."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps([cfg.train.model_config, cfg.train.model_path, cfg.train.seed,
                         cfg.train.seq_len]).encode())
    h.update(tok.fingerprint.encode())
    return f"run:{h.hexdigest()}"


def seal_captured_store(path: str, rank: int) -> None:
    """After every rank closed its shard (a barrier), rank 0 records the store complete."""
    if rank == 0 and (Path(path) / "info.json").exists():
        seal_store(path)
