"""Node B of the lifecycle test: a vLLM engine in its own process on the shared disk tier.

Persists the "node_b" prompt with a valid session credential, waits until the shared catalog
holds it, prints READY, then answers each line on stdin (a prompt's name) by sending that prompt
(tenant acme, keeping nothing) and printing its reply's kvci hit tokens, until its stdin closes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_support import NodeEngine, session_token, shared_catalog_ids  # noqa: E402
from lifecycle_support import PROMPTS  # noqa: E402

if __name__ == "__main__":
    node = NodeEngine.from_argv()
    reply = node.run(PROMPTS["node_b"], tenant="acme", session_token=session_token(node.root),
                     persist=True, source_ids=["doc:handbook"])
    node.step_until(lambda: reply["checkpoint_id"] in shared_catalog_ids(node.extra["catalog_url"]),
                    "the persisted checkpoint never reached the shared catalog")
    node.ready({"node_b": reply})
    for line in sys.stdin:
        probe = node.run(PROMPTS[line.strip()], tenant="acme", checkpoint="never")
        print("REPLY " + json.dumps({"hit_tokens": probe["hit_tokens"]}), flush=True)
