"""The training command: a causal LM on local text, capturing gradients and selecting data on request.

The engine is DeepSpeed (the default), Megatron-core or plain torch (``--backend``).

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/zero3_cpu.json --capture
    torchrun --standalone --nproc_per_node 2 launch/train.py --deepspeed_config ...
    python launch/train.py --deepspeed_config configs/zero2_cpu.json      # one process
    torchrun ... launch/train.py --backend megatron --tensor-model-parallel-size 2 ...
    python launch/train.py --backend torch --deepspeed_config ...    # no DeepSpeed engine

Our settings live in the ``"dattri_ds"`` block of the DeepSpeed JSON (launch/config.py);
flags override them (launch/args.py). This file runs the checks at start (launch/checks.py),
opens the data (prepared once and memory-mapped: launch/data.py) and the selector, and hands
them to the loop (launch/loop.py) with a backend
(launch/backend.py), the evaluator (launch/evaluate.py) and, on ``--resume``, the state
launch/resume.py restored. ``train_in_process`` runs the loop on the torch backend for
callers that already hold their examples (tools/demo.py, the selection benchmarks). What the
output directory receives: docs/training.md.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `dattri_ds.launch` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from dattri_ds.errors import ConfigError  # noqa: E402
from dattri_ds.launch.args import load_run_config, parse_args  # noqa: E402
from dattri_ds.launch.backend import backend_class  # noqa: E402
from dattri_ds.launch.checks import check_inputs, check_outputs  # noqa: E402
from dattri_ds.launch.config import RunConfig, dump_json  # noqa: E402
from dattri_ds.launch.engine import resolve_batch  # noqa: E402
from dattri_ds.launch.evaluate import make_evaluator, tokenized_texts  # noqa: E402
from dattri_ds.launch.data import (  # noqa: E402
    check_overlap, data_record, data_source, save_run_tokenizer, training_data,
)
from dattri_ds.launch.loop import train  # noqa: E402
from dattri_ds.launch.resume import check_resume, resume  # noqa: E402
from dattri_ds.launch.runlog import record_failure  # noqa: E402
from dattri_ds.cli.noise import (  # noqa: E402
    quiet_third_party, setup_logging, warn_once_per_launch,
)
from dattri_ds.selection import OnlineSelector, check_target_compatible  # noqa: E402

logger = logging.getLogger("dattri_ds.launch")
# DeepSpeed calls torch collectives that torch 2.13 marks deprecated: noise for our users.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def main(argv: list[str] | None = None) -> dict:
    if "--verbose" not in (sys.argv[1:] if argv is None else argv):
        quiet_third_party()  # DeepSpeed / Megatron / transformers chatter, from their import on
    args = parse_args(argv)
    warn_once_per_launch()  # ranks reading one config warn alike: once per launch
    ds_config, cfg = load_run_config(args.deepspeed_config, args.overrides)
    check_inputs(cfg)  # model positions, target texts, the --init-from run
    check_resume(cfg, args.out, ds_config)  # a resume the checkpoint cannot continue
    check_outputs(Path(args.out), cfg)  # the output door, before any process group
    backend_cls = backend_class(cfg.engine.backend)
    rank, _ = backend_cls.setup(ds_config, cfg)
    setup_logging(rank, args.verbose)
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    data, tok = training_data(cfg, out, rank)  # prepared once, memory-mapped
    check_overlap(cfg, data, rank)
    backend = backend_cls(ds_config, cfg, tok, data)
    try:
        summary = _run(backend, ds_config, cfg, data, tok, out, rank)
    except BaseException as err:  # summary.json: the step reached and the cause
        record_failure(err)
        raise
    if rank == 0:
        logger.info("done: %s", json.dumps(summary))
    return summary


def _run(backend, ds_config: dict, cfg: RunConfig, data, tok, out: Path, rank: int, *,
         target=None, evaluator=None, wrap_selector=None) -> dict:
    """On a built backend: resume (refused before anything is overwritten), the run's files,
    selector and evaluator, ``loop.train``, ``summary.json``; the summary."""
    record = data_record(data, tok)
    resumed = resume(backend, cfg, out, rank, record)
    if rank == 0:
        backend.write_model_config(out)
        dump_json(out / "resolved_deepspeed_config.json", ds_config)
        dump_json(out / "resolved_dattri_ds_config.json", cfg)
        if record is not None:  # the data it trains on, and its tokenizer's copy
            dump_json(out / "data.json", {"record": record, **data.describe(),
                                          "source": data_source(cfg.train),
                                          "tokenizer": tok.describe()})
            save_run_tokenizer(tok, out)
    selector = _selector(backend, cfg, data, tok, out, target=target)
    if selector is not None and wrap_selector is not None:
        selector = wrap_selector(selector, backend)
    if evaluator is None:
        evaluator = make_evaluator(backend.model, cfg, tok, data.seq_len, backend.ctx,
                                   backend.device)
    summary = train(backend, cfg, data, out, tok, rank, selector, evaluator, resumed)
    if rank == 0:
        dump_json(out / "summary.json", summary)
    return summary


def train_in_process(ds_config: dict, cfg: RunConfig, data, tok, out: Path, *,
                     target=None, evaluator=None, wrap_selector=None):
    """One run of the shipped loop in this process on ``--backend torch``.

    What ``main`` does after preparing the data, for a caller that holds it already: the
    backend, the selector of ``cfg.selection`` (``make_selector``; the target texts are
    ``target`` model inputs, else read from ``selection.target_data``), the evaluator
    (``evaluator``, else ``make_evaluator``), ``loop.train``, and the run's files in ``out``
    (resolved configs, model config, checkpoints, trajectory.json, summary.json).

    Args:
        ds_config: the DeepSpeed JSON without its ``"dattri_ds"`` block (batch sizes,
            clipping, optimizer, scheduler).
        cfg: the run's config (``cfg.engine.backend`` must be ``"torch"``).
        data, tok: the tokenized training examples and their tokenizer.
        target: ``{"input_ids", ...}`` of the selection's target texts, or None.
        evaluator: ``() -> {"target_loss": ..., ...}`` called at every evaluation step.
        wrap_selector: ``(selector, backend) -> selector`` (diagnostics around the choice).

    Returns:
        ``(summary, backend)``: the run summary and the trained TorchBackend.

    Raises:
        ConfigError: another backend, or anything ``main`` refuses.
    """
    from dattri_ds.launch.torch_backend import TorchBackend

    if cfg.engine.backend != "torch":
        raise ConfigError(f"train_in_process runs --backend torch, not "
                          f"'{cfg.engine.backend}': set engine.backend='torch' or launch "
                          f"launch/train.py")
    resolve_batch(ds_config, 1, "the DeepSpeed config")  # DeepSpeed's batch rule
    check_resume(cfg, out, ds_config)
    TorchBackend.setup(ds_config, cfg)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    backend = TorchBackend(ds_config, cfg, tok, data)
    return _run(backend, ds_config, cfg, data, tok, out, 0, target=target, evaluator=evaluator,
                wrap_selector=wrap_selector), backend


def make_selector(model, cfg: RunConfig, data, tok, ctx, device, log_path, target=None):
    """The OnlineSelector of ``--online-selection`` on ``model`` (what the loop calls), for
    both backends; every check runs before the first step. None when selection is off.
    ``target`` (model inputs of the target texts) replaces reading ``--target-data``."""
    sc = cfg.selection
    if not sc.enabled:
        return None
    tdata = target
    if not sc.target_store and tdata is None:
        if sc.target_data is None:
            raise ConfigError("--online-selection needs the target texts: pass --target-data "
                              "FILE.jsonl (e.g. a validation set of the task you care about) "
                              "or --selection-target-store STORE")
        tdocs = tokenized_texts(sc.target_data, tok, data.seq_len, slice(0, sc.target_max_docs))
        check_target_compatible(data, tdocs)
        tdata = tdocs.batch(slice(None))
    return OnlineSelector.for_target_data(model, sc, tdata, capture=cfg.capture, ctx=ctx,
                                          device=device, log_path=log_path)


def _selector(backend, cfg: RunConfig, data, tok, out: Path, target=None):
    """``make_selector`` on the backend's model (refused engines fail here, at start)."""
    if not cfg.selection.enabled:
        return None
    backend.check_selection()
    return make_selector(backend.model, cfg, data, tok, backend.ctx, backend.device,
                         backend.selection_log(out), target=target)


if __name__ == "__main__":
    from dattri_ds.cli.exits import run

    sys.exit(run(main))
