"""Shared benchmark harness: interleaved repeated timing, paired ratios, tables, the GPT-2 model.

The machine is small and shared, so absolute times are noise. Every benchmark runs the
variants it compares side by side: one *round* runs each variant once, in an order that
rotates from round to round, and a ratio is taken per round (paired) before the median
over rounds. Paired ratios cancel the slow drifts of a shared machine; medians drop the
rounds that another process disturbed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # for tests.reference (the tiny GPT-2 builder)


@dataclass
class Variant:
    """One thing to time: ``fn`` is timed, ``setup``/``teardown`` run around it untimed."""

    name: str
    fn: Callable[[], object]
    setup: Callable[[], object] | None = None
    teardown: Callable[[], object] | None = None

    def once(self) -> float:
        if self.setup is not None:
            self.setup()
        try:
            t0 = time.perf_counter()
            self.fn()
            return time.perf_counter() - t0
        finally:
            if self.teardown is not None:
                self.teardown()


def interleaved(variants: Sequence[Variant], reps: int, warmup: int = 1,
                collect: bool = True) -> dict[str, list[float]]:
    """``{name: [seconds per round]}``: ``reps`` rounds, each variant once, rotating order."""
    for _ in range(warmup):
        for v in variants:
            v.once()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    n = len(variants)
    for r in range(reps):
        for j in range(n):
            v = variants[(r + j) % n]
            if collect:
                gc.collect()
            times[v.name].append(v.once())
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of ``time[num] / time[den]`` within the same round."""
    return median([a / b for a, b in zip(times[num], times[den])])


def spread(xs: Sequence[float]) -> tuple[float, float]:
    """(25th, 75th) percentile, a noise indicator printed next to medians."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain fixed-width text table."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1e4 else f"{c:.0f}"
    return str(c)


def base_parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small, fast smoke version")
    p.add_argument("--reps", type=int, default=None, help="timed rounds (median is reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on a shared 2-core machine two "
                        "OpenMP threads stall whenever another process takes a core, "
                        "which made 2-thread timings vary by 10x; 0 = torch's default)")
    return p


def setup_torch(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)


def environment() -> str:
    import platform
    try:
        load = " load=" + "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = ""
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{os.cpu_count()} cpus, {platform.machine()}{load}")


# ---- the GPT-2-style benchmark model ------------------------------------------------
MODEL_DEFAULTS = dict(n_layer=4, n_embd=256, vocab=4096, T=128, B=16)


def gpt2(n_layer: int, n_embd: int, vocab: int, T: int, seed: int = 0):
    """Random-init GPT2LMHeadModel from a config (4 heads, no dropout, untied head)."""
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    from tests.reference import tiny_gpt2

    return tiny_gpt2(seed, n_layer=n_layer, n_embd=n_embd, vocab=vocab, n_positions=T)


def model_args(p: argparse.ArgumentParser) -> None:
    d = MODEL_DEFAULTS
    p.add_argument("--layers", type=int, default=d["n_layer"])
    p.add_argument("--embd", type=int, default=d["n_embd"])
    p.add_argument("--vocab", type=int, default=d["vocab"])
    p.add_argument("--T", type=int, default=d["T"])
    p.add_argument("--B", type=int, default=d["B"])
    p.add_argument("--k", type=int, default=1024, help="projection dim per layer")


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- runs of the shipped training loop ----------------------------------------------
def loop_configs(*, steps: int, seed: int, seq_len: int, eval_every: int, selection,
                 micro: int = 8, gas: int = 2,
                 model_config: str = "configs/model_gpt2_tiny.json"):
    """``(DeepSpeed dict, RunConfig)`` of one benchmark run of the shipped loop
    (``launch.train.train_in_process``, ``--backend torch``): the optimizer, lr schedule and
    clipping of configs/zero3_cpu.json, ``micro x gas`` trained examples per step, no
    checkpoint before the last step, ``selection`` (a SelectionConfig) as given."""
    from dattri_ds.launch.config import BLOCK, RunConfig, TrainConfig
    from dattri_ds.launch.engine import EngineConfig
    from dattri_ds.io.schema import read_json

    ds = read_json(os.path.join(ROOT, "configs/zero3_cpu.json"), "--deepspeed_config")
    ds.pop(BLOCK, None)
    ds = {**ds, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    train = TrainConfig(model_config=os.path.join(ROOT, model_config), steps=steps, seed=seed,
                        seq_len=seq_len, eval_every=eval_every, log_every=steps)
    return ds, RunConfig(train=train, selection=selection,
                         engine=EngineConfig(backend="torch"))
