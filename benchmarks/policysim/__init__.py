"""Trace-driven comparison of KV-cache admission policies (driven by ``benchmarks/policy_sim.py``).

One concept per module: the trace reader, the model shape that turns tokens into bytes, the
block caches (LRU, ARC), the session view a live system has at decision time, the admission
policies, the replay loop, the report models and the plot.
"""
