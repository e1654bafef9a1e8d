"""Through vLLM's OpenAI-compatible server: the advisory comes back in `kv_transfer_params`, and
16 concurrent clients x 8 requests with shared prefixes all get their baseline output."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from engine import BLOCK_SIZE
from server import Server

pytestmark = pytest.mark.engine

rng = random.Random(13)
PREFIXES = [[rng.randrange(2, 1000) for _ in range(4 * BLOCK_SIZE)] for _ in range(4)]
PROMPTS = [PREFIXES[i % 4] + [rng.randrange(2, 1000) for _ in range(rng.randrange(10, 80))]
           for i in range(16 * 8)]
OBSERVATION = {"tool_calls": 8, "retrievals": 6, "phase": "plan", "phase_completed": True,
               "turns_since_change": 4, "context_rewrites": 0, "sibling_tasks": 4,
               "contradictions_unresolved": 0, "contradictions_high_severity": 0,
               "wall_time_s": 3.0}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("srv")
    # 2 MiB = 128 pages of 16 KiB: far less than the 128 requests' KV, so eviction runs.
    srv = Server(tiny_model, {"ram_bytes": "2MiB", "state_dir": str(tmp / "state"),
                              "system_trigger": False},
                 tmp / "server.log").wait()
    yield srv
    srv.stop()


async def _complete(client, srv, tokens, kvci=None):
    body = {"model": srv.model, "prompt": tokens, "max_tokens": 8, "temperature": 0.0}
    if kvci is not None:
        body["kv_transfer_params"] = {"kvci": kvci}
    r = await client.post(srv.url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    data = r.json()
    return data["choices"][0]["text"], data.get("kv_transfer_params")


def test_advisory_and_concurrent_clients(server):
    async def main():
        async with httpx.AsyncClient() as client:
            # Baselines first: no kvci params, nothing stored, so every one is a recompute.
            baseline = {}
            for p in {tuple(p) for p in PROMPTS}:
                baseline[p] = (await _complete(client, server, list(p)))[0]
            text, params = await _complete(client, server, PROMPTS[0],
                                           {"tenant": "t", "observation": OBSERVATION,
                                            "checkpoint": "now"})
            assert text == baseline[tuple(PROMPTS[0])]
            kvci = params["kvci"]
            assert kvci["tier"] == "ram" and kvci["recommendation"]["score"] is not None
            assert kvci["advisory"].startswith("KV-CHECKPOINT ADVISORY")

            async def client_run(c):
                results = []
                for j in range(8):
                    p = PROMPTS[c * 8 + j]
                    results.append((p, await _complete(client, server, p,
                                                       {"tenant": "t", "checkpoint": "now"})))
                return results

            runs = await asyncio.gather(*(client_run(c) for c in range(16)))
            return baseline, [r for run in runs for r in run]

    baseline, results = asyncio.run(main())
    assert len(results) == 128
    for prompt, (text, params) in results:
        assert "error" not in params["kvci"]
        assert text == baseline[tuple(prompt)]
    assert sum(params["kvci"]["hit_tokens"] > 0 for _, (_, params) in results) >= 64
