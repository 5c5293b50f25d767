"""Per-example gradients captured inside an unmodified Hugging Face Trainer / TRL SFTTrainer.

Invariant: under Trainer's loss normalization (``num_items_in_batch`` over every
micro-batch of an accumulated step, label shifting, completion-only masks) each captured
row equals the gradient of that example's own summed token loss (one backward per
example), steps follow Trainer's optimizer steps, and online selection through the
callback trains exactly on the chosen subset.
"""

from __future__ import annotations

import pytest
import torch

from dattri_ds import CaptureConfig, TrainingCallback, materialize
from dattri_ds.capture.semantics import batch_info
from _deps import require
from reference import reference_grads, rel_err, tiny_gpt2

transformers = require("transformers", "hf")
TOL = 1e-6


class Recorder(TrainingCallback):
    def __init__(self):
        self.batches, self.steps = [], []

    def on_batch(self, batch):
        self.batches.append(batch)

    def on_step_end(self, step):
        self.steps.append(step)


def _examples(n=8, t=10, seed=0):
    """Fixed-length rows with right padding and masked prompts (labels -100)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(1, 97, (t,), generator=g)
        mask = torch.ones(t, dtype=torch.long)
        mask[t - i % 3:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:i % 4] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def _reference(model, rows):
    """sample id -> {layer: [D]} at the model's current parameters."""
    out = {}
    for r in rows:
        call = {k: v[None] for k, v in r.items()}
        sid = batch_info((), call).sample_ids[0]
        ref = reference_grads(model, call["input_ids"], call.get("attention_mask"),
                              call["labels"])
        out[sid] = {n: v[0] for n, v in ref.items()}
    return out


def _assert_rows_match(batches, ref):
    seen = 0
    for b in batches:
        for i, sid in enumerate(b.sample_ids):
            for name, lg in b.layers.items():
                err = rel_err(materialize(lg.index(torch.tensor([i])))[0], ref[sid][name])
                assert err <= TOL, f"{sid} {name} rel err {err:.2e}"
            seen += 1
    return seen


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                disable_tqdm=True, logging_steps=1000, optim="sgd", learning_rate=0.0,
                per_device_train_batch_size=2, max_steps=2, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_capture_matches_reference(tmp_path, accumulation):
    """Trainer divides by num_items_in_batch (all micro-batches of a step): undone exactly;
    GradBatch.step and on_step_end follow Trainer's optimizer steps."""
    from transformers import Trainer

    from dattri_ds.integrations.hf import TrainerCapture

    model = tiny_gpt2()
    rows = _examples()
    ref = _reference(model, rows)
    trainer = Trainer(model=model, args=_args(tmp_path, gradient_accumulation_steps=accumulation),
                      train_dataset=rows)
    rec = Recorder()
    TrainerCapture(trainer, CaptureConfig(), callbacks=[rec])
    trainer.train()
    assert _assert_rows_match(rec.batches, ref) == 2 * 2 * accumulation
    assert [b.step for b in rec.batches] == [s for s in (0, 1) for _ in range(accumulation)]
    assert rec.steps == [0, 1]
    assert "compute_loss" not in trainer.__dict__  # the instance is restored after training


def _sft(tmp_path, **cfg):
    """A tiny SFTTrainer on pre-tokenized rows with completion masks; and the rows."""
    require("trl", "hf")
    import datasets
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, "t1")),
        pad_token="t0", eos_token="t2")
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(8):
        n, p = 6 + i % 4, 2 + i % 3
        data.append({"input_ids": torch.randint(3, 97, (n,), generator=g).tolist(),
                     "completion_mask": [0] * p + [1] * (n - p)})
    base = _args(tmp_path, gradient_accumulation_steps=2).to_dict()
    base = {k: base[k] for k in ("output_dir", "use_cpu", "report_to", "save_strategy",
                                 "disable_tqdm", "logging_steps", "optim", "learning_rate",
                                 "per_device_train_batch_size", "max_steps", "seed",
                                 "gradient_accumulation_steps")}
    args = SFTConfig(**base, max_length=16, completion_only_loss=True, bf16=False, **cfg)
    model = tiny_gpt2()
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(data),
                         processing_class=tok)
    return trainer, model, data


def test_sft_trainer_completion_only_matches_reference(tmp_path):
    """SFTTrainer: completion-only labels, its own loss reduction and its fused LM head
    (replaced while capturing so lm_head is captured) give exact per-example gradients."""
    from dattri_ds.integrations.hf import TrainerCapture

    trainer, model, data = _sft(tmp_path)
    ref_rows = []
    for r in data:
        ids = torch.tensor(r["input_ids"])
        labels = ids.masked_fill(torch.tensor(r["completion_mask"]) == 0, -100)
        ref_rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                         "labels": labels})
    ref = _reference(model, ref_rows)
    rec = Recorder()
    TrainerCapture(trainer, callbacks=[rec])
    trainer.train()
    assert _assert_rows_match(rec.batches, ref) == 8
    assert "lm_head" in rec.batches[0].layers
    assert rec.steps == [0, 1]


def test_sft_padding_free_is_refused(tmp_path):
    """Packed rows hold several documents: TrainerCapture refuses them by name."""
    from dattri_ds.errors import ConfigError
    from dattri_ds.integrations.hf import TrainerCapture

    trainer, _, _ = _sft(tmp_path, padding_free=True, packing=True)
    with pytest.raises(ConfigError, match="padding_free"):
        TrainerCapture(trainer)


def test_trainer_selection_equals_subset_update(tmp_path):
    """With a selector, one SGD step of Trainer equals the step of a Trainer whose batch
    only held the chosen examples (N recounted over them), and differs from the full step."""
    from transformers import Trainer

    from dattri_ds.integrations.hf import TrainerCapture
    from dattri_ds.selection import OnlineSelector, SelectionConfig, ValidationTarget

    rows = _examples(4, seed=1)
    target = {k: torch.stack([r[k] for r in _examples(3, seed=2)]) for k in rows[0]}

    def train(data, bs, select):
        model = tiny_gpt2()
        trainer = Trainer(model=model, args=_args(tmp_path, per_device_train_batch_size=bs,
                                                  max_steps=1, learning_rate=0.5),
                          train_dataset=data)
        cb = None
        if select:
            sc = SelectionConfig(enabled=True, score="alignment", candidate_multiple=2.0)
            probe = OnlineSelector.probe_capture(model, sc)
            tgt = ValidationTarget(probe, lambda b: model(**b).loss, target)
            cb = TrainerCapture(trainer, selector=OnlineSelector(model, sc, tgt, probe=probe))
        trainer.train()
        return model, cb

    selected, cb = train(rows, 4, True)
    sel = cb.last_selection
    assert sel.indices.numel() == 2
    chosen = [{k: v[i] for k, v in sel.batch.items()} for i in range(2)]
    subset, _ = train(chosen, 2, False)
    full, _ = train(rows, 4, False)
    diff_full = 0.0
    for (name, p), q, f in zip(selected.named_parameters(), subset.parameters(),
                               full.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), name
        diff_full = max(diff_full, float((p - f).abs().max()))
    assert diff_full > 1e-4
