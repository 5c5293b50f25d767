"""Train a causal LM with DeepSpeed on local text, capturing per-example gradients on request.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/zero3_cpu.json --capture
    torchrun --standalone --nproc_per_node 2 launch/train.py --deepspeed_config ...
    python launch/train.py --deepspeed_config configs/zero2_cpu.json      # one process

Our settings live in the ``"dattri_ds"`` block of the DeepSpeed JSON (launch/config.py);
flags override them. The output directory receives the resolved configs, the tokenizer,
the model config, DeepSpeed checkpoints with the learning rate of every step (for TracIn),
the per-example gradient store (``--capture``) and a summary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `dattri_ds.launch` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dattri_ds.distributed import ParallelContext  # noqa: E402
from dattri_ds.launch.args import parse_args  # noqa: E402
from dattri_ds.launch.config import RunConfig, dump_json, load_run_config  # noqa: E402
from dattri_ds.launch.runlog import RunLog, make_run_id  # noqa: E402

logger = logging.getLogger("dattri_ds.launch")
# DeepSpeed calls torch collectives that torch 2.13 marks deprecated: noise for our users.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def setup_distributed() -> tuple[int, int]:
    """Initialize torch.distributed through DeepSpeed (gloo on CPU); works single-process."""
    import importlib

    import deepspeed

    from dattri_ds.distributed import default_rendezvous_env

    default_rendezvous_env()
    cuda = torch.cuda.is_available()
    if not cuda:  # gloo needs no shm op; skip its JIT build
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def prepare_data(cfg: RunConfig, out: Path, rank: int):
    """Documents, tokenizer (trained by rank 0, cached, then loaded by the others), examples."""
    from dattri_ds.data import load_documents, tokenize_documents, train_tokenizer

    tc = cfg.train
    docs = load_documents(list(tc.train_data))
    if tc.max_docs:
        docs = docs[:tc.max_docs]
    texts = [d.text for d in docs]
    cache = out / "cache"
    if rank == 0:
        tok = train_tokenizer(texts, vocab_size=tc.vocab_size, cache_dir=cache)
        tok.save(out / "tokenizer.model")
    torch.distributed.barrier()
    if rank != 0:
        tok = train_tokenizer(texts, vocab_size=tc.vocab_size, cache_dir=cache)
    return docs, tok, tokenize_documents(docs, tok, tc.seq_len)


def build(cfg: RunConfig, tok):
    from dattri_ds.data import build_model

    if cfg.train.model_path:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(cfg.train.model_path, local_files_only=True)
    return build_model(cfg.train.model_config, tokenizer=tok, seed=cfg.train.seed)


def micro_batch_indices(n: int, step: int, micro: int, gas: int, rank: int, world: int,
                        seed: int) -> torch.Tensor:
    """Example indices of (step, micro-batch, rank): a seeded permutation per epoch."""
    per_step = micro * gas * world
    out = []
    for mb in range(gas):
        start = step * per_step + (mb * world + rank) * micro
        idx = []
        for k in range(start, start + micro):
            epoch, pos = divmod(k, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
            idx.append(int(perm[pos]))
        out.append(torch.tensor(idx))
    return torch.stack(out)


def fingerprint(cfg: RunConfig, tok) -> str:
    """Identity of the trained model family recorded in stores: config + tokenizer + seed."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps([cfg.train.model_config, cfg.train.model_path, cfg.train.seed,
                         cfg.train.seq_len]).encode())
    h.update(tok.fingerprint.encode())
    return f"run:{h.hexdigest()}"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    ds_config, cfg = load_run_config(args.deepspeed_config, args.overrides)
    if args.backend == "megatron":
        from dattri_ds.launch.megatron_backend import run
        return run(args, ds_config, cfg)
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1 or \
            args.sequence_parallel:
        from dattri_ds.errors import ConfigError
        raise ConfigError("--tensor/pipeline-model-parallel-size and --sequence-parallel need "
                          "--backend megatron")
    rank, world = setup_distributed()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    docs, tok, data = prepare_data(cfg, out, rank)
    model = build(cfg, tok)
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config)
    if rank == 0:
        dump_json(out / "resolved_deepspeed_config.json", ds_config)
        dump_json(out / "resolved_dattri_ds_config.json", cfg)
        model.config.save_pretrained(str(out / "model"))  # HF config.json for offline tools
    ctx = ParallelContext(dp_rank=rank, dp_world=world)
    selector = _selector(engine, cfg, data, tok, out, ctx)
    evaluator = make_evaluator(engine.module, cfg, tok, data.seq_len, ctx, engine.device)
    summary = train(engine, cfg, data, out, rank, world, tok, selector, evaluator)
    if rank == 0:
        dump_json(out / "summary.json", summary)
        logger.info("done: %s", json.dumps(summary))
    return summary


def _capture(engine, cfg: RunConfig, out: Path, rank: int, world: int, tok, run_id: str):
    if not cfg.capture_enabled:
        return None
    from dattri_ds import GradientCapture
    from dattri_ds.errors import ConfigError
    from dattri_ds.store import StoreCallback

    if cfg.capture.projection is None:
        raise ConfigError("--capture stores projected gradients: set dattri_ds.capture."
                          "projection in the DeepSpeed JSON (e.g. {\"dim\": 256})")
    cb = StoreCallback(cfg.store_config(out), projection=cfg.capture.projection,
                       fingerprint=fingerprint(cfg, tok), rank=rank, world=world,
                       capture=cfg.capture, run_id=run_id)
    return GradientCapture.for_engine(engine, cfg.capture, callbacks=[cb]).attach()


def _target_docs(path: str, tok, seq_len: int, skip: int, limit: int | None):
    from dattri_ds.data import load_documents, tokenize_documents

    docs = load_documents(path)[skip:]
    return tokenize_documents(docs[:limit] if limit else docs, tok, seq_len)


def make_selector(model, cfg: RunConfig, data, tok, ctx, device, lr_fn, log_path,
                  optimizer=None):
    """The OnlineSelector of ``--online-selection`` on ``model`` (what the loop calls), for
    both backends; every check runs before the first step. None when selection is off.
    ``optimizer`` (torch or DeepSpeed ZeRO) is read by ``--selection-precondition adam``."""
    sc = cfg.selection
    if not sc.enabled:
        return None
    from dattri_ds.errors import ConfigError
    from dattri_ds.selection import OnlineSelector, check_target_compatible

    tdata = None
    if not sc.target_store:
        if sc.target_data is None:
            raise ConfigError("--online-selection needs the target texts: pass --target-data "
                              "FILE.jsonl (selection.target_data; e.g. a validation set of the "
                              "task you care about) or set selection.target_store")
        tdocs = _target_docs(sc.target_data, tok, data.seq_len, 0, sc.target_max_docs)
        check_target_compatible(data, tdocs)
        tdata = tdocs.batch(slice(None))
    return OnlineSelector.for_target_data(model, sc, tdata, capture=cfg.capture, ctx=ctx,
                                          device=device, lr_fn=lr_fn, log_path=log_path,
                                          optimizer=optimizer)


def _selector(engine, cfg: RunConfig, data, tok, out: Path, ctx: ParallelContext):
    """``make_selector`` on a DeepSpeed engine (refused engines fail here, at start)."""
    if not cfg.selection.enabled:
        return None
    from dattri_ds.selection import check_engine_supported

    check_engine_supported(engine)
    return make_selector(engine.module, cfg, data, tok, ctx, engine.device,
                         lambda: float(engine.get_lr()[0]), out / "selection.jsonl",
                         optimizer=engine.optimizer)


def make_evaluator(model, cfg: RunConfig, tok, seq_len: int, ctx, device):
    """``evaluate() -> {"target_loss": ..., "general_loss": ...}`` mean token losses on
    held-out texts (``general_loss`` only with ``train.general_eval_data``), each DP rank a
    share; None when ``train.eval_every`` is 0.

    Every rank runs the same number of forward calls (``ceil(N / (8 * dp_world))``, a rank
    without rows left runs a zero-weight batch) so ZeRO-3 gathers and tensor-parallel
    collectives stay in step; the token-weighted sums are all-reduced over the DP group.
    """
    from dattri_ds.errors import ConfigError

    tc = cfg.train
    if not tc.eval_every:
        return None
    path = tc.eval_data or cfg.selection.target_data
    if path is None:
        raise ConfigError("--eval-every needs held-out texts: pass --eval-data FILE.jsonl")
    sets = {"target_loss": _target_docs(path, tok, seq_len,
                                        tc.eval_skip if tc.eval_data is None else 0,
                                        tc.eval_max_docs)}
    if tc.general_eval_data:
        sets["general_loss"] = _target_docs(tc.general_eval_data, tok, seq_len, 0,
                                            tc.eval_max_docs)
    losses = {k: _loss_fn(model, ev, ctx, device) for k, ev in sets.items()}
    return lambda: {k: fn() for k, fn in losses.items()}


def _loss_fn(model, ev, ctx, device):
    """``() -> mean token loss`` of the examples ``ev``, split over the DP group."""
    from dattri_ds.distributed import all_reduce_sum

    rows = torch.arange(ctx.dp_rank, len(ev), ctx.dp_world)
    n_batches = max(-(-len(ev) // (8 * ctx.dp_world)), 1)  # the same count on every DP rank

    @torch.no_grad()
    def evaluate() -> float:
        was = model.training
        model.eval()
        tot = torch.zeros(2, dtype=torch.float64, device=device)
        for i in range(n_batches):
            idx, weight = rows[i * 8:(i + 1) * 8], 1.0
            if idx.numel() == 0:  # keep collectives in step on every rank
                idx, weight = torch.tensor([0]), 0.0
            b = {k: v.to(device) for k, v in ev.batch(idx).items()}
            n = float((b["labels"][:, 1:] != -100).sum()) * weight
            tot += torch.tensor([float(model(**b).loss) * n, n], dtype=torch.float64,
                                device=device)
        all_reduce_sum(tot, ctx.dp_group, ctx.dp_world)
        model.train(was)
        return float(tot[0] / tot[1].clamp_min(1))
    return evaluate


def train(engine, cfg: RunConfig, data, out: Path, rank: int, world: int, tok,
          selector=None, evaluator=None) -> dict:
    """The loop: nothing in it knows about capture; hooks and the selector do the work."""
    tc = cfg.train
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    device = engine.device
    run_id = make_run_id(fingerprint(cfg, tok), out)
    capture = _capture(engine, cfg, out, rank, world, tok, run_id)
    n_cand = selector.num_candidates(micro) if selector is not None else micro
    ckpt_dir = out / "checkpoints"
    log = RunLog(tc, out, rank, evaluator, run_id=run_id)

    def save(tag: str, step: int, lr: float) -> None:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step, "lr": lr})

    for step in range(tc.steps):
        idx = micro_batch_indices(len(data), step, n_cand, gas, rank, world, tc.seed)
        step_loss = torch.zeros((), device=device)
        for mb in range(gas):
            batch = {k: v.to(device) for k, v in data.batch(idx[mb]).items()}
            doc_ids = [data.docs[i].id for i in idx[mb].tolist()]
            if selector is not None:
                sel = selector.select(batch, micro, step, user_ids=doc_ids)
                batch = sel.batch
                doc_ids = [c.split("#")[0] for c in sel.chosen_ids]  # "<doc id>#<hash>"
            if capture is not None:  # stored ids: "<doc id>@<step>#<content hash>"
                capture.tag([f"{d}@{step}" for d in doc_ids])
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach() / gas
        torch.distributed.all_reduce(step_loss)
        lr = float(engine.get_lr()[0]) if engine.lr_scheduler is not None else \
            float(engine.optimizer.param_groups[0]["lr"])
        log.end_step(step, float(step_loss) / world, lr, micro * gas * world, save)
    if capture is not None:
        capture.close()
    summary = log.summary(world=world, captured=bool(capture))
    if capture is not None:  # examples dropped for a NaN/inf gradient, over all ranks
        dropped = torch.tensor([float(capture.skipped_examples)], device=device)
        torch.distributed.all_reduce(dropped)
        summary["capture_dropped_examples"] = int(dropped.item())
    if selector is not None:
        summary["selection"] = selector.summary()
        selector.close()
    torch.distributed.barrier()
    if capture is not None:
        seal_captured_store(cfg.store_config(out).path, rank)
    return summary


def seal_captured_store(path: str, rank: int) -> None:
    """After every rank closed its shard (a barrier), rank 0 records the store complete."""
    from dattri_ds.store import seal_store

    if rank == 0 and (Path(path) / "info.json").exists():
        seal_store(path)


if __name__ == "__main__":
    from dattri_ds.cli import run

    sys.exit(run(main))
