"""The training loop's data order: one seeded permutation per epoch, read as one stream.

Invariant: ``micro_batch_indices`` gives, for every (step, micro-batch, rank), the stream
positions ``start .. start + micro`` of the permutations ``randperm(n, seed*1000 + epoch)``
laid end to end, with no position skipped or repeated across ranks and micro-batches of a
step. Breaks if the kept epoch order goes stale (a wrong epoch or seed served from it).
"""

from __future__ import annotations

import torch

from dattri_ds.launch.loop import micro_batch_indices


def _reference(n, step, micro, gas, rank, world, seed):
    per_step = micro * gas * world
    rows = []
    for mb in range(gas):
        start = step * per_step + (mb * world + rank) * micro
        rows.append([int(torch.randperm(n, generator=torch.Generator().manual_seed(
            seed * 1000 + k // n))[k % n]) for k in range(start, start + micro)])
    return torch.tensor(rows)


def test_stream_of_seeded_epoch_permutations_across_boundaries():
    n, micro, gas, world = 11, 3, 2, 2  # a step (12 slots) spans an epoch boundary
    for seed in (0, 5):
        seen = []
        for step in range(6):
            for rank in range(world):
                got = micro_batch_indices(n, step, micro, gas, rank, world, seed)
                assert torch.equal(got, _reference(n, step, micro, gas, rank, world, seed))
                seen.append(got)
        every = torch.cat([s.flatten() for s in seen])
        assert sorted(every[:n].tolist()) == list(range(n))  # no example twice in an epoch
