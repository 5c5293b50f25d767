"""Shared pytest setup: make tests/reference.py importable and keep HF offline."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


import torch  # noqa: E402

# Two shared cores: small ops (float64 eigh, tiny matmuls) run far slower with 2 threads
# fighting the other tests' processes than with one.
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: multi-process (gloo) tests")
    config.addinivalue_line("markers", "gpu: needs CUDA")
    config.addinivalue_line("markers", "slow: end-to-end subprocess tests")


def pytest_collection_modifyitems(config, items):
    """Run the forked multi-process tests (tests/dist, and any test marked ``dist``) first:
    they need a parent process in which no process group or Megatron state was ever
    created, which in-process end-to-end tests (offline tools on Megatron runs, launch's
    doors) cannot guarantee afterwards."""
    items.sort(key=lambda item: 0 if "/tests/dist/" in str(item.fspath)
               or item.get_closest_marker("dist") else 1)
