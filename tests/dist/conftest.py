"""Heavy imports once in the pytest parent so forked workers start in ~1 s (docs/cpu_setup.md)."""

import importlib
import os

import pytest
from _deps import require

os.environ.setdefault("DS_ACCELERATOR", "cpu")

try:
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (imports torch._inductor)
    # gloo training does not need DeepSpeed's shm op; skip its 2-minute JIT build.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
except ImportError:  # pragma: no cover - deepspeed is an optional extra
    deepspeed = None

try:
    from transformers import GPT2LMHeadModel  # noqa: F401  (resolve the lazy import)
except ImportError:  # pragma: no cover
    pass


@pytest.fixture
def need_deepspeed():
    """Skip when DeepSpeed is missing, except in CI, where that fails (tests/_deps.py)."""
    if deepspeed is None:
        require("deepspeed", "deepspeed")
