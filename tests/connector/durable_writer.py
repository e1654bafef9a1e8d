"""Engine 1 of the durable-path test, in its own process so the test can SIGKILL it mid-write.

Persists the "persisted" and "flipped" prompts with a valid session credential, asks for the
"refused" one without credentials, prints READY with the replies, then keeps persisting new
contexts until it is killed.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_support import NodeEngine, catalog_rows, prompts, session_token  # noqa: E402

if __name__ == "__main__":
    node = NodeEngine.from_argv()
    token = session_token(node.root)
    p = prompts()
    replies = {
        "persisted": node.run(p["persisted"], tenant="acme", session_token=token, persist=True,
                              source_ids=["doc:handbook"]),
        "refused": node.run(p["refused"], tenant="acme", persist=True,
                            source_ids=["doc:handbook"]),
        "flipped": node.run(p["flipped"], tenant="acme", session_token=token, persist=True,
                            source_ids=["doc:handbook"]),
    }
    wanted = {replies["persisted"]["checkpoint_id"], replies["flipped"]["checkpoint_id"]}
    disk = Path(node.extra["disk_root"])
    node.step_until(lambda: wanted <= set(catalog_rows(disk)),
                    "persisted checkpoints never reached the catalog")
    node.ready(replies)
    rng = random.Random(3)
    while True:  # until killed: keep the disk tier busy
        node.run([rng.randrange(2, 1000) for _ in range(200)], tenant="acme", session_token=token,
                 persist=True, source_ids=["doc:handbook"])
