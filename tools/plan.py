"""Predict per-rank memory and time of a run, and recommend settings (dattri_ds.plan).

    dattri-ds plan --model configs/model_llama_1b.json --vocab-size 4096 --world 2 \
        --device cpu --seq-len 256 --micro-batch 1 --dtype float32 --optimizer sgd
    dattri-ds plan --model path/to/hf/config.json --world 4 --device h200 --seq-len 512 --json
    dattri-ds plan --model ... --world 8 --nodes 2 --method selection --selection-probe
        # + the inter-node bytes per step of capture and selection (docs/multinode.md)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dattri_ds.ops.projection import KINDS  # noqa: E402
from dattri_ds.plan import DEVICES, ModelShape, RunSpec, plan  # noqa: E402
from dattri_ds.plan.traffic import TrafficSpec, traffic  # noqa: E402
from dattri_ds.io.schema import add_flag, field_docs, flag_type  # noqa: E402

_CHOICES = {"zero_stage": [0, 1, 2, 3], "offload": ["none", "optimizer", "all"],
            "dtype": ["float32", "bfloat16"], "optimizer": ["adamw", "sgd", "sgd_momentum"],
            "projection": list(KINDS),
            "method": ["graddot", "tracin", "kfac", "ekfac", "selection"],
            "store_dtype": ["float32", "float16", "bfloat16"]}


#: Ranges of the numeric RunSpec flags (the others: > 0).
_RANGES = {"zero_stage": {"ge": 0, "le": 3}, "k": {"ge": 0}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dattri-ds plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True,
                   help="our JSON model config or a Hugging Face config.json")
    add_flag(p, "--vocab-size", int, ge=1, default=None,
             help="vocabulary size when the config has none (ours: the tokenizer's)")
    p.add_argument("--device", default="cpu", choices=sorted(DEVICES),
                   help="the accelerator (or CPU host) of each rank: its memory, roofline, "
                        "per-kernel latency and calibrated efficiency (dattri_ds.plan.DEVICES)")
    add_flag(p, "--memory-gb", float, gt=0, default=None,
             help="override the device's memory (e.g. what is free on a shared host)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    for cls in (RunSpec, TrafficSpec):
        _add_flags(p, cls)
    return p


def _add_flags(p: argparse.ArgumentParser, cls: type) -> None:
    defaults = cls()
    docs = field_docs(cls)
    for f in fields(cls):  # one flag per field, defaults from the dataclass
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        helptext = f"{docs[f.name]} [default {value}]".replace("%", "%%")
        if isinstance(value, bool):
            p.add_argument(flag, default=value, action=argparse.BooleanOptionalAction,
                           help=helptext)
        else:
            strict = (flag_type(type(value), name=flag, **_RANGES.get(f.name, {"gt": 0}))
                      if isinstance(value, (int, float)) else type(value))
            p.add_argument(flag, type=strict, default=value, choices=_CHOICES.get(f.name),
                           help=helptext)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    model = ModelShape.from_config(args.model, vocab_size=args.vocab_size)
    dev = DEVICES[args.device]
    if args.memory_gb is not None:
        dev = replace(dev, memory_bytes=args.memory_gb * 1e9)
    spec = RunSpec(**{f.name: getattr(args, f.name) for f in fields(RunSpec)})
    result = plan(model, dev, spec)
    out = result.to_dict()
    nodes = TrafficSpec(**{f.name: getattr(args, f.name) for f in fields(TrafficSpec)})
    text = result.table()
    if nodes.nodes > 1:  # inter-node bytes of capture and selection (dattri_ds/plan/traffic.py)
        moved = traffic(model, result.spec, nodes, k=result.spec.k)
        out["traffic"] = moved.to_dict()
        text += "\n" + moved.table()
    print(json.dumps(out, indent=1) if args.json else text)
    return out


if __name__ == "__main__":
    main()
