"""CUDA variants of the core exactness tests (skipped without a GPU; collected on CPU).

Invariants, in fp32 with TF32 off (so CUDA matmuls round like fp32):
* capture on CUDA equals one-example-per-backward autograd on CUDA, and the CPU capture of
  the same model and batch, for every tested architecture (GPT-2, Llama, OLMo-2, Qwen2;
  rel. err <= 1e-4: CUDA reductions are reordered, not more);
* the ghost (factorized) and dense (materialized) paths of the cross gram and the squared
  norms agree on CUDA and equal the CPU float64 reference, per layer kind;
* DeepSpeed ZeRO-3 on one GPU (NCCL, world 1): the per-example gradients captured through
  the engine equal autograd on an unsharded copy.
Breaks if a CUDA-only path (device placement, dtype, stream, ZeRO-3 gathered parameters)
changes what capture or the ops compute.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")]
TOL = 1e-4
ARCHS = ("gpt2", "llama", "olmo2", "qwen2")


@pytest.fixture(autouse=True)
def _no_tf32():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _captured(model, ids):
    from dattri_ds import GradientCapture, materialize

    with GradientCapture(model) as cap:
        model(input_ids=ids, labels=ids).loss.backward()
        batch = cap.pop()
    model.zero_grad(set_to_none=True)
    return {n: materialize(lg).cpu() for n, lg in batch.layers.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_matches_autograd_on_cuda(arch):
    """CUDA capture == CUDA per-example autograd == CPU capture (untied head)."""
    from dattri_ds.models.causal_lm import build_model, load_model_config
    from reference import reference_grads, rel_err

    d = {**load_model_config(ROOT / f"configs/model_{arch}_tiny.json"),
         "tie_word_embeddings": False}
    cpu = build_model(d, vocab_size=128, seed=0)
    gpu = build_model(d, vocab_size=128, seed=0).cuda()
    ids = torch.randint(4, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    got = _captured(gpu, ids.cuda())
    ref = {n: v.cpu() for n, v in reference_grads(gpu, ids.cuda()).items()}
    on_cpu = _captured(cpu, ids)
    assert set(got) == set(ref) == set(on_cpu)
    for name in got:
        assert rel_err(got[name], ref[name]) <= TOL, (arch, name, "vs autograd")
        assert rel_err(got[name], on_cpu[name]) <= TOL, (arch, name, "vs CPU")


@pytest.mark.parametrize("kind", ["linear", "embedding", "layernorm", "rmsnorm"])
def test_ghost_equals_materialized_on_cuda(kind):
    """Cross gram and squared norms: ghost == dense on CUDA == CPU float64."""
    from torch import nn

    from dattri_ds import LayerGrad
    from dattri_ds.layers import kind_for
    from dattri_ds.ops import layer_cross_gram, layer_sq_norms, materialize
    from reference import rel_err

    def layer(device, dtype, b, t, seed):
        torch.manual_seed(0)
        module = {"linear": lambda: nn.Linear(24, 20), "embedding": lambda: nn.Embedding(50, 16),
                  "layernorm": lambda: nn.LayerNorm(24),
                  "rmsnorm": lambda: nn.RMSNorm(24, eps=1e-5)}[kind]().to(device, dtype)
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 50, (b, t), generator=g) if kind == "embedding" else \
            torch.randn(b, t, 24, generator=g, dtype=torch.float64)
        x = x.to(device) if kind == "embedding" else x.to(device, dtype)
        out = module(x)
        r = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7),
                        dtype=torch.float64).to(device, dtype)
        k = kind_for(module)
        return LayerGrad(kind, k, k.build(module, x, r), k.layer_shape(module))

    x64, y64 = layer("cpu", torch.float64, 4, 6, 1), layer("cpu", torch.float64, 3, 5, 2)
    want = materialize(x64) @ materialize(y64).T
    x, y = layer("cuda", torch.float32, 4, 6, 1), layer("cuda", torch.float32, 3, 5, 2)
    paths = ["dense"] if x.kind.dense_only else ["ghost", "dense"]
    for path in paths:
        got = layer_cross_gram(x, y, path=path).double().cpu()
        assert rel_err(got, want) <= TOL, (kind, path)
        sq = layer_sq_norms(x, path=path).double().cpu()
        assert rel_err(sq, materialize(x64).pow(2).sum(1)) <= TOL, (kind, path)


def test_zero3_capture_on_one_gpu(tmp_path):
    """ZeRO-3 on one GPU over NCCL: captured per-example gradients == autograd."""
    pytest.importorskip("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NVIDIA_TF32_OVERRIDE": "0"}
    env.pop("DS_ACCELERATOR", None)
    out = tmp_path / "errs.json"
    proc = subprocess.run([sys.executable, __file__, "zero3-worker", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    errs = json.loads(out.read_text())
    assert errs and max(errs.values()) <= TOL, errs


def _zero3_worker(out: str) -> None:
    import copy

    import deepspeed

    sys.path.insert(0, str(ROOT / "tests"))
    from dattri_ds import GradientCapture, materialize
    from reference import reference_grads, rel_err, tiny_gpt2

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    model = tiny_gpt2(seed=0)
    ref_model = copy.deepcopy(model).cuda()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    ids = torch.randint(0, 97, (4, 8), generator=torch.Generator().manual_seed(3)).cuda()
    with GradientCapture.for_engine(engine) as cap:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        batches = cap.drain()
    ref = reference_grads(ref_model, ids)
    errs = {n: rel_err(torch.cat([materialize(b.layers[n]) for b in batches]).cpu(),
                       ref[n].cpu()) for n in ref}
    Path(out).write_text(json.dumps(errs))


if __name__ == "__main__" and sys.argv[1:2] == ["zero3-worker"]:
    _zero3_worker(sys.argv[2])
