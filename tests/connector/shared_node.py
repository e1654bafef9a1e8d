"""Node A of the many-nodes test: a vLLM engine in its own process on the shared disk tier.

Persists the "persisted" prompt with a valid session credential and asks for the "refused" one
without one, waits until the shared catalog holds the persisted checkpoint, prints READY with
the replies, then serves on (stepping its engine) until its stdin closes.
"""

from __future__ import annotations

import json
import select
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg  # noqa: E402
from durable_support import prompts, session_token  # noqa: E402
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

    def recorded() -> set[str]:
        with psycopg.connect(extra["catalog_url"]) as conn:
            return {r[0] for r in conn.execute("SELECT checkpoint_id FROM checkpoints")}

    p = prompts()
    replies = {
        "persisted": run(p["persisted"], tenant="acme", session_token=session_token(root),
                         persist=True, source_ids=["doc:handbook"]),
        "refused": run(p["refused"], tenant="acme", persist=True, source_ids=["doc:handbook"]),
    }
    deadline = time.monotonic() + 60
    while replies["persisted"]["checkpoint_id"] not in recorded():
        if time.monotonic() > deadline:
            raise SystemExit("the persisted checkpoint never reached the shared catalog")
        run([5, 6, 7])  # steps the engine so the queued persist job reaches the worker
    print("READY " + json.dumps({k: {"checkpoint_id": v["checkpoint_id"], "persist": v["persist"]}
                                for k, v in replies.items()}), flush=True)
    while not select.select([sys.stdin], [], [], 1.0)[0]:
        run([5, 6, 7])
