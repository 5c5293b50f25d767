"""Targets: the target documents' gradients in a pool store's space, ``[Q, P]`` in the store's
column order, captured with the store's own capture semantics and projection. With Adam
preconditioning (LESS) the exact target ``g_q`` is scaled by the checkpoint's
``D = 1 / (sqrt(v_hat) + eps)`` before it is projected: ``t_q = Proj(D g_q)``."""

from __future__ import annotations

from pathlib import Path

import torch

from dattri_ds.errors import ConfigError
from dattri_ds.gradient import Dense, GradBatch
from dattri_ds.io.files import load_torch
from dattri_ds.store.spec import StoreSpec

__all__ = ["target_rows", "store_target_rows", "load_adam_moments", "SavedAdamMoments",
           "adam_target",
           "adam_precondition",
           "capture_of"]


def target_rows(batch: GradBatch, spec: StoreSpec) -> torch.Tensor:
    """``[Q, P]`` rows of a projected batch in the store's column order.

    Raises:
        ConfigError: the batch lacks a store layer or has another width there.
    """
    from dattri_ds.ops.inner import materialize

    out = torch.zeros(batch.batch_size, spec.width, dtype=torch.float32)
    for name, sl in spec.slices().items():
        lg = batch.layers.get(name)
        if lg is None:
            raise ConfigError(f"The target gradients have no layer '{name}' of the pool store: "
                              f"capture the target with the model the store was collected from")
        rows = materialize(lg).reshape(batch.batch_size, -1).float()
        if rows.shape[1] != sl.stop - sl.start:
            raise ConfigError(f"Layer '{name}': target rows have width {rows.shape[1]}, the "
                              f"pool store {sl.stop - sl.start}: use the store's projection")
        out[:, sl] = rows
    return out


def store_target_rows(store) -> torch.Tensor:
    """``[Q, P]`` every row of an (already attached) target store."""
    return store.read(slice(None), torch.float32)


def capture_of(spec: StoreSpec, *, exact: bool):
    """The CaptureConfig that captures what the store holds (``exact``: unprojected)."""
    from dattri_ds.capture.config import CaptureConfig
    from dattri_ds.ops.projection import ProjectionConfig

    from dataclasses import replace

    cfg = CaptureConfig(**(spec.semantics or {}))
    return replace(cfg, projection=None if exact else ProjectionConfig(**spec.projection_config))


class SavedAdamMoments:
    """``SecondMoments`` (``selection.curate.precondition``) of an ``AdamState`` read from a
    checkpoint's optimizer files: the full ``v`` of each of ``model``'s parameters."""

    partitioned = False

    def __init__(self, model: torch.nn.Module, state) -> None:
        self.beta2, self.eps, self._step = state.beta2, state.eps, state.step
        self.source = state.source
        self._by_param = {id(p): state.exp_avg_sq[n] for n, p in model.named_parameters()
                          if n in state.exp_avg_sq}
        missing = [n for n, p in model.named_parameters()
                   if p.requires_grad and n not in state.exp_avg_sq]
        if len(missing) == sum(p.requires_grad for p in model.parameters()):
            raise ConfigError(f"The checkpoint's Adam moments ({state.source}) name none of "
                              f"the model's parameters (e.g. '{missing[0]}'): pass the run "
                              f"it was saved by")

    def step(self) -> int:
        return self._step

    def local(self, param):
        v = self._by_param.get(id(param))
        return None if v is None else (v.detach().flatten(), 0)


def load_adam_moments(model: torch.nn.Module, checkpoint: Path):
    """The Adam second moments of a checkpoint tag folder: ``training_state.pt`` of
    ``--backend torch``, DeepSpeed ZeRO-1/2/3 ``*_optim_states.pt`` (every rank's partition,
    merged) or Megatron ``megatron_optimizer.rank*.pt`` (TP shards joined)
    (``dattri_ds.integrations.optim_state``).

    Raises:
        ConfigError: the checkpoint has no optimizer state, or not an Adam one, or its
            parameters do not match the model.
    """
    from dattri_ds.integrations.optim_state import has_adam_state, read_adam_state
    from dattri_ds.selection.curate.precondition import TorchAdamMoments

    if has_adam_state(checkpoint):
        return SavedAdamMoments(model, read_adam_state(checkpoint, model))
    path = Path(checkpoint) / "training_state.pt"
    if not path.is_file():
        raise ConfigError(f"--method adam-cosine needs the checkpoint's optimizer state: "
                          f"{Path(checkpoint)} has none (training_state.pt of launch/train.py "
                          f"--backend torch, DeepSpeed *_optim_states.pt or Megatron "
                          f"megatron_optimizer.rank*.pt; a Hugging Face model folder has "
                          f"none); use --method cosine")
    state = load_torch(path, "training state", fix="pass a checkpoint of a complete run, or "
                       "copy the checkpoint again", trusted="a --backend torch checkpoint")
    saved = state.get("optimizer") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: holds no optimizer state (not written by launch/train.py "
                          f"--backend torch): use --method cosine")
    groups = saved.get("param_groups", [])
    if not groups or "betas" not in groups[0]:
        raise ConfigError(f"{path}: the optimizer keeps no Adam second moments (no betas): "
                          f"use --method cosine")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": params[min(g["params"]):max(g["params"]) + 1]}
                             for g in groups], lr=1.0)
    try:
        opt.load_state_dict(saved)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{path}: the optimizer state does not match the model's "
                          f"{len(params)} parameters ({e}): pass the run it was saved by") from None
    return TorchAdamMoments(opt)


def adam_precondition(exact: GradBatch, layers: dict, moments) -> GradBatch:
    """``D g_q`` per target row of an exact batch, dense and unprojected (``layers``: name
    -> (module, LayerKind) of a capture on the same model)."""
    from dattri_ds.ops.inner import materialize
    from dattri_ds.selection.curate.precondition import precondition_target

    dense = GradBatch(step=exact.step, sample_ids=exact.sample_ids, token_counts=exact.token_counts,
                      layers={n: lg.replace(data=Dense(materialize(lg).reshape(
                          exact.batch_size, -1))) for n, lg in exact.layers.items()})
    return GradBatch.cat([precondition_target(dense.index([q]), layers, moments)
                          for q in range(dense.batch_size)])


def adam_target(exact: GradBatch, layers: dict, moments, projection) -> GradBatch:
    """``Proj(D g_q)``: ``adam_precondition`` then the store's projection."""
    from dattri_ds.ops.projection import Projector
    from dattri_ds.ops.space import project_batch

    return project_batch(adam_precondition(exact, layers, moments), Projector(projection))
