# Scenario for stays.py: one batch of a 1-layer GPT-2 collected as a store's rows, projected
# with the default ProjectionConfig() (kind auto).
#   python tests/structure/stays.py tests/structure/scenario_collect_projected.py --during collect
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_ds import CaptureConfig, ProjectionConfig, collect

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
x = torch.randint(0, 64, (4, 16))
batches = [{"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}]
grads = list(collect(model, batches, CaptureConfig(projection=ProjectionConfig())))
