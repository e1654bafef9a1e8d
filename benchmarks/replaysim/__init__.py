"""The engine replay of a Mooncake-format trace (driven by ``benchmarks/replay.py``).

One concept per module: the scaled workload (trace blocks -> engine token ids), the report
models, and the README section rendered from a report.
"""
