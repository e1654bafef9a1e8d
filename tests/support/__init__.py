"""Test-only compositions of the product's parts: what the engine splits between processes, put
back together in one so that a test can drive it (``RAMCheckpointStore``, ``LocalPageMover``,
``DiskTierForTests``). Importable as ``support``: tests/ is on the pytest path."""
