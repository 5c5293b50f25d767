"""The planner's capture and curvature terms against what a real capture / fit holds.

Two models: GPT-2 tiny (``configs/model_gpt2_tiny.json``: untied embeddings, learned
positions, LayerNorms of 2 x 128 values, wider than the projections' k) and a wide toy
(an embedding of 2000 x 520, a LayerNorm of 2 x 520 values, wider than
``KFACConfig.full_max``, so its factors are diagonal, and a linear head). Invariants:

* ``kfac`` = the tensor bytes of the factor file ``fit_factors`` + ``save`` write (sums,
  counts, EK-FAC sums, eigenbasis; embeddings in ``kron_index`` form), exact, for K-FAC and
  EK-FAC, exact factors and LoGra (Kronecker-projected) factors alike.
* ``captured_factor_bytes``: a norm's dense rows are the capture dtype's (bf16 run), exact.
* ``projections`` = the bytes the process-wide matrix cache holds after a projected capture
  (every projected layer, norms included), exact while they fit ``cache_bytes``; under a
  smaller cap the cache holds at most the plan's ``cap + block`` and more than
  ``cap - block`` (a matrix that does not fit is regenerated per use, one block at a time).
* every layer a real capture projects is routed by the plan (norms on the dense path).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dattri_ds import CaptureConfig, ProjectionConfig, collect, fit_factors
from dattri_ds.models.causal_lm import build_model
from dattri_ds.layers import get_kind
from dattri_ds.ops import projection as projection_mod
from dattri_ds.ops.kronecker import KFACConfig
from dattri_ds.ops.projection import Projector
from dattri_ds.plan import LayerShape, ModelShape, RunSpec, captured_factor_bytes, plan

GPT2_TINY = "configs/model_gpt2_tiny.json"
VOCAB, B, T, K = 97, 3, 12, 64
WIDE_V, WIDE_D, WIDE_OUT = 2000, 520, 50


class Wide(nn.Module):
    """Embedding -> LayerNorm -> Linear head, with a norm wider than ``full_max``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(WIDE_V, WIDE_D)
        self.norm = nn.LayerNorm(WIDE_D)
        self.head = nn.Linear(WIDE_D, WIDE_OUT)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        logits = self.head(self.norm(self.emb(input_ids)))
        return F.cross_entropy(logits.reshape(-1, WIDE_OUT), labels.reshape(-1))


class WideShape(ModelShape):
    def captured_layers(self):
        return [LayerShape("emb", get_kind("embedding"), WIDE_V, WIDE_D),
                LayerShape("norm", get_kind("layernorm"), WIDE_D, 2, bias=True),
                LayerShape("head", get_kind("linear"), WIDE_D + 1, WIDE_OUT, bias=True)]


WIDE_SHAPE = WideShape(family="llama", layers=1, hidden=WIDE_D, heads=1, kv_heads=1,
                       head_dim=WIDE_D, intermediate=WIDE_D, vocab=WIDE_OUT)


def _setup(name: str, dtype: torch.dtype = torch.float32):
    """(model, its ModelShape, batches, loss_fn) of ``gpt2`` or ``wide``."""
    gen = torch.Generator().manual_seed(1)
    if name == "gpt2":
        model = build_model(GPT2_TINY, vocab_size=VOCAB, seed=0).to(dtype)
        ids = [torch.randint(0, VOCAB, (B, T), generator=gen) for _ in range(2)]
        return (model, ModelShape.from_config(GPT2_TINY, vocab_size=VOCAB),
                [{"input_ids": i, "labels": i} for i in ids], lambda m, b: m(**b).loss)
    model = Wide().to(dtype)
    ids = [torch.randint(0, WIDE_V, (B, T), generator=gen) for _ in range(2)]
    labels = [torch.randint(0, WIDE_OUT, (B, T), generator=gen) for _ in range(2)]
    return (model, WIDE_SHAPE, [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)],
            lambda m, b: m(**b))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("projected", [False, True], ids=["exact", "logra"])
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
@pytest.mark.parametrize("name", ["gpt2", "wide"])
def test_kfac_term_equals_the_factor_file(name, method, projected, tmp_path):
    """plan's kfac = the bytes of every tensor in the file ``fit_factors`` writes (exact):
    kron layers' fp32 sums and float64 eigenbases, embeddings' ``S``, vector ``A`` and EK-FAC
    sums, norms' full block (GPT-2, 256 values) or diagonal (wide: 1040 values > full_max);
    LoGra factors in the ``(ko, ki)`` space, norms' projected rows ``k`` wide."""
    model, shape, batches, loss_fn = _setup(name)
    grads = list(collect(model, batches, CaptureConfig(), loss_fn=loss_fn))
    proj = ProjectionConfig(kind="kronecker", dim=K) if projected else None
    factors = fit_factors(grads, config=KFACConfig(), ekfac=method == "ekfac",
                          projector=Projector(proj) if proj else None)
    factors.save(tmp_path / "f.pt")
    state = torch.load(tmp_path / "f.pt", weights_only=True)
    real = sum(_nbytes(part[n].values()) for part in (state["sums"], state["eig"])
               for n in state["sums"])
    spec = RunSpec(seq_len=T, micro_batch=B, dtype="float32", zero_stage=0, train=False,
                   method=method, projection="kronecker", k=K if projected else 2 ** 24)
    assert plan(shape, "cpu", spec).memory["kfac"] == real
    forms = {lf.form.name for lf in factors.layers.values()}
    assert forms >= ({"kron", "full"} if name == "gpt2" or projected else {"kron", "diagonal"})
    assert projected or "kron_index" in forms  # the embeddings' factors are counted


@pytest.mark.parametrize("name", ["gpt2", "wide"])
def test_norm_rows_are_planned_in_the_capture_dtype(name):
    """A bf16 capture keeps the norms' dense rows in bf16: captured_factor_bytes of a
    bf16 run equals the real batch's bytes (2 bytes per value, not 4)."""
    model, shape, batches, loss_fn = _setup(name, torch.bfloat16)
    batch = next(iter(collect(model, batches[:1], CaptureConfig(), loss_fn=loss_fn)))
    dense = [lg.data.values for lg in batch.layers.values() if lg.kind.dense_only]
    assert dense and all(v.dtype == torch.bfloat16 for v in dense)
    want = captured_factor_bytes(shape, RunSpec(seq_len=T, micro_batch=B, dtype="bfloat16"), B)
    assert want["dense"] == _nbytes(dense)
    assert want["grads"] == _nbytes(lg.data.g for lg in batch.layers.values()
                                    if not lg.kind.dense_only)


def _projected_capture(name: str, kind: str, cap: int):
    """Real projected capture from an empty matrix cache: (cache bytes, shape, batch)."""
    model, shape, batches, loss_fn = _setup(name)
    projection_mod._MADE.clear()
    cfg = CaptureConfig(projection=ProjectionConfig(kind=kind, dim=K, cache_bytes=cap))
    try:
        batch = list(collect(model, batches, cfg, loss_fn=loss_fn))[-1]
        return projection_mod._MADE._bytes, shape, batch
    finally:
        projection_mod._MADE.clear()


@pytest.mark.parametrize("kind", ["kronecker", "dense", "sparse", "auto"])
@pytest.mark.parametrize("name", ["gpt2", "wide"])
def test_projection_term_equals_the_matrix_cache(name, kind):
    """Under the default cap, plan's projections = the bytes the process-wide cache holds
    after a real projected capture (every projected layer's seeded matrices, norms'
    included: their rows are projected by the dense or sparse matrix), exact; the plan
    routes exactly the layers the capture projected, norms on the dense path."""
    real, shape, batch = _projected_capture(name, kind, 1 << 31)
    p = plan(shape, "cpu", RunSpec(seq_len=T, micro_batch=B, dtype="float32", k=K,
                                   projection=kind))
    assert p.memory["projections"] == real > 0
    projected = [lg for lg in batch.layers.values() if not lg.space.identity]
    routed = [L for L in shape.captured_layers() if L.name in p.routing]
    # the same layers, per kind (the planner names GPT-2's wte and ln_f embed_tokens, norm)
    for kind_name in {lg.kind.name for lg in projected} | {L.kind.name for L in routed}:
        assert sum(lg.kind.name == kind_name for lg in projected) == \
            sum(L.count for L in routed if L.kind.name == kind_name), kind_name
    norms = [L for L in routed if L.kind.dense_only]
    assert norms and all(p.routing[L.name] == "dense" for L in norms)


@pytest.mark.parametrize("kind", ["kronecker", "sparse", "dense"])
def test_projection_term_under_the_cache_cap(kind):
    """With ``cache_bytes`` below the matrices' sum the cache keeps what fits and regenerates
    the rest per use: it holds more than ``cap - block`` and at most the plan's
    ``cap + block`` (the block made for the use in progress), ``block`` the largest
    matrix made at once (``ProjectionKind.block_bytes``)."""
    full = plan(ModelShape.from_config(GPT2_TINY, vocab_size=VOCAB), "cpu",
                RunSpec(seq_len=T, micro_batch=B, k=K, projection=kind)).memory["projections"]
    cap = int(full // 2)
    real, shape, _ = _projected_capture("gpt2", kind, cap)
    p = plan(shape, "cpu", RunSpec(seq_len=T, micro_batch=B, k=K, projection=kind,
                                   projection_cache_bytes=cap))
    block = p.memory["projections"] - cap
    assert 0 < block < cap
    assert cap - block < real <= cap < p.memory["projections"]
