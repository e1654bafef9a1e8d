"""Page blobs: one sealed format (``codec``, keyed by ``tenant_keys``) in one of two backends
behind one interface (``backend``: a folder, ``folder``, or Redis/Valkey, ``redis_store``;
``factory`` picks), read and written many at once (``parallel``, ``read_ahead``), and what a
read can fail with (``errors``)."""
