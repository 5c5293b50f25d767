"""Does truncated scoring (``top_blocks``) choose what full scoring chooses? Real runs.

    python benchmarks/selection_truncation.py --targets hamlet trivia code --seeds 2 \\
        --steps 100 --multiple 2 --blocks 1 2 3

The setup of benchmarks/selection_effect.py (tiny GPT-2 with 4 blocks, the shipped target
sets, the shipped loop on ``--backend torch`` with configs/zero3_cpu.json's AdamW, schedule
and clipping, micro-batch 8 x 2 accumulation, seq_len 64). Each run trains with
the shipped default selection (every layer scored); at every micro-batch the same
candidates are also scored by selectors that score only the top N blocks (each with its
own target gradient over the same layers, refreshed at the same steps). Per N it prints,
over all micro-batches of all runs: the Spearman rank correlation of the candidates'
scores with full scoring, and the overlap of the policy's picks (the top
``k - round(uniform_mix * k)`` by score, what the default policy takes by score) with
full scoring's, next to the overlap two independent uniform draws would have.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import loop_configs  # noqa: E402
from benchmarks.selection_effect import Setup  # noqa: E402
from dattri_ds.selection import OnlineSelector, SelectionConfig  # noqa: E402


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Rank correlation (ties broken by position; scores are continuous)."""
    rx = torch.argsort(torch.argsort(x)).double()
    ry = torch.argsort(torch.argsort(y)).double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()).clamp_min(1e-30))


def top(scores: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(scores, k).indices.tolist())


class AlsoTruncated:
    """The selector ``loop.train`` calls (full scoring, which trains), with every truncated
    selector scoring the same candidates at each micro-batch."""

    def __init__(self, full, trunc: dict, k_pol: int) -> None:
        self.full, self.trunc, self.k_pol = full, trunc, k_pol
        self.stats = {n: {"spearman": [], "overlap": []} for n in trunc}

    def num_candidates(self, micro: int) -> int:
        return self.full.num_candidates(micro)

    def select(self, batch: dict, micro: int, step: int, **kw):
        sel = self.full.select(batch, micro, step, **kw)
        s_full = sel.scores.detach().float().cpu()
        for n, t in self.trunc.items():
            s = t.score(batch, step)[1].detach().float().cpu()
            self.stats[n]["spearman"].append(spearman(s_full, s))
            self.stats[n]["overlap"].append(len(top(s_full, self.k_pol) & top(s, self.k_pol))
                                            / self.k_pol)
        return sel

    def summary(self) -> dict:
        return self.full.summary()

    def close(self) -> None:
        for s in (self.full, *self.trunc.values()):
            s.close()


def run(setup: Setup, base: SelectionConfig, blocks: list[int], seed: int, steps: int,
        micro: int = 8, gas: int = 2) -> dict[int, dict[str, list[float]]]:
    """One run of the shipped loop (``train_in_process``) with the default selection."""
    import tempfile

    from dattri_ds.launch.train import train_in_process

    ds, cfg = loop_configs(steps=steps, seed=seed, seq_len=setup.seq_len, eval_every=0,
                           selection=base, micro=micro, gas=gas)
    target = setup.score.batch(slice(None))
    k_pol = micro - round(base.uniform_mix * micro)
    got = {}

    def also_truncated(full, backend) -> AlsoTruncated:
        trunc = {n: OnlineSelector.for_target_data(
                     backend.model, replace(base, top_blocks=n), target) for n in blocks}
        got["obs"] = AlsoTruncated(full, trunc, k_pol)
        return got["obs"]

    with tempfile.TemporaryDirectory(prefix="selection_truncation_") as out:
        train_in_process(ds, cfg, setup.pool, setup.tok, Path(out), target=target,
                         wrap_selector=also_truncated)
    return got["obs"].stats


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=["hamlet", "trivia", "code"])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--multiple", type=float, default=2.0)
    p.add_argument("--blocks", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    base = SelectionConfig(enabled=True, target_data="<benchmark>", score="alignment",
                           candidate_multiple=args.multiple)
    k_pol = 8 - round(base.uniform_mix * 8)
    chance = k_pol / math.ceil(args.multiple * 8)  # E|A & B| / k of two uniform k-subsets
    print(f"# {time.strftime('%H:%M:%S')} selection_truncation {' '.join(sys.argv[1:])}; "
          f"default selection (full scoring) trains; policy picks {k_pol} of "
          f"{int(args.multiple * 8)} by score (chance overlap {chance:.2f})", flush=True)
    for target in args.targets:
        setup = Setup(target, args.seq_len, 64)
        per_seed: dict[int, list[tuple[float, float]]] = {n: [] for n in args.blocks}
        for seed in range(args.seeds):
            stats = run(setup, base, args.blocks, seed, args.steps)
            for n, st in stats.items():
                per_seed[n].append((statistics.mean(st["spearman"]),
                                    statistics.mean(st["overlap"])))
                print(f"{target} seed {seed} top {n} of 4 blocks: spearman "
                      f"{per_seed[n][-1][0]:.3f} overlap {per_seed[n][-1][1]:.3f} "
                      f"({len(st['overlap'])} micro-batches)", flush=True)
        for n in args.blocks:
            rs, ov = zip(*per_seed[n])
            print(f"== {target} top {n}: spearman {statistics.mean(rs):.3f} overlap of picks "
                  f"{statistics.mean(ov):.3f} (chance {chance:.2f}), {args.seeds} seeds",
                  flush=True)


if __name__ == "__main__":
    main()
