"""The vLLM KV connector. The only kvci package that imports vllm.

vLLM imports this module (`kv_connector_module_path`) and takes the attribute named by
`kv_connector`: `KVCheckpointConnector`.
"""

from kvci_plugin.connector.connector import KVCheckpointConnector

__all__ = ["KVCheckpointConnector"]
