"""The RAM tier: its index on the scheduler side (``index``: keys, bounds, tenants, the policy's
choices; ``room``: fair shares under pressure), the pages' bytes in the worker's pool (``pool``),
and the retention an agent asks for (``retention``)."""
