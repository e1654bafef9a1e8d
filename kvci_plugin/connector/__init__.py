"""The vLLM KV connector. The only kvci package that imports vllm.

vLLM imports this module (`kv_connector_module_path`) and takes the attribute named by
`kv_connector`: `KVCheckpointConnector`. It is imported on that first access, so the worker side
(`worker.py`, `jobs.py`, `tally.py`, `pages.py`), which needs torch alone, imports on a machine
without vLLM — the GPU machine its CUDA tests run on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvci_plugin.connector.connector import KVCheckpointConnector

__all__ = ["KVCheckpointConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVCheckpointConnector":
        from kvci_plugin.connector.connector import KVCheckpointConnector

        return KVCheckpointConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
