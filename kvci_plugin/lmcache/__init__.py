"""LMCache tiering with kvci's worthiness decision and eligibility gate. The only kvci package
that imports lmcache.

vLLM imports this module (`kv_connector_module_path`) and takes `KVCILMCacheConnector`; LMCache
loads the gated durable tiers from `kvci_plugin.lmcache.gated_backend` as storage plugins.
See docs/lmcache.md.
"""

from kvci_plugin.lmcache.connector import KVCILMCacheConnector

__all__ = ["KVCILMCacheConnector"]
