"""kvci as a vLLM plugin: registers kvci's connectors by name with vLLM's connector factory.

vLLM loads the ``vllm.general_plugins`` entry point ``kvci = kvci_plugin.plugin:register`` in
every process it starts (the API server, the engine core, each worker) before it reads
``--kv-transfer-config``, so ``{"kv_connector": "KVCheckpointConnector", "kv_role": "kv_both"}``
needs no ``kv_connector_module_path`` (which keeps working, and wins when given). Set
``VLLM_PLUGINS`` only to a list that names ``kvci``.

``register`` is cheap and may run any number of times: it names module paths, which vLLM imports
when a connector of that name is created; it imports no kvci module beyond this one, and a name
that is already registered (by an earlier call, or by vLLM) is left as it is.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "kvci"

# connector name -> (module path, class name), as in kv_connector / kv_connector_module_path.
CONNECTORS: dict[str, tuple[str, str]] = {
    "KVCheckpointConnector": ("kvci_plugin.connector", "KVCheckpointConnector"),
    "KVCILMCacheConnector": ("kvci_plugin.lmcache", "KVCILMCacheConnector"),
}


def register() -> None:
    """Register every name in ``CONNECTORS`` with vLLM's ``KVConnectorFactory``."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as error:  # a vLLM without this factory: nothing to register with
        logger.warning("kvci: vLLM's KVConnectorFactory is not importable (%s); use "
                       "kv_connector_module_path to name kvci's connector", error)
        return
    for name, (module_path, class_name) in CONNECTORS.items():
        try:
            KVConnectorFactory.register_connector(name, module_path, class_name)
        except ValueError:
            pass  # already registered: by an earlier call in this process, or by vLLM itself
