"""Shared fixtures: the tiny model (generated locally, cached) and vLLM engine helpers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings as _hypothesis_settings

from kvci_plugin.tinymodel import TinyModelSpec, make_tiny_model

# A shared, noisy machine: a property's examples are judged by their results, never by their
# timing (Hypothesis' default 200 ms deadline flaked under load).
_hypothesis_settings.register_profile("kvci", deadline=None)
_hypothesis_settings.load_profile("kvci")

# vLLM on CPU: a 1 GiB KV cache fits this machine; these must be set before an engine starts.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` shuffles the tests of each module (pytest-random-order), which interleaves the
    tests of a parametrized module-scoped fixture's instances (test_connector_sliding_window's
    model, with its engines): pytest would set one up again at every switch. After a shuffle, the
    tests of each instance run together again, in their shuffled order, as pytest groups them."""
    if not _shuffled(config):
        return
    groups: dict[tuple[object, ...], list[pytest.Item]] = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        scopes = getattr(callspec, "_arg2scope", {})
        shared = tuple(
            sorted(
                (name, index)
                for name, index in getattr(callspec, "indices", {}).items()
                if getattr(scopes.get(name), "value", "function") != "function"
            )
        )
        groups.setdefault((item.path, shared), []).append(item)
    items[:] = [item for group in groups.values() for item in group]


def _shuffled(config: pytest.Config) -> bool:
    try:
        from random_order.config import Config
    except ImportError:
        return False
    return bool(Config(config).is_enabled)


@pytest.fixture(scope="session", autouse=True)
def vllm_sources_only() -> Iterator[None]:
    """Under tools/check_vllm.py (a vLLM's Python sources over another vLLM's install, which run
    no kernel: ``KVCI_VLLM_SOURCES_ONLY``), vLLM 0.34's CPU platform refuses any VllmConfig on an
    x86 CPU without triton-cpu, the compiler of the kernels it would run. No test it runs runs
    one, so it is told triton is there. Elsewhere (CI's vllm-cpu 0.32) nothing is changed."""
    if not os.environ.get("KVCI_VLLM_SOURCES_ONLY"):
        yield
        return
    import vllm.triton_utils

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm.triton_utils, "HAS_TRITON", True, raising=False)
        yield


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return make_tiny_model(TinyModelSpec())


@pytest.fixture(scope="session")
def postgres_url():
    """URL of a real PostgreSQL server on loopback, for this test session."""
    from services import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(scope="session")
def redis_url():
    """URL of a real Redis server on loopback, for this test session."""
    from services import redis_server

    with redis_server() as url:
        yield url


@pytest.fixture
def pg_catalog_url(postgres_url: str) -> str:
    """A new empty PostgreSQL database for one test."""
    from services import new_database

    return new_database(postgres_url)


_REDIS_DBS = [0]


@pytest.fixture
def redis_db_url(redis_url: str) -> str:
    """A flushed Redis database for one test."""
    from services import new_redis_db

    return new_redis_db(redis_url, _REDIS_DBS)
