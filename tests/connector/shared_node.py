"""Node A of the many-nodes test: a vLLM engine in its own process on the shared disk tier.

Persists the "persisted" prompt with a valid session credential and asks for the "refused" one
without one, waits until the shared catalog holds the persisted checkpoint, prints READY with
the replies, then serves on (stepping its engine) until its stdin closes.
"""

from __future__ import annotations

import select
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_support import NodeEngine, prompts, session_token, shared_catalog_ids  # noqa: E402

if __name__ == "__main__":
    node = NodeEngine.from_argv()
    p = prompts()
    replies = {
        "persisted": node.run(p["persisted"], tenant="acme", session_token=session_token(node.root),
                              persist=True, source_ids=["doc:handbook"]),
        "refused": node.run(p["refused"], tenant="acme", persist=True,
                            source_ids=["doc:handbook"]),
    }
    persisted = replies["persisted"]["checkpoint_id"]
    node.step_until(lambda: persisted in shared_catalog_ids(node.extra["catalog_url"]),
                    "the persisted checkpoint never reached the shared catalog")
    node.ready(replies)
    while not select.select([sys.stdin], [], [], 1.0)[0]:
        node.run([5, 6, 7])
