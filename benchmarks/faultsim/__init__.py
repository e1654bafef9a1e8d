"""The fault replay (driven by ``benchmarks/fault_replay.py``): kvci's disk tier on real
PostgreSQL and Redis servers that fail under a running engine.

One concept per module: the slice of the trace (``workload``), the engines and their runs
(``bench``), the log kept of them (``logs``), a hung step's end (``watchdog``), the faults done to
the servers and the phases they make (``windows``; the servers are ``tools/servers.py``'s), the
report models (``report``), and the README section rendered from a report (``render``).
"""
