# Scenario for stays.py: EK-FAC factors of a 1-layer GPT-2 fitted for a Kronecker-projected
# store (the factors live in the projected space: fit_factors(..., projector=...)).
#   python tests/structure/stays.py tests/structure/scenario_fit_projected.py --during fit_factors
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_ds import CaptureConfig, ProjectionConfig, collect, fit_factors
from dattri_ds.ops.projection import Projector

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
x = torch.randint(0, 64, (4, 16))
batches = [{"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}]
grads = list(collect(model, batches, CaptureConfig()))
fit_factors(grads, projector=Projector(ProjectionConfig(kind="kronecker", dim=64)))
