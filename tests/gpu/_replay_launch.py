"""launch/train.py with the selection's choices recorded, replayed or perturbed (test harness).

    python tests/gpu/_replay_launch.py [--replay CPU_RUN/selection.jsonl] [--perturb REL]
        [--natural FILE] -- <launch/train.py flags>

* ``--replay``: every ``Choose`` stage call (in step, micro-batch order) first makes its own
  choice (written to ``--natural``: what this device would have chosen), then ranks the
  recorded run's chosen ids first, so the policy picks them (the uniform share follows from
  the same seeded draw): the same examples are trained on both devices.
* ``--perturb REL``: the scores the policy ranks are multiplied by ``1 + REL * u`` with
  ``u`` uniform in [-1, 1] (seeded): a stand-in for another device's rounding (TF32 keeps
  10 mantissa bits: REL ~ 1e-3).

TF32 is turned off for matmuls and convolutions (``NVIDIA_TF32_OVERRIDE=0`` is set by the
tests as well), so CUDA matmuls round like fp32.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _options(argv: list[str]) -> tuple[dict, list[str]]:
    if "--" in argv:  # torchrun drops a leading "--": then every flag is launch's
        cut = argv.index("--")
        own, rest = argv[:cut], argv[cut + 1:]
    else:
        own, rest = [], argv
    opts = {"replay": None, "perturb": 0.0, "natural": None}
    for i in range(0, len(own), 2):
        opts[own[i].lstrip("-")] = own[i + 1]
    return opts, rest


def install(opts: dict) -> None:
    from dattri_ds.selection import read_selection_log
    from dattri_ds.selection.stages import Choose

    recorded = read_selection_log(opts["replay"]) if opts["replay"] else None
    calls = {"n": 0}
    natural = open(opts["natural"], "w", encoding="utf-8") if opts["natural"] else None
    rel = float(opts["perturb"])
    original = Choose.__call__

    def choose(self, s):
        i = calls["n"]
        calls["n"] += 1
        if rel:
            gen = torch.Generator().manual_seed(1000 + i)
            u = torch.rand(s.ranked.shape, generator=gen, dtype=torch.float64) * 2 - 1
            s = replace(s, ranked=s.ranked * (1 + rel * u).to(s.ranked))
        own = original(self, s)
        if recorded is None:
            return own
        want = recorded[i]["chosen"]
        if natural is not None:
            natural.write(json.dumps({"step": s.step, "natural": list(own.selection.chosen_ids),
                                      "forced": want}) + "\n")
            natural.flush()
        if list(own.selection.chosen_ids) == want:
            return own
        ids = list(s.grads.sample_ids)
        missing = [w for w in want if w not in ids]
        if missing:
            raise RuntimeError(f"replay: step {s.step} has no candidates {missing}: the runs "
                               f"read different data")
        forced = original(self, replace(s, ranked=_forcing(self, s, ids, want)))
        assert list(forced.selection.chosen_ids) == want, (forced.selection.chosen_ids, want)
        return forced

    Choose.__call__ = choose


def _forcing(choose, s, ids: list[str], want: list[str]) -> torch.Tensor:
    """Scores that make ``Choose`` pick ``want``: the policy's top ``n`` are some ``n`` of
    them and the seeded uniform draw fills the rest, so find the ``n`` whose draw (same
    generator, same excluded set) completes ``want``."""
    from itertools import combinations

    from dattri_ds.selection.policy import mixed
    from dattri_ds.selection.stages import generator

    k = len(want)
    n = k - round(choose.uniform_mix * k)
    pos = [ids.index(w) for w in want]
    for top in combinations(pos, n):
        ranked = torch.full((len(ids),), -1.0, dtype=torch.float64)
        ranked[list(top)] = 1.0
        got = mixed(ranked, k, uniform_mix=choose.uniform_mix,
                    generator=generator(s.step, s.grads.sample_ids))
        if sorted(got.tolist()) == sorted(pos):
            return ranked.to(s.ranked)
    raise RuntimeError(f"replay: no ranking makes the policy choose {want} at step {s.step}")


def main() -> int:
    opts, rest = _options(sys.argv[1:])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    install(opts)
    from dattri_ds.cli.exits import run
    from dattri_ds.launch.train import main as launch_main

    return run(launch_main, rest)


if __name__ == "__main__":
    sys.exit(main())
