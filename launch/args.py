"""Command-line flags of launch/train.py; each maps one-to-one onto a RunConfig field."""

from __future__ import annotations

import argparse

__all__ = ["build_parser", "parse_args"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a causal LM with DeepSpeed; capture per-example gradients and "
                    "select data online with dattri-ds.")
    p.add_argument("--out", default="runs/train", help="output directory")
    p.add_argument("--model-config", help="JSON model config (random init) [train.model_config]")
    p.add_argument("--model-path", help="local HF model directory [train.model_path]")
    p.add_argument("--train-data", nargs="+", help="training jsonl file(s) [train.train_data]")
    p.add_argument("--max-docs", type=int, help="use the first N documents [train.max_docs]")
    p.add_argument("--seq-len", type=int, help="tokens per example [train.seq_len]")
    p.add_argument("--vocab-size", type=int, help="tokenizer vocabulary [train.vocab_size]")
    p.add_argument("--steps", type=int, help="optimizer steps [train.steps]")
    p.add_argument("--seed", type=int, help="seed [train.seed]")
    p.add_argument("--save-every", type=int, help="checkpoint every N steps [train.save_every]")
    p.add_argument("--log-every", type=int, help="log every N steps [train.log_every]")
    p.add_argument("--eval-every", type=int, help="held-out loss every N steps [train.eval_every]")
    p.add_argument("--eval-data", help="held-out jsonl [train.eval_data]")
    p.add_argument("--capture", action="store_true", default=None,
                   help="store projected per-example gradients of the training stream "
                        "[capture_enabled]")
    g = p.add_argument_group("online data selection (selection.* in the dattri_ds block)")
    g.add_argument("--online-selection", "--enable-online-selection", dest="online_selection",
                   action="store_true", default=None,
                   help="score candidates against the target gradient every micro-batch and "
                        "train on the best [selection.enabled]")
    g.add_argument("--target-data", help="target texts (jsonl) [selection.target_data]")
    g.add_argument("--target-max-docs", type=int, help="[selection.target_max_docs]")
    g.add_argument("--candidate-multiple", type=float,
                   help="candidates per trained example [selection.candidate_multiple]")
    g.add_argument("--selection-policy", choices=["topk", "fraction", "threshold", "greats"],
                   help="[selection.policy]")
    g.add_argument("--selection-scope", choices=["rank", "global"], help="[selection.scope]")
    g.add_argument("--refresh-every", type=int, help="[selection.refresh_every]")
    g.add_argument("--selection-normalize", action="store_true", default=None,
                   help="score by cosine with the target [selection.normalize]")
    g.add_argument("--random-selection", action="store_true", default=None,
                   help="baseline: draw the trained examples uniformly from the same candidates "
                        "[selection.random]")
    m = p.add_argument_group("backend (launch/megatron_backend.py for megatron)")
    m.add_argument("--backend", choices=["deepspeed", "megatron"], default="deepspeed",
                   help="deepspeed: a DeepSpeed engine on a Hugging Face model; megatron: a "
                        "Megatron-core GPTModel with tensor parallelism and a torch optimizer "
                        "(the DeepSpeed JSON gives the dattri_ds block, batch sizes, optimizer "
                        "and scheduler)")
    m.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="megatron: tensor-parallel size (must divide the number of processes, "
                        "hidden size, heads and FFN size)")
    m.add_argument("--sequence-parallel", action="store_true",
                   help="megatron: Megatron sequence parallelism (needs TP > 1 and a sequence "
                        "length divisible by it)")
    m.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="megatron: only 1 is supported (refused otherwise)")
    m.add_argument("--verify-checkpoints", action="store_true",
                   help="megatron: reload each consolidated checkpoint on every rank and check "
                        "it equals the live tensor-parallel shards")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                   help="set by the deepspeed launcher")
    try:
        import deepspeed

        deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    except ImportError:  # pragma: no cover - deepspeed is an optional extra
        p.add_argument("--deepspeed_config", required=True)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if not getattr(args, "deepspeed_config", None):
        build_parser().error("--deepspeed_config is required (e.g. configs/zero3_cpu.json)")
    return args
