"""Node A of the two-node fault test: a vLLM engine in its own process on the shared PostgreSQL
catalog, its blobs in a Redis of its own (the one the test freezes).

Prints READY once its engine has started (its start-up reconciliation done), then persists one
new prompt after another, a pause between (tenant beta, a valid credential), printing
`DONE <n> <seconds>` after each request, until its stdin closes. A request that raises ends the
script with that error (the test sees it exit).
"""

from __future__ import annotations

import json
import random
import select
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable_support import READY, session_token  # noqa: E402
from engine import generate_one, kvci_params, make_llm  # noqa: E402
from fault_support import ENGINE  # noqa: E402

PAUSE_S = 1.5
"""Between two requests. A write every second or two keeps A's catalog writes coming, and A's
vLLM worker, which spins for a second after each step, idles in between: two engines on two
cores whose workers both spin starve each other's hand-offs for seconds, fault or none."""

if __name__ == "__main__":
    root, model = Path(sys.argv[1]), Path(sys.argv[2])
    extra = json.loads((root / "extra.json").read_text())
    llm = make_llm(model, extra, **ENGINE)
    token = session_token(root, tenant="beta")
    print(READY + json.dumps({}), flush=True)
    rng = random.Random(7)
    n = 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        started = time.monotonic()
        prompt = [rng.randrange(2, 1000) for _ in range(4 * 32 + 3)]
        generate_one(llm, prompt, kvci_params(tenant="beta", session_token=token, persist=True,
                                              source_ids=["doc:handbook"]))
        n += 1
        print(f"DONE {n} {time.monotonic() - started:.3f}", flush=True)
        time.sleep(PAUSE_S)
