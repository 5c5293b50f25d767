"""The planner's memory terms against exact byte counts of small real models.

Invariants: ``ModelShape`` counts exactly the parameters ``transformers`` builds (Llama,
Qwen2 with q/k/v biases, GPT-2 tied and untied); the state terms equal the bytes of a real
torch ``AdamW`` (parameters, gradients, ``exp_avg`` + ``exp_avg_sq``) exactly; the captured
factor terms equal the bytes of a real ``GradientCapture`` batch exactly; the store size
equals the projected width of a real projected batch exactly. Tolerance: 0 (exact) for all.
"""

from __future__ import annotations

import json

import pytest
import torch

from dattri_ds import CaptureConfig, GradientCapture, ProjectionConfig
from dattri_ds.models.causal_lm import build_model
from dattri_ds.errors import ConfigError
from dattri_ds.gradient import Dense, Factorized
from dattri_ds.ops.projection import KINDS
from dattri_ds.plan import (
    DEVICES, ModelShape, RunSpec, captured_factor_bytes, device, plan,
)

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "hidden_size": 32, "intermediate_size": 48,
         "max_position_embeddings": 64, "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
VOCAB, B, T = 97, 3, 12


def _model(cfg: dict) -> torch.nn.Module:
    return build_model(cfg, vocab_size=VOCAB, seed=0)


def _qwen2() -> tuple[dict, torch.nn.Module]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True)
    return cfg.to_dict(), Qwen2ForCausalLM(cfg)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("cfg", [LLAMA, GPT2, {**GPT2, "tie_word_embeddings": False}],
                         ids=["llama", "gpt2-tied", "gpt2-untied"])
def test_parameter_count_equals_transformers(cfg):
    """ModelShape.num_params is the exact count of the built model (a wrong block layout,
    bias or tied head would show here)."""
    shape = ModelShape.from_config(cfg, vocab_size=VOCAB)
    assert shape.num_params == sum(p.numel() for p in _model(cfg).parameters())


def test_parameter_count_of_hf_qwen2_config(tmp_path):
    """An HF config.json (Qwen2: q/k/v biases, tied head, vocab in the file) is read as is."""
    d, model = _qwen2()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    assert ModelShape.from_config(path).num_params == sum(p.numel() for p in model.parameters())


def test_state_terms_equal_a_real_torch_adamw():
    """params / grads / optimizer terms (ZeRO-0, 1 rank, fp32 AdamW) equal the bytes of the
    model's parameters, their .grad and AdamW's exp_avg + exp_avg_sq after one step."""
    model = _model(LLAMA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (B, T))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    p = plan(ModelShape.from_config(LLAMA, vocab_size=VOCAB), "cpu",
             RunSpec(world=1, zero_stage=0, dtype="float32", optimizer="adamw", seq_len=T,
                     micro_batch=B, capture=False, k=64))
    params = list(model.parameters())
    assert p.memory["params"] == _nbytes(params)
    assert p.memory["grads"] == _nbytes(x.grad for x in params)
    state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert p.memory["optimizer"] == _nbytes(state)
    assert p.memory["master"] == 0


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_captured_factor_bytes_equal_a_real_gradbatch(cfg):
    """captured_factor_bytes = the bytes of one GradientCapture batch: layer inputs (and
    embedding indices), output-grads and the norms' dense rows; a layer the planner forgets
    (or counts twice, e.g. a tied head) breaks the equality."""
    model = _model(cfg)
    ids = torch.randint(0, VOCAB, (B, T))
    with GradientCapture(model, CaptureConfig(), probe_only=True) as cap:
        batch = cap.probe(lambda: model(input_ids=ids, labels=ids).loss)
    got = {"inputs": 0, "grads": 0, "dense": 0}
    for lg in batch.layers.values():
        if isinstance(lg.data, Factorized):
            got["inputs"] += _nbytes([lg.data.a])
            got["grads"] += _nbytes([lg.data.g])
        else:
            assert isinstance(lg.data, Dense)
            got["dense"] += _nbytes([lg.data.values])
    want = captured_factor_bytes(ModelShape.from_config(cfg, vocab_size=VOCAB),
                                 RunSpec(seq_len=T, micro_batch=B, dtype="float32"), B)
    assert want == got


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [16, 64])
def test_store_bytes_equal_the_projected_width(k, kind):
    """store_bytes = examples x (projected columns of a real batch projected with every
    registered kind, ``auto`` resolved per layer) x 2; the advice names each layer's kind
    and error. Breaks if the planner's per-kind width drifts from what projection stores."""
    model = _model(LLAMA)
    ids = torch.randint(0, VOCAB, (B, T))
    proj = ProjectionConfig(kind=kind, dim=k)
    with GradientCapture(model, CaptureConfig(projection=proj), probe_only=True) as cap:
        batch = cap.probe(lambda: model(input_ids=ids, labels=ids).loss)
    width = sum(lg.data.values.shape[1] for lg in batch.layers.values())
    p = plan(ModelShape.from_config(LLAMA, vocab_size=VOCAB), "cpu",
             RunSpec(seq_len=T, micro_batch=B, k=k, examples=10, store_dtype="float16",
                     projection=kind))
    assert p.store_bytes == 10 * width * 2
    assert any(a.startswith(f"projection kind per layer ({kind}, k={k})") and "error ~" in a
               for a in p.advice)


def test_sparse_projection_memory_is_its_nonzeros():
    """The planner's sparse projection memory is 8 bytes (int32 CSR index, fp32 value) per
    non-zero, ``min(16, k)`` per column of every projected layer (norms' rows included),
    plus each CSR block's int32 row pointers (``k + 1``); dense is ``4 k`` per column.
    Breaks if plan.py prices sparse like a dense matrix (test_plan_real compares both with
    the real matrix cache)."""
    from dattri_ds.ops.projection import BLOCK

    shape = ModelShape.from_config(LLAMA, vocab_size=VOCAB)
    k = 16
    mem = {kind: plan(shape, "cpu", RunSpec(seq_len=T, micro_batch=B, k=k, projection=kind))
           .memory["projections"] for kind in ("sparse", "dense")}
    projected = [L for L in shape.captured_layers() if L.O * L.I > k]
    assert any(L.kind.dense_only for L in projected)
    assert mem["sparse"] == sum((8 * 16 * L.O * L.I + 4 * (k + 1) * -(-L.O * L.I // BLOCK))
                                * L.count for L in projected)
    assert mem["dense"] == sum(4 * k * L.O * L.I * L.count for L in projected)


def test_zero_sharding_and_offload_move_the_right_terms():
    """ZeRO-1 shards optimizer states, ZeRO-2 also grads, ZeRO-3 also parameters; offload
    moves master and optimizer (and with 'all' the parameters) to the host."""
    shape = ModelShape.from_config(LLAMA, vocab_size=VOCAB)
    P = shape.num_params

    def mem(**kw):
        return plan(shape, "h200", RunSpec(world=4, k=64, **kw))

    z1, z2, z3 = mem(zero_stage=1), mem(zero_stage=2), mem(zero_stage=3)
    assert (z1.memory["optimizer"], z1.memory["grads"], z1.memory["params"]) == \
        (8 * P / 4, 2 * P, 2 * P)
    assert (z2.memory["grads"], z2.memory["params"]) == (2 * P / 4, 2 * P)
    assert z3.memory["params"] == 2 * P / 4 and z3.memory["master"] == 4 * P / 4
    off = mem(zero_stage=3, offload="all")
    assert {"params", "master", "optimizer"} <= set(off.host) and \
        not {"params", "master", "optimizer"} & set(off.memory)


def test_recommends_offload_and_k_and_explains_routing():
    """A 110B model on 4 x H200 without offload does not fit and offload is advised; k=0
    picks a k from the ladder; every projected layer gets a ghost/dense decision (the
    three norms, wider than k, the dense path)."""
    shape = ModelShape.from_config({"model_type": "qwen2", "vocab_size": 152064,
                                    "hidden_size": 8192, "intermediate_size": 49152,
                                    "num_hidden_layers": 80, "num_attention_heads": 64,
                                    "num_key_value_heads": 8})
    assert 100e9 < shape.num_params < 120e9
    p = plan(shape, "h200", RunSpec(world=4, seq_len=512, micro_batch=1, k=0))
    assert p.spec.k in (64, 256, 1024, 4096)
    assert any("offload" in a for a in p.advice)
    assert set(p.routing.values()) <= {"ghost", "dense"} and len(p.routing) == 12
    assert {p.routing[n] for n in ("input_layernorm", "post_attention_layernorm", "norm")} \
        == {"dense"}


def test_unknown_names_are_errors_that_list_the_choices():
    """A typo in device, family or method fails with the allowed values."""
    with pytest.raises(ConfigError, match="h200"):
        device("h2000")
    with pytest.raises(ConfigError, match="supported"):
        ModelShape.from_config({"model_type": "bert"})
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelShape.from_config(LLAMA)
    with pytest.raises(ConfigError, match="method"):
        RunSpec(method="influence")
    assert {"cpu", "h200", "h100", "a100"} <= set(DEVICES)


def test_projection_kinds_the_planner_cannot_size_are_refused():
    """RunSpec takes a registered projection kind that sizes its matrices; an unknown name or
    a kind without ``matrix_bytes`` is a ConfigError naming the registered kinds (launch's
    memory check then skips the run instead of failing in the planner). A layer shape holds
    the kind object, never its name."""
    from dattri_ds.ops.projection import PROJECTION_KINDS, ProjectionKind
    from dattri_ds.plan import LayerShape

    class Unsized(ProjectionKind, name="test_unsized"):
        pass

    try:
        for name in ("test_unsized", "nope"):
            with pytest.raises(ConfigError, match="matrix_bytes.*kronecker"):
                RunSpec(projection=name)
    finally:
        PROJECTION_KINDS.unregister(Unsized.name)
    with pytest.raises(TypeError, match="get_kind"):
        LayerShape("q_proj", "linear", 8, 8)


def test_cli_json_equals_the_library(capsys):
    """``dattri-ds plan --json`` prints what plan() computes for the same flags."""
    from dattri_ds.tools.cli import main

    assert main(["plan", "--model", "configs/model_llama_tiny.json", "--vocab-size", "512",
                 "--world", "2", "--device", "h100", "--seq-len", "128", "--k", "256",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = plan(ModelShape.from_config("configs/model_llama_tiny.json", vocab_size=512), "h100",
                RunSpec(world=2, seq_len=128, k=256)).to_dict()
    assert got["memory_bytes"] == want["memory_bytes"] and got["seconds"] == want["seconds"]


def test_guard_refuses_what_cannot_fit_this_machine_and_names_the_knob():
    """check_fits compares the plan with MemAvailable (/proc/meminfo): a 110B-parameter
    model cannot train here (refused, naming the model knob, the need and the limit); the
    tiny model at its defaults fits; the limit is positive and at most physical memory."""
    from dattri_ds.errors import DoesNotFitError
    from dattri_ds.plan import Knob, available_memory, check_fits
    from dattri_ds.plan.devices import _host_memory

    limit, source = available_memory()
    assert 0 < limit <= _host_memory() * 1.01 and source
    knobs = [Knob("model", "dattri_ds.train.model_config", "--model-config", "qwen_110b"),
             Knob("seq_len", "dattri_ds.train.seq_len", "--seq-len", 128, 128)]
    big = ModelShape.from_config("configs/model_qwen_110b.json", vocab_size=152064)
    with pytest.raises(DoesNotFitError) as e:
        check_fits(big, RunSpec(seq_len=128, k=256, dtype="float32", zero_stage=0), knobs)
    msg = str(e.value)
    assert "dattri_ds.train.model_config (--model-config)" in msg and "available" in msg
    assert "--skip-memory-check" in msg
    tiny = ModelShape.from_config("configs/model_gpt2_tiny.json", vocab_size=1024)
    assert check_fits(tiny, RunSpec(seq_len=128, k=256, micro_batch=4), knobs).total < limit


def test_selection_plans_the_probe_only_when_its_score_reads_gradients(monkeypatch):
    """Content-scored selection forwards no candidate: its step plans like a plain step
    (same activations, capture buffers and time); a probing score adds the candidates'
    activations (``candidate_multiple`` x the micro-batch) and the probe pass's time. The
    launch guard plans what the resolved score does (target documents: content; the
    gradient probe when asked for)."""
    import dattri_ds.plan as planner
    from launch.checks import check_memory
    from launch.config import RunConfig

    model = ModelShape.from_config("configs/model_gpt2_tiny.json", vocab_size=1024)
    base = dict(seq_len=128, micro_batch=4, k=256, dtype="float32", zero_stage=0)
    plain = plan(model, "cpu", RunSpec(**base))
    content = plan(model, "cpu", RunSpec(**base, method="selection", candidate_multiple=4))
    probe = plan(model, "cpu", RunSpec(**base, method="selection", candidate_multiple=4,
                                       selection_probe=True))
    assert content.memory == plain.memory
    assert content.times["step"] == plain.times["step"] and "selection" not in content.times
    assert probe.memory["activations"] == 4 * plain.memory["activations"]
    assert probe.times["selection"] > 0 and probe.times["step"] > plain.times["step"]

    seen = []
    monkeypatch.setattr(planner, "check_fits", lambda model, spec, *a, **k: seen.append(spec))
    on = {"enabled": True, "target_data": "data/target/hamlet.jsonl", "candidate_multiple": 4}
    train = {"model_config": "configs/model_gpt2_tiny.json", "vocab_size": 1024}
    for sel, probes in (({}, False), ({"score": "alignment"}, True)):
        check_memory({}, RunConfig.from_dict({"train": train, "selection": {**on, **sel}}))
        assert seen[-1].method == "selection" and seen[-1].probes is probes


def test_every_plan_flag_has_help():
    """Every ``dattri-ds plan`` flag says what it sets (RunSpec flags take their field's
    docstring entry): breaks when a RunSpec field is added without documenting it."""
    from tools.plan import build_parser

    p = build_parser()
    bare = [a.option_strings for a in p._actions if not (a.help or "").strip()]
    assert not bare
    text = " ".join(p.format_help().split())
    assert "tokens per example (T)" in text and "calibrated efficiency" in text
