"""The planner's sharded state terms against a real DeepSpeed ZeRO engine on 2 gloo ranks.

Invariant: per rank, ``plan(...).memory["params"]`` equals the bytes of the engine's
parameter partitions (``ds_tensor`` under ZeRO-3, full parameters below it), ``grads`` the
bytes of its gradient partitions (ZeRO-3's flat gradient buffer) and ``optimizer`` the
bytes of torch AdamW's ``exp_avg`` + ``exp_avg_sq`` over the partitions after one step.
Tolerance: ZeRO pads each parameter to a multiple of the world size, so a rank may hold up
to ``world - 1`` extra elements per tensor: the comparison allows exactly that, no more.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds.models.causal_lm import build_model
from dattri_ds.plan import ModelShape, RunSpec, plan

from _dist import run

pytestmark = pytest.mark.dist

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "hidden_size": 32, "intermediate_size": 48,
         "max_position_embeddings": 64, "tie_word_embeddings": False}
VOCAB = 97


def _zero_state_bytes(rank, world, stage):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(LLAMA, vocab_size=VOCAB, seed=0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    opt = engine.optimizer
    if stage == 3:
        params = sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                     for p in engine.module.parameters())
        buf = opt.grad_partitions_flat_buffer
        grads = buf.numel() * buf.element_size()
    else:
        params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
        grads = None
    inner = opt.optimizer
    state = sum(v.numel() * v.element_size() for s in inner.state.values()
                for k, v in s.items() if k in ("exp_avg", "exp_avg_sq"))
    tensors = len(list(engine.module.parameters()))
    return {"params": params, "grads": grads, "optimizer": state, "tensors": tensors}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_terms_equal_the_engine_partitions(need_deepspeed, stage):
    """ZeRO-1 shards optimizer states, ZeRO-2 keeps parameters whole, ZeRO-3 shards them
    and gradients."""
    got = run(_zero_state_bytes, world_size=2, stage=stage)
    p = plan(ModelShape.from_config(LLAMA, vocab_size=VOCAB), "cpu",
             RunSpec(world=2, zero_stage=stage, dtype="float32", optimizer="adamw", seq_len=8,
                     micro_batch=2, k=64))
    for r in got:
        pad = (2 - 1) * r["tensors"] * 4  # at most world-1 padding elements per tensor
        assert 0 <= r["params"] - p.memory["params"] <= (pad if stage == 3 else 0)
        assert 0 <= r["optimizer"] - p.memory["optimizer"] <= 2 * pad
        if stage == 3:
            assert 0 <= r["grads"] - p.memory["grads"] <= pad
