"""Hugging Face Trainer / TRL SFTTrainer: capture and online selection in an unmodified loop.

``TrainerCapture`` reads Trainer's ``num_items_in_batch`` and undoes its accumulation and
world-size scaling, marks steps at ``on_step_end`` and, with a selector, replaces each
micro-batch of ``get_batch_samples`` by the chosen examples; how each piece of Trainer's
loss is undone and what is refused: docs/integrations.md.

Example:
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds)
    >>> TrainerCapture(trainer, CaptureConfig(projection=ProjectionConfig(dim=64)),
    ...                callbacks=[store_callback])
    >>> trainer.train()     # the store is closed when training ends"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from transformers import TrainerCallback

from dattri_ds.capture.callbacks import TrainingCallback
from dattri_ds.capture.hooks import GradientCapture
from dattri_ds.capture.config import CaptureConfig
from dattri_ds.errors import ConfigError
from dattri_ds.ops.cost import CostModel

__all__ = ["TrainerCapture", "trainer_backward_scale"]


def trainer_backward_scale(trainer: Any, num_items: Any) -> float:
    """The factor ``c`` Trainer multiplies ``sum_b S_b / N`` (or the model's token mean) by.

    Mirrors ``Trainer.compute_loss`` / ``training_step`` (and TRL's SFTTrainer, which
    applies the same two factors): ``num_processes // tp_size`` when ``N`` is given and
    averaged across devices, ``1 / current_gradient_accumulation_steps`` when the loss is
    not already normalized for accumulation.
    """
    c = 1.0
    if num_items is not None and trainer.args.average_tokens_across_devices:
        c *= trainer.accelerator.num_processes // trainer.get_tp_size()
    scaled = trainer.loss_is_scaled_for_ga
    if scaled is None:
        scaled = ((trainer.model_accepts_loss_kwargs and num_items is not None)
                  or trainer.compute_loss_func is not None)
    if not scaled:
        c /= trainer.current_gradient_accumulation_steps
    return c


def _check_trainer(trainer: Any) -> None:
    if trainer.label_smoother is not None:
        raise ConfigError(
            f"label_smoothing_factor={trainer.args.label_smoothing_factor}: a smoothed loss "
            f"is not a sum of token losses, so per-example gradients have no exact meaning; "
            f"set label_smoothing_factor=0 to capture")
    if trainer.compute_loss_func is not None:
        raise ConfigError("Trainer(compute_loss_func=...) reduces the loss in a way dattri-ds "
                          "cannot read; drop it to capture (the model's loss is used)")
    if getattr(trainer, "padding_free", False):
        raise ConfigError("SFTTrainer with padding_free/packing packs several documents into "
                          "one row, so a captured row would not be one example's gradient; "
                          "set padding_free=False and packing=False to capture")
    if trainer.args.n_gpu > 1:
        raise ConfigError(f"n_gpu={trainer.args.n_gpu} (torch DataParallel) splits micro-batches "
                          f"inside one process; launch one process per device (torchrun)")


class TrainerCapture(TrainerCallback):
    """Per-example gradients and online selection inside ``trainer.train()``.

    Registers itself with ``trainer.add_callback`` (a ``transformers.TrainerCallback``)
    and wraps ``compute_loss`` and, with a selector, ``get_batch_samples`` on the trainer
    instance; ``close()`` (called when training ends) restores them and closes the
    capture's callbacks.

    Args:
        trainer: a ``transformers.Trainer`` (or TRL ``SFTTrainer``), before ``train()``.
        config: what to capture (``loss_reduction`` is set to Trainer's ``token_mean``).
        callbacks: consumers of every GradBatch (``StoreCallback``, ...).
        selector: an ``OnlineSelector`` on ``trainer.model``: each micro-batch of ``C``
            candidates trains on the ``k`` it chooses.
        k: examples trained per micro-batch (default ``floor(C / candidate_multiple)``).
        cost: cost model for projections.
    """

    def __init__(self, trainer: Any, config: CaptureConfig | None = None, *,
                 callbacks: Iterable[TrainingCallback] = (), selector: Any = None,
                 k: int | None = None, cost: CostModel | None = None) -> None:
        _check_trainer(trainer)
        config = config or CaptureConfig()
        if config.loss_reduction != "token_mean":
            warnings.warn(f"capture.loss_reduction='{config.loss_reduction}' has no effect under "
                          f"Trainer: its loss is a token mean ('token_mean' is used)",
                          stacklevel=2)
        self.trainer = trainer
        self.config = replace(config, loss_reduction="token_mean")
        self.consumers = list(callbacks)
        self.selector, self.k, self.cost = selector, k, cost
        self.capture: GradientCapture | None = None
        self.last_selection = None
        self._restore: list[str] = []
        self._head = None
        from dattri_ds.integrations.trl import unfuse_lm_head

        trainer.add_callback(self)
        self._wrap()
        self._head = unfuse_lm_head(trainer.model)  # before accelerate wraps its forward

    # ---- wrapping the trainer instance ------------------------------------------------
    def _wrap(self) -> None:
        trainer = self.trainer
        compute_loss = trainer.compute_loss

        def wrapped_compute_loss(model, inputs, *args, **kwargs):
            cap = self.capture
            if cap is not None and torch.is_grad_enabled() and trainer.model.training:
                n = kwargs.get("num_items_in_batch", args[1] if len(args) > 1 else None)
                cap.normalize_next(num_items=None if n is None else _as_float(n),
                                   scale=trainer_backward_scale(trainer, n))
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = wrapped_compute_loss
        self._restore.append("compute_loss")
        if self.selector is not None:
            get_batch_samples = trainer.get_batch_samples

            def wrapped_get_batch_samples(epoch_iterator, num_batches, device):
                samples, num_items = get_batch_samples(epoch_iterator, num_batches, device)
                if not samples:
                    return samples, num_items
                chosen = [self._select(s, device) for s in samples]
                return chosen, trainer._get_num_items_in_batch(chosen, device)

            trainer.get_batch_samples = wrapped_get_batch_samples
            self._restore.append("get_batch_samples")

    def _select(self, batch: dict, device) -> dict:
        """The chosen rows of one micro-batch of candidates (other entries kept as they are)."""
        c = batch["input_ids"].shape[0]
        rows = {n: v.to(device) for n, v in batch.items()
                if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == c}
        probe_inputs = {n: rows[n] for n in ("input_ids", "attention_mask", "labels")
                        if n in rows}
        k = self.k or max(1, math.floor(c / self.selector.config.candidate_multiple + 1e-9))
        sel = self.selector.select(probe_inputs, k, self.trainer.state.global_step)
        self.last_selection = sel
        idx = sel.indices.to(device)
        return {**batch, **{n: v.index_select(0, idx) for n, v in rows.items()}}

    # ---- TrainerCallback events --------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        trainer = self.trainer
        if type(trainer.model_wrapped).__name__ == "DeepSpeedEngine":
            raise ConfigError("TrainerCapture does not support DeepSpeed under Trainer yet (its "
                              "loss scaling is not verified); use GradientCapture.for_engine "
                              "in a DeepSpeed loop (launch/train.py)")
        module = model if model is not None else trainer.model
        self.capture = GradientCapture(module, self.config, callbacks=self.consumers,
                                       cost=self.cost,
                                       step_fn=lambda: int(trainer.state.global_step))
        self.capture.attach()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.capture is not None:
            self.capture.next_step(int(state.global_step) - 1)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        return control

    def close(self) -> None:
        """Detach, close the consumers (stores flush) and restore the trainer's methods."""
        if self.capture is not None:
            self.capture.close()
            self.capture = None
        if self._head is not None:
            self._head()
            self._head = None
        for name in self._restore:
            self.trainer.__dict__.pop(name, None)
        self._restore.clear()


def _as_float(n: Any) -> float:
    return float(n.float().mean()) if torch.is_tensor(n) else float(n)
