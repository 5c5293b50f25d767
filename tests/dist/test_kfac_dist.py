"""K-FAC/EK-FAC factors reduced over 2 gloo ranks equal the single-process factors.

Invariant: each rank fits on its own half of the examples; after ``reduce`` (factor sums,
then EK-FAC sums) every rank holds the factors and preconditioned queries of one process
that saw all examples (rel. err <= 1e-10 on sums, 1e-5 on preconditioned queries), and
the ranks agree exactly. A rank without some layer contributes zeros for it.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import GradBatch, GradientCapture
from dattri_ds.distributed import ParallelContext
from dattri_ds.methods import fit_factors
from dattri_ds.ops.kronecker import KFACConfig
from reference import rel_err, tiny_gpt2

from _dist import run

pytestmark = pytest.mark.dist


def _data():
    model = tiny_gpt2(seed=0, n_layer=1, n_embd=8, vocab=31, n_positions=16)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 31, (6, 7), generator=gen)
    q_ids = torch.randint(1, 31, (2, 7), generator=gen)
    with GradientCapture(model, probe_only=True) as cap:
        train = cap.probe(lambda: model(input_ids=ids, labels=ids).loss)
        query = cap.probe(lambda: model(input_ids=q_ids, labels=q_ids).loss)
    return train, query


def _fit_on_half(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    train, query = _data()
    mine = train.index(list(range(rank * 3, rank * 3 + 3)))
    if rank == 1:  # this rank never saw the head: reduce must still line layers up
        mine = GradBatch(0, mine.sample_ids,
                         {n: lg for n, lg in mine.layers.items() if n != "lm_head"})
    ctx = ParallelContext.from_default_group()
    f64 = KFACConfig(dtype="float64")  # exact sums: float32 rounding would differ by order
    dist_f = fit_factors([mine], ctx=ctx, config=f64)
    one = fit_factors([train], ctx=ParallelContext(), config=f64)
    head_only = fit_factors([GradBatch(0, train.sample_ids[:3],
                                       {"lm_head": train.index([0, 1, 2]).layers["lm_head"]})],
                            ctx=ParallelContext(), config=f64)
    sum_errs, prec_errs = {}, {}
    for name, lf in one.layers.items():
        ref = head_only.layers[name] if name == "lm_head" else lf
        for k, t in ref.sums.items():
            sum_errs[(name, k)] = rel_err(dist_f.layers[name].sums[k], t)
    pq = dist_f.precondition(query)
    want = one.precondition(query)
    for name, lg in pq.layers.items():
        if name != "lm_head":
            prec_errs[name] = rel_err(lg.data.values, want.layers[name].data.values)
    return dict(sum_errs=sum_errs, prec_errs=prec_errs,
                prec={n: lg.data.values.tolist() for n, lg in pq.layers.items()})  # no fd passing


def test_two_rank_factors_equal_one_process():
    """2 ranks x 3 examples == 1 process x 6 examples, identical on both ranks."""
    r0, r1 = run(_fit_on_half, 2)
    for res in (r0, r1):
        assert max(res["sum_errs"].values()) <= 1e-10, res["sum_errs"]
        assert max(res["prec_errs"].values()) <= 1e-5, res["prec_errs"]
    for name, v in r0["prec"].items():
        assert v == r1["prec"][name], name
