# Scenario for stays.py / hops.py: per-example gradients of a 1-layer GPT-2 for one batch.
#   python tests/structure/stays.py tests/structure/scenario_collect.py --during collect
# (``collect`` is a generator: the window is its first resumption, i.e. the first batch.)
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_ds import CaptureConfig, collect

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
x = torch.randint(0, 64, (4, 16))
batches = [{"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}]
grads = list(collect(model, batches, CaptureConfig()))
