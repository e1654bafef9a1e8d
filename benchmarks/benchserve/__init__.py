"""``vllm bench serve`` against vLLM with and without kvci (``benchmarks/bench_serve.py``).

One concept per module: the agent-trace slice as vLLM's ``timed_trace`` dataset, and the
side-by-side report with its README section.
"""
