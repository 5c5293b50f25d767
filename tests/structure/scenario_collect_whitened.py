# Scenario for stays.py: one batch collected as whitened rows (EK-FAC factors of the same
# model, then the default projection): what `dattri-ds collect --factors` stores. The
# factors are fitted from a GradientCapture before the window (the first `collect` call)
# opens.
#   python tests/structure/stays.py tests/structure/scenario_collect_whitened.py --during collect
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_ds import CaptureConfig, GradientCapture, ProjectionConfig, collect, fit_factors

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
x = torch.randint(0, 64, (4, 16))
batches = [{"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}]
with GradientCapture(model, CaptureConfig()) as cap:
    model(**batches[0]).loss.backward()
    exact = [cap.pop()]
model.zero_grad()
factors = fit_factors(exact)
grads = list(collect(model, batches, CaptureConfig(projection=ProjectionConfig(), whiten="ekfac"),
                     factors=factors))
