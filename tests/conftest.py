"""Shared fixtures: the tiny model (generated locally, cached) and vLLM engine helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvci_plugin.tinymodel import TinyModelSpec, make_tiny_model

# vLLM on CPU: a 1 GiB KV cache fits this machine; these must be set before an engine starts.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return make_tiny_model(TinyModelSpec())
