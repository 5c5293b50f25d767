"""Shared pytest setup: make tests/reference.py importable and keep HF offline."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: multi-process (gloo) tests")
    config.addinivalue_line("markers", "gpu: needs CUDA")
    config.addinivalue_line("markers", "slow: end-to-end subprocess tests")
