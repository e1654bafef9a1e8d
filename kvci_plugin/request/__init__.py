"""What one request asks of kvci, read the same way by every connector.

``params``: the ``kvci`` object of a request's ``kv_transfer_params`` (parsed and checked);
``tenancy``: whose KV the request's is, and who may forget a tenant. Both the vLLM connector
(``kvci_plugin.connector``) and the LMCache integration (``kvci_plugin.lmcache``) read requests
through this package, so it imports neither of them, nor vLLM: pydantic and the governance
layer only.
"""
