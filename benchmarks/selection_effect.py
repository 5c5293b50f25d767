"""Does online selection help? Target loss after equal trained examples, selection vs random.

    python benchmarks/selection_effect.py [--seeds 3] [--steps 150] [--world 2] [--quick]

For every seed, trains twice with launch/train.py (DeepSpeed ZeRO-3) on the built-in mixed
corpus with the same candidate stream (2x candidates per trained example): once choosing by
gradient alignment with the Hamlet target set, once uniformly at random from the same
candidates. Reports the held-out Hamlet loss of both at the end, the gap per seed, its
mean and spread (selection must win on average).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.main_job import run_training  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default="runs/bench-selection")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    args.config, args.max_docs, args.seq_len = "configs/zero3_cpu.json", 3500, 64
    args.eval_every, args.save_every = args.steps, args.steps
    if args.quick:
        args.seeds, args.steps, args.max_docs = 2, 10, 400
        args.eval_every = args.save_every = args.steps
    rows = []
    for seed in range(args.seeds):
        res = {}
        for mode, extra in (("selection", []), ("random", ["--random-selection"])):
            out = ROOT / args.out / f"seed{seed}-{mode}"
            s = run_training(out, args, ["--online-selection", "--seed", str(seed), *extra])
            res[mode] = s["eval"][-1]["target_loss"]
        rows.append((seed, res["selection"], res["random"], res["random"] - res["selection"]))
        print(f"seed {seed}: selection {rows[-1][1]:.4f}  random {rows[-1][2]:.4f}  "
              f"gain {rows[-1][3]:+.4f}", flush=True)
    gains = [r[3] for r in rows]
    mean = statistics.mean(gains)
    sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
    print(f"\nHamlet loss gain of selection over random after {args.steps} steps: "
          f"mean {mean:+.4f} nats/token, sd {sd:.4f}, min {min(gains):+.4f}, "
          f"max {max(gains):+.4f} over {len(gains)} seeds")
    print(json.dumps({"gains": gains, "mean": mean, "sd": sd}))


if __name__ == "__main__":
    main()
