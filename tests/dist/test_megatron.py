"""Megatron-core tensor parallelism (2 gloo ranks, CPU): TP=2 capture equals TP=1.

Invariant: with the same weights and examples, every sharded layer's per-example gradient
(all-gathered from its shards), its Kronecker/dense projections, and the whole-model inner
products and norms of a TP=2 model equal those of the TP=1 model and of a one-example-per-
backward reference (rel. err <= 1e-5, fp32), also with sequence parallelism; scores are
bitwise identical on both tensor-parallel ranks; misconfigurations fail at attach, by name.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
from _deps import require
import torch
import torch.nn.functional as F
from torch import nn

require("megatron.core", "megatron")
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|Torch Norm).*")
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from dattri_ds import (  # noqa: E402
    CaptureConfig, Dense, GradientCapture, ProjectionConfig, Projector,
)
from dattri_ds.errors import ConfigError, UnsupportedLayerError  # noqa: E402
from dattri_ds.integrations.megatron import megatron_capture, prepare_model  # noqa: E402
from dattri_ds.models.megatron_gpt import cpu_workarounds, gpt_block_spec  # noqa: E402
from dattri_ds.layers import kind_for  # noqa: E402
from dattri_ds.ops import (  # noqa: E402
    cross_gram, grad_sum, kron_dims, layer_cross_gram, materialize, sq_norms,
)
from dattri_ds.distributed import ParallelContext  # noqa: E402
from dattri_ds.ops.inner import (  # noqa: E402
    gather_shards, project_batch, unshard, unshard_batch,
)
from dattri_ds.ops.kronecker import KFACConfig, KFACFactors  # noqa: E402
from reference import rel_err  # noqa: E402

from _dist import run  # noqa: E402

pytestmark = pytest.mark.dist
V, H, FF, S, B = 32, 16, 32, 8, 3
TOL = 1e-5


def init_parallel(tp: int, pp: int = 1) -> None:
    """(Re)build Megatron's groups on this worker; CPU workarounds of docs/cpu_setup.md."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    cpu_workarounds()  # the library's own (docs/cpu_setup.md), also for sequence-parallel buffers


def tconfig(tp: int, sp: bool = False, **kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FF,
                tensor_model_parallel_size=tp, sequence_parallel=sp and tp > 1,
                use_cpu_initialization=True, perform_initialization=True,
                gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


class MLPBlock(nn.Module):
    """VocabParallelEmbedding -> Column (skip_bias_add) -> GeLU -> Row -> Column head
    (gather_output).

    Sequence-first after the embedding; with sequence parallelism the embedding is
    reduce-scattered along S and the Row output too. Returns per-token losses ``[B, S]``
    (labels -100 carry no loss).
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        init = lambda w: nn.init.normal_(w, std=0.3)  # noqa: E731
        self.sp = cfg.sequence_parallel
        self.emb = tensor_parallel.VocabParallelEmbedding(
            V, H, init_method=init, reduce_scatter_embeddings=self.sp, config=cfg)
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            H, FF, config=cfg, init_method=init, bias=True, gather_output=False,
            skip_bias_add=True)
        self.fc2 = tensor_parallel.RowParallelLinear(
            FF, H, config=cfg, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False)
        self.head = tensor_parallel.ColumnParallelLinear(
            H, V, config=cfg, init_method=init, bias=True, gather_output=True)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)  # [S/2, B, H] reduce-scattered, else [B, S, H]
        if not self.sp:
            x = x.transpose(0, 1).contiguous()
        h, b = self.fc1(x)
        y, _ = self.fc2(F.gelu(h + b))
        logits, _ = self.head(y)  # [S, B, V]
        return F.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # Megatron zero-inits biases: make every term count
            if p.dim() == 1 and p.abs().sum() == 0:
                p.normal_(0, 0.3)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def load_shards(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full TP=1 weights into a TP=r model, slicing tensor-parallel parameters."""
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for n, p in model.named_parameters():
            full = state[n]
            if getattr(p, "tensor_model_parallel", False):
                full = full.chunk(tp, dim=p.partition_dim)[rank]
            p.copy_(full)


def examples(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, :3] = -100  # unequal loss-token counts: the per-example scale is not uniform
    labels[2, 5:] = -100
    return ids, labels


def reference(model, call, ids, labels, names):
    """``{layer: [B, D]}`` canonical local grads, one backward of ``S_b`` per example.

    Replicated parameters under sequence parallelism get partial grads per rank; they are
    all-reduced over the tensor-parallel group, as Megatron's finalize_model_grads does.
    """
    import torch.distributed as dist

    mods = dict(model.named_modules())
    out = {n: [] for n in names}
    for b in range(ids.shape[0]):
        model.zero_grad(set_to_none=True)
        call(ids[b:b + 1], labels[b:b + 1]).sum().backward()
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        for n in names:
            m = mods[n]
            grads = {k: p.grad for k, p in m.named_parameters(recurse=False)}
            out[n].append(kind_for(m).canonical(m, grads).detach().clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(v) for n, v in out.items()}


def capture(model, call, ids, labels, cfg: CaptureConfig, megatron: bool = False):
    cap = megatron_capture(model, cfg) if megatron else GradientCapture(model, cfg)
    with cap:
        ll = call(ids, labels=labels)
        n = (labels != -100).sum(1)
        if cfg.loss_reduction == "example_mean":
            loss = (ll.sum(1) / n.clamp_min(1)).mean()
        else:
            loss = ll.sum() / (n.sum() if cfg.loss_reduction == "token_mean" else 1)
        loss.backward()
        batch = cap.pop()
    model.zero_grad(set_to_none=True)
    return batch


PROJ = {"kron": ProjectionConfig(kind="kronecker", dim=64, seed=3),
        "dense": ProjectionConfig(kind="dense", dim=24),
        "identity": ProjectionConfig(dim=1 << 20)}


def projection_refs(ref: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]]):
    """Reference projections of full rows: kron(P_out, P_in), dense P, identity."""
    out = {}
    for key, cfg in PROJ.items():
        proj = Projector(cfg)
        for n, r in ref.items():
            o, i = shapes[n]
            if o * i <= cfg.dim:
                out[key, n] = r
            elif cfg.kind == "dense":
                out[key, n] = r @ proj.dense_matrix(n, o * i, cfg.dim).T
            else:
                ko, ki = kron_dims(cfg.dim, o, i)
                k = torch.kron(proj.side(n, "out", ko, o, torch.device("cpu")),
                               proj.side(n, "in", ki, i, torch.device("cpu")))
                out[key, n] = r @ k.T
    return out


def compare(batch, ref, shapes, capture_cfg=None):
    """Errors of a (possibly sharded) batch against full reference rows, all ops."""
    names = list(ref)
    full = torch.cat([ref[n] for n in names], 1)
    errs = {f"grad:{n}": rel_err(gather_shards(batch.layers[n]), ref[n]) for n in names}
    errs["gram"] = rel_err(cross_gram(batch, batch, names), full @ full.T)
    errs["sq_norms"] = rel_err(sq_norms(batch, names), full.pow(2).sum(1))
    target = type(batch)(-1, ("t",), {n: grad_sum(batch.layers[n]) for n in names})
    errs["cross_dense"] = rel_err(cross_gram(batch, target, names)[:, 0], full @ full.sum(0))
    for n in names:  # an unsharded full-layer dense target is sliced to each shard
        lg = batch.layers[n]
        tgt = lg.replace(data=Dense(ref[n].sum(0, keepdim=True)), shape=shapes[n], shard=None)
        errs[f"full_target:{n}"] = rel_err(layer_cross_gram(lg, tgt)[:, 0], ref[n] @ ref[n].sum(0))
        if lg.shard is not None:
            errs[f"unshard:{n}"] = rel_err(gather_shards(unshard(lg)), ref[n])
    want = projection_refs(ref, shapes)
    for key, cfg in PROJ.items():
        pb = project_batch(batch, Projector(cfg))
        for n in names:
            errs[f"{key}:{n}"] = rel_err(pb.layers[n].data.values, want[key, n])
        assert all(pb.layers[n].shard is None and pb.layers[n].shape == shapes[n] for n in names)
    scores = {"gram": cross_gram(batch, batch, names), "norms": sq_norms(batch, names)}
    return errs, scores


def kfac_scores(batch):
    """EK-FAC self-influence grams of a batch (factors fitted on the batch itself)."""
    factors = KFACFactors(KFACConfig(damping=0.1))
    factors.update(batch)
    factors.reduce(ParallelContext())  # TP ranks hold the same examples: no reduction
    factors.eigendecompose()
    factors.update_correction(batch)
    factors.reduce(ParallelContext())
    return cross_gram(factors.precondition(batch), batch)


# ---- Column/Row MLP block ----------------------------------------------------------------
def _mlp_tp2_vs_tp1(rank, world, sp):
    ids, labels = examples()
    cfg = CaptureConfig(label_shift=0, loss_reduction="example_mean")
    init_parallel(1)
    torch.manual_seed(0)
    m1 = MLPBlock(tconfig(1))
    state = full_state(m1)
    names = ["emb", "fc1", "fc2", "head"]
    ref = reference(m1, m1, ids, labels, names)
    mods = dict(m1.named_modules())
    shapes = {n: kind_for(mods[n]).layer_shape(mods[n]) for n in names}
    b1 = capture(m1, m1, ids, labels, cfg)
    errs1, _ = compare(b1, ref, shapes)

    init_parallel(2)
    m2 = MLPBlock(tconfig(2, sp=sp))
    load_shards(m2, state)
    local_ref = reference(m2, m2, ids, labels, names)  # each rank's own shard, by autograd
    b2 = capture(m2, m2, ids, labels, cfg)
    errs2, scores = compare(b2, ref, shapes)
    local = {n: rel_err(materialize(b2.layers[n].replace(shard=None)), local_ref[n])
             for n in names}
    errs2["kfac"] = rel_err(kfac_scores(unshard_batch(b2)), kfac_scores(b1))
    inside = capture(m2, m2, ids, labels, replace(cfg, projection=PROJ["kron"]))
    want = project_batch(b1, Projector(PROJ["kron"]))  # projected inside the backward pass
    errs2.update({f"capture_projected:{n}": rel_err(inside.layers[n].data.values,
                                                     want.layers[n].data.values) for n in names})
    shards = {n: None if b2.layers[n].shard is None else
              (b2.layers[n].shard.dim, b2.layers[n].shard.start, b2.layers[n].shape)
              for n in names}
    return dict(errs1=errs1, errs2=errs2, local=local, scores=scores, shards=shards,
                ids=b2.sample_ids)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_mlp_block_tp2_equals_tp1(sp):
    """Vocabulary/Column/Row-parallel MLP block (skip_bias_add, replicated Row bias,
    gather_output, reduce-scattered embedding, non-uniform per-example scale): gathered
    per-example grads, projections (Kronecker, dense, identity; also inside the backward
    pass), inner products and norms of TP=2 equal TP=1 and the autograd reference, as does
    EK-FAC fitted on the unsharded (all-gathered) factors; each rank's local shard equals
    its own autograd grads (bias counted on the last rank only); scores are bitwise equal
    on both ranks."""
    res = run(_mlp_tp2_vs_tp1, 2, sp=sp)
    for r, out in enumerate(res):
        assert max(out["errs1"].values()) <= TOL, (r, out["errs1"])
        assert max(out["errs2"].values()) <= TOL, (r, out["errs2"])
        assert max(out["local"].values()) <= TOL, (r, out["local"])
    a, b = res
    assert a["ids"] == b["ids"]
    for k in a["scores"]:
        assert (a["scores"][k] == b["scores"][k]).all(), k
    # fc1/head shard O (dim 0), fc2 shards I with the bias column on the last rank only
    assert a["shards"]["fc1"] == (0, 0, (FF // 2, H + 1))
    assert b["shards"]["fc1"] == (0, FF // 2, (FF // 2, H + 1))
    assert a["shards"]["fc2"] == (1, 0, (H, FF // 2))
    assert b["shards"]["fc2"] == (1, FF // 2, (H, FF // 2 + 1))
    assert a["shards"]["emb"] == (1, 0, (H, V // 2))  # vocabulary rows [0, V/2)
    assert b["shards"]["emb"] == (1, V // 2, (H, V // 2))


# ---- GPTModel ----------------------------------------------------------------------------
def gpt(tp: int, sp: bool = False) -> GPTModel:
    """Megatron's local spec, or with sequence parallelism dattri-ds' ``gpt_block_spec``
    (Megatron's torch norm refuses sequence parallelism; same parameter names)."""
    cfg = tconfig(tp, sp=sp)
    spec = gpt_block_spec(cfg) if sp else get_gpt_layer_local_spec()
    torch.manual_seed(0)
    return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=S,
                    share_embeddings_and_output_weights=False)


def gpt_call(model):
    mask = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), 1)

    def call(ids, labels):
        pos = torch.arange(S).expand(ids.shape[0], S)
        return model(ids, pos, mask, labels=labels)
    return call


def _gpt_tp2_vs_tp1(rank, world, sp):
    ids, labels = examples(1)
    labels = labels.clamp_min(0)  # Megatron's GPT loss has no ignore index
    cfg = CaptureConfig(label_shift=0, loss_reduction="token_mean")
    init_parallel(1)
    m1 = gpt(1)
    state = full_state(m1)
    prepare_model(m1)
    mods = dict(m1.named_modules())
    names = [n for n, m in mods.items() if kind_for(m) is not None
             and any(p.requires_grad for p in m.parameters(recurse=False))]
    shapes = {n: kind_for(mods[n]).layer_shape(mods[n]) for n in names}
    ref = reference(m1, gpt_call(m1), ids, labels, names)
    b1 = capture(m1, gpt_call(m1), ids, labels, cfg, megatron=True)
    errs1, _ = compare(b1, ref, shapes)

    init_parallel(2)
    m2 = gpt(2, sp=sp)
    load_shards(m2, state)
    seen = []  # tokens per rank at the final norm: S/2 under sequence parallelism
    m2.decoder.final_layernorm.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    b2 = capture(m2, gpt_call(m2), ids, labels, cfg, megatron=True)
    errs2, scores = compare(b2, ref, shapes)
    kinds = {n: (lg.kind_name, lg.shard is not None) for n, lg in b2.layers.items()}
    return dict(errs1=errs1, errs2=errs2, scores=scores, kinds=kinds, norm_tokens=seen[-1])


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_gpt_model_tp2_equals_tp1(sp):
    """GPTModel (local spec, learned positions, 2 layers): every captured layer of TP=2
    (sharded qkv/proj/fc1/fc2/output/vocab embedding, replicated norms and positions)
    equals TP=1 and the autograd reference, for grads, projections, grams and norms; with
    sequence parallelism too (norms and the output layer see sequence-sharded tokens)."""
    res = run(_gpt_tp2_vs_tp1, 2, sp=sp)
    for r, out in enumerate(res):
        assert out["norm_tokens"] == (S // 2 if sp else S)
        assert max(out["errs1"].values()) <= TOL, (r, out["errs1"])
        assert max(out["errs2"].values()) <= TOL, (r, out["errs2"])
    kinds = res[0]["kinds"]
    assert kinds["embedding.word_embeddings"] == ("megatron_vocab_embedding", True)
    assert kinds["decoder.layers.0.self_attention.linear_qkv"] == ("megatron_column", True)
    assert kinds["decoder.layers.1.mlp.linear_fc2"] == ("megatron_row", True)
    assert kinds["decoder.final_layernorm"] == ("megatron_norm", False)
    assert kinds["embedding.position_embeddings"] == ("embedding", False)
    for k in res[0]["scores"]:
        assert (res[0]["scores"][k] == res[1]["scores"][k]).all(), k


# ---- bad input ---------------------------------------------------------------------------
def _errors(rank, world):
    out = {}
    init_parallel(1, pp=2)
    cfg = tconfig(1)  # the pipeline size comes from parallel_state
    lin = tensor_parallel.ColumnParallelLinear(H, FF, config=cfg, init_method=nn.init.zeros_,
                                               bias=False)
    with pytest.raises(ConfigError) as e:
        GradientCapture(nn.Sequential(lin)).attach()
    out["pipeline"] = str(e.value)

    init_parallel(2)
    cfg = tconfig(2)
    row = tensor_parallel.RowParallelLinear(FF, H, config=cfg, init_method=nn.init.zeros_,
                                            bias=True, input_is_parallel=True, skip_bias_add=False)
    row.input_size = FF + 1  # a layout the tensor-parallel size does not divide
    with pytest.raises(ConfigError) as e:
        GradientCapture(nn.Sequential(row)).attach()
    out["divide"] = str(e.value)

    m = gpt(2)
    m.decoder.layers[0].mlp.extra = nn.Linear(H, H)  # batch-first layer in the [S, B, H] decoder
    with pytest.raises(UnsupportedLayerError) as e:
        megatron_capture(m).attach()
    out["batch_first"] = str(e.value)
    cap = megatron_capture(m, CaptureConfig(exclude=("*.extra",))).attach()  # the named fix
    cap.detach()

    tied = GPTModel(tconfig(2), get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=S,
                    share_embeddings_and_output_weights=True)
    with pytest.raises(UnsupportedLayerError) as e:
        megatron_capture(tied).attach()
    out["tied"] = str(e.value)
    return out


def test_bad_input_fails_at_attach_with_names():
    """Pipeline parallel > 1, a size the TP size does not divide, a batch-first layer inside
    the decoder and an output layer tied to the embedding are refused when the capture
    attaches, each message naming the layer and the fix."""
    out = run(_errors, 2)[0]
    assert "pipeline_model_parallel_size=2" in out["pipeline"] and "'0'" in out["pipeline"]
    assert "'0'" in out["divide"] and "not divisible by the tensor-parallel size 2" in out["divide"]
    assert "decoder.layers.0.mlp.extra" in out["batch_first"]
    assert "capture.exclude" in out["batch_first"]
    assert "embedding.word_embeddings" in out["tied"]


# ---- NaN in one tensor-parallel rank's shard ---------------------------------------------
def _nonfinite_one_rank(rank, world, rows=None):
    """fc1's output-grad is made inf on rank 1 only (rank 0's shard of fc1 stays finite), in
    every example or only in examples ``rows`` (Megatron outputs are [S, B, H]: B is dim 1)."""
    init_parallel(2)
    torch.manual_seed(0)
    m = MLPBlock(tconfig(2))
    ids, labels = examples()
    if rank == 1:
        def poison(mod, args, out):
            out[0].register_hook(lambda g: g * float("inf") if rows is None else
                                 g.index_fill(1, torch.tensor(rows), float("inf")))
        m.fc1.register_forward_hook(poison)
    out = {}
    for key, proj in (("factors", None), ("projected", PROJ["kron"])):
        cfg = CaptureConfig(label_shift=0, include=("fc1",), projection=proj)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with megatron_capture(m, cfg) as cap:
                m(ids, labels).mean().backward()
                got = cap.pop()
                out[key] = (got is None, cap.skipped,
                            [str(w.message) for w in caught if "NaN" in str(w.message)],
                            None if got is None else got.sample_ids, cap.skipped_examples)
        m.zero_grad(set_to_none=True)
    return out


def test_nonfinite_shard_on_one_rank_drops_the_batch_on_every_rank():
    """A NaN/inf only in rank 1's shard: both tensor-parallel ranks drop the micro-batch
    (factors: a 1-element flag reduction; projected: the reduced rows carry it), so their
    later collectives stay in step; rank 1 names the layer, rank 0 its peer."""
    res = run(_nonfinite_one_rank, 2)
    for key in ("factors", "projected"):
        for rank, out in enumerate(res):
            dropped, skipped, msgs, _, _ = out[key]
            assert dropped and skipped == 1 and len(msgs) == 1, (key, rank, out)
        assert "Layer 'fc1'" in res[1]["factors"][2][0]
        assert "another tensor-parallel rank" in res[0]["factors"][2][0]
        assert "Layer 'fc1'" in res[0]["projected"][2][0]


# ---- online selection --------------------------------------------------------------------
class LM(nn.Module):
    """GPTModel called like a Hugging Face model: ``.loss`` is the token-mean loss."""

    def __init__(self, model: GPTModel) -> None:
        super().__init__()
        self.model = model
        self.call = gpt_call(model)

    def forward(self, input_ids, labels):
        from types import SimpleNamespace

        return SimpleNamespace(loss=self.call(input_ids, labels).mean())


def _selection_tp2(rank, world):
    from dattri_ds.integrations.megatron import megatron_parallel_context
    from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget

    gen = torch.Generator().manual_seed(5)  # the same data on both tensor-parallel ranks
    cands = {"input_ids": torch.randint(0, V, (4, S), generator=gen)}
    cands["labels"] = torch.randint(0, V, (4, S), generator=gen)
    tgt = {"input_ids": torch.randint(0, V, (3, S), generator=gen)}
    tgt["labels"] = torch.randint(0, V, (3, S), generator=gen)
    # no neighbour smoothing: with 4 candidates and k=16 every smoothed score is the same
    # mean, and its 1e-7 layout noise (TP=1 vs TP=2) would decide the ties
    cfg = SelectionConfig(enabled=True, score="alignment", smooth_neighbors=None)
    out = {}
    for tp in (1, 2):
        init_parallel(tp)
        model = gpt(tp)
        if tp == 1:
            state = full_state(model)
        load_shards(model, state)
        lm = LM(prepare_model(model))
        ctx = megatron_parallel_context()
        probe = OnlineSelector.probe_capture(lm, cfg, CaptureConfig(label_shift=0))
        target = ValidationTarget(probe, lambda b, lm=lm: lm(**b).loss, tgt, ctx=ctx)
        selector = OnlineSelector(lm, cfg, target, probe=probe, ctx=ctx)
        sel = selector.select(cands, 2, step=0)
        selector.close()
        out[f"scores{tp}"], out[f"chosen{tp}"] = sel.scores, sel.indices
        out[f"ctx{tp}"] = (ctx.dp_world, ctx.tp_world)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    lm(**sel.batch).loss.backward()  # trains the chosen examples only
    opt.step()
    ref = gpt(2)
    load_shards(ref, state)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    chosen = {k: v[sel.indices] for k, v in cands.items()}
    LM(ref)(**chosen).loss.backward()
    ref_opt.step()
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    out["param_err"] = max(rel_err(got[n] - before[n], want[n] - before[n]) for n in got)
    out["moved"] = min(float((got[n] - before[n]).norm()) for n in got)
    return out


def test_online_selection_tp2():
    """Online selection on a TP=2 GPTModel: candidate scores equal the TP=1 scores and are
    bitwise identical on both tensor-parallel ranks (so both pick the same subset), and the
    SGD step equals a step on exactly the chosen subset."""
    res = run(_selection_tp2, 2)
    for r, out in enumerate(res):
        assert out["ctx2"] == (1, 2) and out["ctx1"] == (2, 1)
        assert rel_err(torch.as_tensor(out["scores2"]), torch.as_tensor(out["scores1"])) <= TOL
        assert (out["chosen2"] == out["chosen1"]).all()
        assert out["param_err"] <= TOL and out["moved"] > 0, out
    assert (res[0]["scores2"] == res[1]["scores2"]).all()
    assert (res[0]["chosen2"] == res[1]["chosen2"]).all()


def test_nonfinite_example_on_one_rank_drops_that_example_on_every_rank():
    """A NaN/inf in one example of rank 1's shard: both tensor-parallel ranks drop exactly that
    example and keep the others (factors: the [B] mask is max-reduced; projected: the reduced
    rows carry it), so their batches -- and later collectives -- stay identical."""
    res = run(_nonfinite_one_rank, 2, rows=[1])
    for key in ("factors", "projected"):
        for rank in range(2):
            dropped, skipped, _, ids, skipped_examples = res[rank][key]
            assert not dropped and len(ids) == B - 1 and skipped == 0 and skipped_examples == 1
        assert res[0][key][3] == res[1][key][3], key
