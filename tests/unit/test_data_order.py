"""The training loop's data order: one seeded permutation per epoch, read as one stream.

Invariant: ``micro_batch_indices`` gives, for every (step, micro-batch, rank), the stream
positions ``start .. start + micro`` of the permutations ``randperm(n, seed*1000 + epoch)``
laid end to end, with no position skipped or repeated across ranks and micro-batches of a
step; ``step_slots`` numbers the repeats of an example within a step (a step past the end
of an epoch). Breaks if the kept epoch order goes stale (a wrong epoch or seed served from
it), or if two slots of a step get the same id.
"""

from __future__ import annotations

import torch

from dattri_ds.launch.loop import micro_batch_indices, step_slots
from dattri_ds.sample_id import SampleId


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


def test_repeats_count_earlier_slots_of_the_same_example_in_the_step():
    """4 ranks x 2 micro-batches x 4 candidates over 48 documents: step 1's 32 slots run past
    the end of epoch 0, so documents of its tail come back at the head of epoch 1 in the same
    step. Every repeat (and only a repeat) is numbered 1, 2, ... in stream order, so the
    loop's ids ``doc@step[+repeat]`` of a step are unique over its slots; the indices equal
    ``micro_batch_indices`` rank by rank."""
    n, micro, gas, world, seed = 48, 4, 2, 4, 0
    repeated = 0
    for step in range(5):
        slots, repeats = step_slots(n, step, micro, gas, world, seed)
        counts, want = {}, []
        for i in slots.flatten().tolist():  # stream order: (micro-batch, rank, slot)
            want.append(counts.get(i, 0))
            counts[i] = want[-1] + 1
        assert repeats.flatten().tolist() == want
        repeated += sum(r > 0 for r in want)
        ids = {SampleId.user_id(f"doc{i}", step, r)
               for i, r in zip(slots.flatten().tolist(), repeats.flatten().tolist())}
        assert len(ids) == micro * gas * world
        for rank in range(world):
            assert torch.equal(slots[:, rank], micro_batch_indices(n, step, micro, gas, rank,
                                                                   world, seed))
    assert repeated > 0  # the case the test is about occurs (step 1 here)
    a_step_within_an_epoch = step_slots(n, 0, micro, gas, world, seed)[1]
    assert not a_step_within_an_epoch.any()  # no repeat: the ids are the unrepeated ones
