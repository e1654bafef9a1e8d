"""kvci — KV-Checkpoint Intelligence: a vLLM KV connector that keeps KV caches worth keeping.

Importing the package imports nothing heavy: the layers (worthiness, governance, ops, policy,
request, tiering, api, connector, lmcache: README.md's package map) are imported where they are
used.
"""

__version__ = "0.1.0"
