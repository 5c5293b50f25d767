"""Kernel launches and host syncs per path, per model family: what a GPU step would wait on.

    python benchmarks/kernels.py [--families gpt2 llama qwen2 olmo2] [--paths ...]
                                 [--breakdown PATH] [--json FILE]

A GPU step at small sizes is bound by fixed per-kernel and per-sync costs, and their number
does not depend on the device: ``dattri_ds.eval.kernels.KernelCounter`` counts them on the
CPU (its docstring defines both; docs/kernels.md). Every path is run once to warm up (cost
decisions, seeded projection matrices and factors are cached as in a long run), then counted.

Models: random-init tiny causal LMs built in code, hidden 64, 4 heads, vocabulary 256, no
dropout: GPT-2 4 layers, Llama 4 layers (2 KV heads), Qwen2 8 layers (2 KV heads, tied
embeddings), OLMo-2 4 layers; batches of B=4, T=32 (``input_ids``, ``labels``,
``attention_mask``), HF token-mean loss.

Decisions that depend on the device (ghost or dense routes, where stacking layers of one
shape pays) are taken with the CUDA roofline (``Roofline.default("cuda")``), as a GPU run
takes them. Paths (each row: kernels, host syncs, ratio of kernels to ``plain``, extra
kernels per captured layer over ``plain``, or over ``probe`` for collect):

* ``plain``: ``model(**batch).loss.backward()``.
* ``capture exact|kron|default``: the same inside ``GradientCapture`` (no projection,
  ``ProjectionConfig(kind="kronecker", dim=256)``, ``ProjectionConfig()``), then ``pop()``.
* ``probe``: ``torch.autograd.grad`` of the loss to the captured layers' outputs (what
  collect's backward does, no capture): the floor of a collect pass.
* ``collect exact|kron|default|whitened``: one batch of ``collect(model, batches, config)``
  after its first (whitened: EK-FAC factors fitted once on the batch, ``whiten="ekfac"``,
  default projection).
* ``select content|alignment``: one online-selection step (``OnlineSelector.select`` of
  ``C = 4B`` candidates against a validation target of 8 texts, then forward and backward of
  the chosen B), against ``plain``.
* ``launch|bare [+capture]``: one optimizer step of ``launch/loop.py``'s ``train`` with the
  DeepSpeed backend (ZeRO-3 of configs/zero3_cpu.json, 1 process) against a bare DeepSpeed
  step (``engine(**batch)``, ``engine.backward``, ``engine.step``) on the same model and
  config; ``+capture`` with the Kronecker capture (the launch's ``--capture``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# transformers imports the hub's ``kernels`` package: this file must not shadow it
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dattri_ds.eval.kernels import KernelCounter  # noqa: E402

B, T, VOCAB, HIDDEN = 4, 32, 256, 64
#: The tiny model of each family (Hugging Face config fields).
FAMILIES: dict[str, dict] = {
    "gpt2": dict(model_type="gpt2", n_layer=4, n_head=4, n_embd=HIDDEN, n_positions=128,
                 activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, tie_word_embeddings=False),
    "llama": dict(model_type="llama", num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, hidden_size=HIDDEN, intermediate_size=160,
                  max_position_embeddings=128, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, hidden_size=HIDDEN, intermediate_size=160,
                  max_position_embeddings=128, tie_word_embeddings=True),
    "olmo2": dict(model_type="olmo2", num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, hidden_size=HIDDEN, intermediate_size=160,
                  max_position_embeddings=128, tie_word_embeddings=False),
}
CAPTURE_PATHS = ("plain", "capture exact", "capture kron", "capture default", "probe",
                 "collect exact", "collect kron", "collect default", "collect whitened")
SELECT_PATHS = ("select content", "select alignment")
LAUNCH_PATHS = ("bare", "launch", "bare +capture", "launch +capture")
PATHS = CAPTURE_PATHS + SELECT_PATHS + LAUNCH_PATHS


@dataclass(frozen=True)
class Count:
    """One counted path."""

    kernels: int
    syncs: int
    by_op: dict[str, int]
    sync_sites: dict[str, int]


def quiet() -> None:
    """No library warnings or info lines in the printed tables."""
    warnings.filterwarnings("ignore")
    for name in ("transformers", "dattri_ds", "DeepSpeed", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny model (random init, training mode)."""
    from dattri_ds.data.models import build_model

    return build_model(FAMILIES[family], vocab_size=VOCAB, seed=seed)


def batch(rows: int = B, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` random examples of T tokens (no padding)."""
    ids = torch.randint(4, VOCAB, (rows, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def count(fn: Callable[[], object], warmup: int = 1, where: bool = True) -> Count:
    """Kernels and host syncs of ``fn()`` after ``warmup`` uncounted calls."""
    for _ in range(warmup):
        fn()
    with KernelCounter(where=where) as kc:
        fn()
    return Count(kc.kernels, kc.syncs, dict(kc.kernels_by_op), dict(kc.sync_sites))


def _projection(name: str):
    from dattri_ds import ProjectionConfig

    return {"exact": None, "kron": ProjectionConfig(kind="kronecker", dim=256),
            "default": ProjectionConfig(), "whitened": ProjectionConfig()}[name]


def captured_layers(model: torch.nn.Module) -> int:
    """Layers the default capture records on ``model``."""
    from dattri_ds import GradientCapture

    cap = GradientCapture(model).attach()
    try:
        return len(cap.layers)
    finally:
        cap.close()


def gpu_cost():
    """The cost model a CUDA run decides with (``Roofline.default("cuda")``): ghost or dense
    routes and where stacking layers pays are taken as on a GPU, whatever runs the count."""
    from dattri_ds.ops.cost import CostModel, Roofline

    return CostModel(Roofline.default("cuda"))


def capture_paths(family: str, paths: tuple[str, ...]) -> dict[str, Count]:
    """Counts of the plain, capture, probe and collect paths of one family."""
    from dattri_ds import CaptureConfig, GradientCapture

    model, b = build(family), batch()
    out: dict[str, Count] = {}

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        model(**b).loss.backward()
    for path in paths:
        kind, _, variant = path.partition(" ")
        if path == "plain":
            out[path] = count(plain)
        elif kind == "capture":
            cap = GradientCapture(model, CaptureConfig(projection=_projection(variant)),
                                  cost=gpu_cost())
            with cap:
                out[path] = count(lambda: (plain(), cap.pop()))
        elif path == "probe":
            out[path] = count(lambda: _probe(model, b))
        elif kind == "collect":
            out[path] = _collect(model, b, variant)
    model.zero_grad(set_to_none=True)
    return out


def _collect(model: torch.nn.Module, b: dict, variant: str) -> Count:
    """One batch of a running ``collect`` (its second: the first made the projection's
    device matrices, as the first batch of a long collect does)."""
    from dattri_ds import CaptureConfig, collect

    cfg, factors = CaptureConfig(projection=_projection(variant)), None
    if variant == "whitened":
        cfg, factors = _whitening(model, b, cfg)
    batches = collect(model, iter(lambda: b, None), cfg, factors=factors, cost=gpu_cost())
    return count(lambda: next(batches))


def _probe(model: torch.nn.Module, b: dict) -> None:
    """collect's backward without the capture: the loss's gradient w.r.t. the outputs of
    the layers the capture records."""
    from dattri_ds import GradientCapture

    outs = []
    cap = GradientCapture(model).attach()
    hooks = [m.register_forward_hook(lambda mod, a, o: outs.append(o))
             for m, _ in cap.layers.values()]
    cap.close()
    try:
        loss = model(**b).loss
        torch.autograd.grad(loss, [o for o in outs if o.requires_grad])
    finally:
        for h in hooks:
            h.remove()


def _whitening(model, b, cfg):
    """EK-FAC factors of ``model`` fitted on ``b`` and the whitened collect config."""
    from dataclasses import replace

    from dattri_ds import CaptureConfig, collect, fit_factors

    factors = fit_factors(list(collect(model, [b], CaptureConfig())))
    return replace(cfg, whiten="ekfac"), factors


def ratios(counts: dict[str, Count], layers: int) -> list[list[object]]:
    """Table rows: path, kernels, syncs, x plain, extra kernels per captured layer."""
    plain = counts.get("plain")
    probe = counts.get("probe")
    rows = []
    for path, c in counts.items():
        ref = probe if path.startswith("collect") and probe is not None else plain
        ratio = c.kernels / plain.kernels if plain else float("nan")
        extra = (c.kernels - ref.kernels) / layers if ref and path not in ("plain", "probe") \
            else ""
        rows.append([path, c.kernels, c.syncs, round(ratio, 2),
                     round(extra, 1) if extra != "" else ""])
    return rows


def breakdown(base: Count, other: Count, top: int = 25) -> str:
    """The ops ``other`` launches more (or fewer) than ``base``, largest first."""
    ops = set(base.by_op) | set(other.by_op)
    diff = sorted(((other.by_op.get(o, 0) - base.by_op.get(o, 0), o) for o in ops),
                  key=lambda d: -abs(d[0]))
    return ", ".join(f"{o} {d:+d}" for d, o in diff[:top] if d)


def main(argv: list[str] | None = None) -> None:
    from benchmarks._common import environment, table

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--paths", nargs="+", default=list(CAPTURE_PATHS), choices=list(PATHS))
    p.add_argument("--breakdown", action="store_true",
                   help="per path: the ops it launches beyond plain (probe for collect), and "
                        "where every host sync fires")
    p.add_argument("--json", help="write the counts here")
    args = p.parse_args(argv)
    quiet()
    torch.manual_seed(0)
    print(f"B={B}, T={T}, hidden {HIDDEN}, vocab {VOCAB}; {environment()}")
    record = {}
    for family in args.families:
        paths = tuple(args.paths)
        if any(x.startswith("collect") for x in paths) and "probe" not in paths:
            paths = paths + ("probe",)
        if "plain" not in paths:
            paths = ("plain",) + paths
        counts = capture_paths(family, tuple(x for x in paths if x in CAPTURE_PATHS))
        layers = captured_layers(build(family))
        print(f"\n{family}: {layers} captured layers")
        print(table(["path", "kernels", "host syncs", "x plain", "extra / layer"],
                    ratios(counts, layers)))
        if args.breakdown:
            for path, c in counts.items():
                ref = counts["probe"] if path.startswith("collect") else counts["plain"]
                print(f"  {path}: {breakdown(ref, c)}")
                for site, n in c.sync_sites.items():
                    print(f"    sync x{n}: {site}")
        record[family] = {k: {"kernels": c.kernels, "syncs": c.syncs}
                          for k, c in counts.items()} | {"layers": layers}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
