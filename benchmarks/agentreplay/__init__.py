"""Helpers of ``benchmarks/agent_replay.py``: the chat requests of an agent-trace slice
(``turns``) and the side-by-side report (``report``)."""
