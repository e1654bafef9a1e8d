"""Engine 1 of the durable-path test, in its own process so the test can SIGKILL it mid-write.

Persists the "persisted" and "flipped" prompts with a valid session credential, asks for the
"refused" one without credentials, prints READY with the replies, then keeps persisting new
contexts until it is killed.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_support import catalog_rows, prompts, session_token  # noqa: E402
from engine import kvci_params, make_llm  # noqa: E402

if __name__ == "__main__":
    root, model = Path(sys.argv[1]), Path(sys.argv[2])
    extra = json.loads((root / "extra.json").read_text())
    from vllm.inputs import TokensPrompt

    llm = make_llm(model, extra)

    def run(tokens: list[int], **kvci: object) -> dict:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], kvci_params(**kvci),
                              use_tqdm=False)
        return out.kv_transfer_params["kvci"]

    token = session_token(root)
    p = prompts()
    replies = {
        "persisted": run(p["persisted"], tenant="acme", session_token=token, persist=True,
                         source_ids=["doc:handbook"]),
        "refused": run(p["refused"], tenant="acme", persist=True, source_ids=["doc:handbook"]),
        "flipped": run(p["flipped"], tenant="acme", session_token=token, persist=True,
                       source_ids=["doc:handbook"]),
    }
    wanted = {replies["persisted"]["checkpoint_id"], replies["flipped"]["checkpoint_id"]}
    deadline = time.monotonic() + 60
    while not wanted <= set(catalog_rows(Path(extra["disk_root"]))):
        if time.monotonic() > deadline:
            raise SystemExit("persisted checkpoints never reached the catalog")
        run([5, 6, 7])  # steps the engine so queued persist jobs reach the worker
    print("READY " + json.dumps({k: {"checkpoint_id": v["checkpoint_id"], "persist": v["persist"]}
                                for k, v in replies.items()}), flush=True)
    rng = random.Random(3)
    while True:  # until killed: keep the disk tier busy
        run([rng.randrange(2, 1000) for _ in range(200)], tenant="acme", session_token=token,
            persist=True, source_ids=["doc:handbook"])
