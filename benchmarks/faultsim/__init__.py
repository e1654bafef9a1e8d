"""The fault replay (driven by ``benchmarks/fault_replay.py``): kvci's disk tier on real
PostgreSQL and Redis servers that fail under a running engine.

One concept per module: the servers and the faults done to them, the report models, and the
README section rendered from a report.
"""
