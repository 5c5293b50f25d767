# Scenario for hops.py: one OnlineSelector.select on a 1-layer GPT-2 (the gradient selection,
# score='alignment': per-token cosine vs a validation target, neighbour smoothing, content
# prior, half uniform; the default score, 'content', runs no probe).
#   .venv/bin/python /work/shared/tools/hops.py tests/structure/scenario_select.py --root selection --during select
#   (--root dattri_ds counts the library files the step calls into; selection/ installs as
#   dattri_ds.selection from the folder selection/)
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_ds.selection import OnlineSelector, SelectionConfig

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))
gen = torch.Generator().manual_seed(1)
target = torch.randint(0, 64, (4, 16), generator=gen)
cand = torch.randint(0, 64, (8, 16), generator=gen)
selector = OnlineSelector.for_target_data(model, SelectionConfig(enabled=True, score="alignment"),
                                          {"input_ids": target, "labels": target})
selector.target.get(0)  # the target refresh is its own pass; the window is one step's select
selector.select({"input_ids": cand, "labels": cand}, k=4, step=0)
selector.close()
