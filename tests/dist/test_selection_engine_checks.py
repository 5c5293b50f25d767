"""Selection refuses DeepSpeed features it cannot serve, before any training step."""

from __future__ import annotations

import pytest

from dattri_ds import ConfigError

from _dist import run

pytestmark = pytest.mark.dist


def _pipeline(rank, world):
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    from dattri_ds.selection import check_engine_supported

    deepspeed.init_distributed(dist_backend="gloo")
    net = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)], num_stages=1,
                         loss_fn=torch.nn.CrossEntropyLoss())
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    try:
        check_engine_supported(engine)
    except ConfigError as e:
        return str(e)
    return None


def test_pipeline_engine_refused(need_deepspeed):
    """A real DeepSpeed PipelineEngine is refused with a message naming the feature."""
    msg = run(_pipeline, 1)[0]
    assert msg is not None and "pipeline parallelism" in msg
