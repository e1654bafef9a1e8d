"""Tiering (torch, no vLLM): the tiers by medium — ``ram`` (index and page pool), ``disk`` (the
tier and its catalog), ``blobs`` (the sealed page blobs in a folder or Redis) — and what they
share: keys and namespaces, the secret, records and errors (``types``), dependency timeouts and
health, which pages are loadable, load-or-recompute, and the manager that puts the tiers behind
one face (with ``persists``, ``explain``, ``outcomes`` and its ``mover``)."""
