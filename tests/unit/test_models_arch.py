"""Any Hugging Face causal LM from a config: build, capture, refuse.

Invariants: ``build_model`` builds every tested architecture (GPT-2, Llama, OLMo-2, Qwen2)
from our tiny configs and from a saved Hugging Face ``config.json``, seeded (same seed, same
weights), with the tokenizer's vocabulary and special ids; capture on each built model equals
one-example-per-backward autograd; a ``model_type`` that is not a causal LM, a model with a
layer capture cannot read, and an HF architecture under ``--backend megatron`` are refused in
one line naming the model type and what is supported; the planner labels each by its own
model type. Breaks if launch goes back to a fixed list of two architectures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dattri_ds import GradientCapture, materialize
from dattri_ds.models.causal_lm import build_model
from dattri_ds.models.causal_lm import ARCHITECTURES, check_capturable, load_model_config
from dattri_ds.errors import ConfigError
from reference import reference_grads, rel_err

ROOT = Path(__file__).resolve().parents[2]
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
           "olmo2": "Olmo2ForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _config(arch: str) -> Path:
    return ROOT / f"configs/model_{arch}_tiny.json"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_build_every_tested_architecture(arch):
    """The tiny config builds its class, seeded, with the vocabulary and special ids set."""
    a = build_model(_config(arch), vocab_size=300, seed=3)
    b = build_model(_config(arch), vocab_size=300, seed=3)
    assert type(a).__name__ == CLASSES[arch]
    assert a.config.vocab_size == 300 and a.config.bos_token_id == 2 and a.config.eos_token_id == 3
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    check_capturable(a)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_capture_on_built_model_matches_autograd(arch):
    """Capture on the built model equals per-example autograd (rel. err <= 1e-5; untied
    head: capture merges a tied embedding into lm_head)."""
    d = {**load_model_config(_config(arch)), "tie_word_embeddings": False}
    model = build_model(d, vocab_size=64, seed=0).double()
    ids = torch.randint(4, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with GradientCapture(model) as cap:
        model(input_ids=ids, labels=ids).loss.backward()
        batch = cap.pop()
    model.zero_grad(set_to_none=True)
    ref = reference_grads(model, ids)
    assert set(batch.layers) == set(ref)
    for name, lg in batch.layers.items():
        assert rel_err(materialize(lg), ref[name]) <= 1e-5, name


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hf_config_json_round_trip(arch, tmp_path):
    """A saved Hugging Face config.json (architectures, dtype, transformers_version keys)
    is a model config too and rebuilds the same weights."""
    a = build_model(_config(arch), vocab_size=128, seed=1)
    a.config.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert load_model_config(tmp_path / "config.json")["model_type"] == arch
    b = build_model(d, vocab_size=128, seed=1)
    assert type(b) is type(a)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_unknown_model_type_is_one_line_naming_it():
    """A type transformers cannot build as a causal LM names itself, close matches and the
    tested types."""
    with pytest.raises(ConfigError) as e:
        load_model_config({"model_type": "qwen"})
    msg = str(e.value)
    assert "\n" not in msg and "'qwen'" in msg and "qwen2" in msg and "gpt2" in msg
    with pytest.raises(ConfigError, match="'vit'"):  # a vision encoder, no causal LM
        load_model_config({"model_type": "vit"})


def test_model_capture_cannot_read_is_refused():
    """Mamba builds, but its mixer and Conv1d have no LayerKind: one line names the model
    type, the module classes and the tested types."""
    model = build_model({"model_type": "mamba", "hidden_size": 16, "num_hidden_layers": 1,
                         "state_size": 4, "intermediate_size": 32}, vocab_size=64)
    with pytest.raises(ConfigError) as e:
        check_capturable(model)
    msg = str(e.value)
    assert "\n" not in msg and "'mamba'" in msg and "MambaMixer" in msg and "qwen2" in msg


def test_megatron_backend_refuses_hf_architectures():
    """--backend megatron builds its own GPTModel: a Qwen2 config is refused by name."""
    pytest.importorskip("megatron.core")
    from dattri_ds.launch.megatron_backend import transformer_kwargs

    with pytest.raises(ConfigError, match="model_type='qwen2'.*--backend deepspeed"):
        transformer_kwargs(str(_config("qwen2")), 1)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_planner_labels_each_model_type(arch):
    """The plan report names the config's model type (Qwen2 was labelled 'llama'), and the
    planner's parameter count equals the built model's."""
    from dattri_ds.plan import ModelShape, RunSpec, plan

    shape = ModelShape.from_config(_config(arch), vocab_size=256)
    model = build_model(_config(arch), vocab_size=256)
    assert shape.model_type == arch
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    table = plan(shape, "cpu", RunSpec(seq_len=32, micro_batch=2, k=64)).table()
    assert table.splitlines()[0].startswith(f"model: {arch} ")
