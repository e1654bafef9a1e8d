"""`kvci demo`: the main job, end to end, on an embedded default.

Makes (or reuses) the tiny model, starts vLLM with the kvci connector, and plays a scripted
multi-turn agent session: the system trigger keeping a worthy context, the agent acting on the
advisory with `checkpoint: "now"`, a user persist with a valid session credential (permitted),
the same reply read back through the control surface's `advisory` action (as a streaming client
would), a request that opts out with `checkpoint: "never"`, a persist without credentials
(refused), then a second engine on the same disk tier that hits from disk.
It prints the advisories, tiers, hit tokens, TTFT of recompute vs RAM hit vs disk hit, and the
explain record of one persisted and one refused checkpoint.

The model is the TTFT benchmark's (``benchmarks/ttft.py``): random weights, 4 layers, hidden 512,
float32, so that a 4k-token prefill costs what a hit saves (many times a hit's time on a CPU:
benchmarks/results/README.md, ttft, recompute against the RAM hit); the default tiny model
prefills a context too fast to show a hit's worth.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvci_plugin.tinymodel import TinyModelSpec, make_tiny_model

BLOCK_SIZE = 32
SESSION = "demo-session"
PROMPT_TOKENS = 4000  # with turn 2's additions, 4k tokens of context: 32 MiB of KV
SOURCES = {
    "doc:handbook": {"classification": "INTERNAL", "residency_regions": ["eu"],
                     "retention_days": 30, "mandatory_markings": []},
    "doc:public-faq": {"classification": "PUBLIC", "mandatory_markings": []},
}

DEMO_MODEL = TinyModelSpec(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4,
                           intermediate_size=1408, dtype="float32")

console = Console()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Demo:
    def __init__(self, workdir: Path, prompt_tokens: int) -> None:
        from kvci_plugin.governance import CredentialIssuer, write_hmac_key_file

        self.workdir = workdir
        self.prompt_tokens = prompt_tokens
        with console.status("generating the model (first run only)"):
            self.model = make_tiny_model(DEMO_MODEL)
        key = write_hmac_key_file(workdir / "hs256.key")
        (workdir / "labels.json").write_text(json.dumps(SOURCES))
        self.control_port = _free_port()
        self.extra = {
            "ram_bytes": "256MiB", "state_dir": str(workdir / "state"),
            "disk_root": str(workdir / "disk"), "disk_bytes": "256MiB", "disk_region": "eu",
            "credentials": {"algorithm": "HS256", "key_file": str(key)},
            "label_catalog": str(workdir / "labels.sqlite3"),
            "label_catalog_json": str(workdir / "labels.json"),
            "control_port": self.control_port,
        }
        issuer = CredentialIssuer.from_key_file("HS256", key)
        self.token = issuer.issue_session(
            actor="alice", tenant="acme", scopes=["kv:persist"], clearance="CONFIDENTIAL",
            markings=[], regions=["eu"], policy_version=1)
        rng = random.Random(2026)
        self.rng = rng
        self.context = [rng.randrange(2, 1000) for _ in range(prompt_tokens)]
        self.llm: Any = None

    # ---- engine -------------------------------------------------------------------------------

    def start(self, label: str) -> None:
        from vllm import LLM

        with console.status(f"starting vLLM + kvci ({label})"):
            self.llm = LLM(
                # float32 as made: vLLM on CPU would run it in bf16, which this CPU lacks a matmul
                # for
                model=str(self.model), dtype=DEMO_MODEL.dtype, block_size=BLOCK_SIZE,
                gpu_memory_utilization=0.2,
                max_model_len=8192, enable_prefix_caching=False, enforce_eager=True,
                kv_transfer_config={
                    "kv_connector": "KVCheckpointConnector",
                    "kv_connector_module_path": "kvci_plugin.connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": self.extra,
                })

    def stop(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None

    def ask(self, tokens: list[int], max_tokens: int = 8, **kvci: Any) -> tuple[Any, float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"kv_transfer_params": {"kvci": kvci}} if kvci else None
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
        t0 = time.perf_counter()
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)
        return out, time.perf_counter() - t0

    def control(self, action: str, **body: Any) -> dict[str, Any]:
        import httpx

        # The tenant token the engine wrote into its state folder: the demo acts as tenant acme.
        token = (self.workdir / "state" / "control-tenant.token").read_text().strip()
        r = httpx.post(f"http://127.0.0.1:{self.control_port}/api/graph/kv_checkpoint",
                       json={"action": action, **body}, timeout=30,
                       headers={"Authorization": f"Bearer {token}"})
        return r.json()

    def ttft(self, tokens_fn: Any, n: int = 3, **kvci: Any) -> float:
        return statistics.median(self.ask(tokens_fn(), max_tokens=1, **kvci)[1] for _ in range(n))

    # ---- the script -----------------------------------------------------------------------------

    def run(self) -> int:
        self.start("engine 1")
        ctx = self.context
        observation = {"tool_calls": 6, "retrievals": 4, "phase": "understand",
                       "phase_completed": True, "turns_since_change": 3, "context_rewrites": 0,
                       "sibling_tasks": 3, "contradictions_unresolved": 0,
                       "contradictions_high_severity": 0}
        evidence = {
            "items": [{"id": f"e{i}", "novel": i < 2} for i in range(8)],
            "claims": [{"id": "c1", "evidence": ["e1", "e2"]}, {"id": "c2", "evidence": ["e3"]}],
            "contradictions": [],
        }

        console.rule("turn 1 — the system trigger scores the agent's assembled context")
        out, _ = self.ask(ctx, tenant="acme", session_id=SESSION, source_ids=["doc:handbook"],
                          observation=observation, evidence_bundle=evidence)
        k1 = out.kv_transfer_params["kvci"]
        console.print(k1["advisory"] or "(no advisory: not worth keeping)")
        console.print(f"system trigger: tier={k1['tier']} checkpoint={k1['checkpoint_id']}")

        console.rule("turn 2 — the agent acts on the advisory: checkpoint now")
        turn2 = (
            ctx + list(out.outputs[0].token_ids) + [self.rng.randrange(2, 1000) for _ in range(40)]
        )
        out, _ = self.ask(turn2, tenant="acme", session_id=SESSION, source_ids=["doc:handbook"],
                          observation=observation, trigger="agent", checkpoint="now")
        k2 = out.kv_transfer_params["kvci"]
        console.print(f"agent checkpoint: tier={k2['tier']} hit_tokens={k2['hit_tokens']} "
                      f"({k2['hit_tier']}) checkpoint={k2['checkpoint_id']}")

        console.rule("turn 3 — the user persists it, with a valid session credential")
        out, _ = self.ask(turn2, tenant="acme", session_id=SESSION, source_ids=["doc:handbook"],
                          session_token=self.token, persist=True)
        k3 = out.kv_transfer_params["kvci"]
        persisted_id = k3["checkpoint_id"]
        console.print(f"persist: {k3['persist']['status']} — {k3['persist']['reason']}")

        console.rule("a streaming client reads the same reply from the control surface")
        latest = self.control("advisory", session_id=SESSION, session_token=self.token)
        console.print(f"advisory action for session {SESSION!r}: tier={latest['kvci']['tier']} "
                      f"persist={latest['kvci']['persist']['status']} "
                      f"(same as turn 3's response: {latest['kvci'] == k3})")

        console.rule("an opted-out request: checkpoint \"never\" keeps nothing, however worthy")
        private = [self.rng.randrange(2, 1000) for _ in range(self.prompt_tokens // 2)]
        out, _ = self.ask(private, tenant="acme", observation=observation, checkpoint="never")
        k_never = out.kv_transfer_params["kvci"]
        console.print(
            f"recommended tier={k_never['recommendation']['tier']}, kept tier={k_never['tier']} "
            f"— {k_never['not_kept']}"
        )

        console.rule("turn 4 — a persist without credentials is refused")
        other = [self.rng.randrange(2, 1000) for _ in range(self.prompt_tokens // 2)]
        out, _ = self.ask(other, tenant="acme", source_ids=["doc:handbook"], persist=True)
        k4 = out.kv_transfer_params["kvci"]
        refused_id = k4["checkpoint_id"]
        console.print(f"persist: {k4['persist']['status']} — {k4['persist']['reason']}")

        self._wait_persisted(persisted_id)
        fresh = lambda: [self.rng.randrange(2, 1000) for _ in range(len(turn2))]  # noqa: E731
        t_cold = self.ttft(fresh)
        t_ram = self.ttft(lambda: turn2, tenant="acme")
        explain_persisted = self.control(
            "explain", checkpoint_id=persisted_id, session_token=self.token
        )
        explain_refused = self.control(
            "explain", checkpoint_id=refused_id, session_token=self.token
        )
        self.stop()

        console.rule("restart — a new engine on the same disk tier")
        self.start("engine 2")
        out, _ = self.ask(turn2, max_tokens=1, tenant="acme")
        k5 = out.kv_transfer_params["kvci"]
        t_disk = self.ttft(lambda: turn2, tenant="acme")
        self.stop()

        table = Table(title=f"TTFT, {len(turn2)}-token context (median of 3)")
        for col in ("path", "TTFT (s)", "vs recompute", "hit tokens"):
            table.add_column(col)
        table.add_row("recompute", f"{t_cold:.3f}", "1.00×", "0")
        table.add_row(
            "kvci RAM hit",
            f"{t_ram:.3f}",
            f"{t_cold / t_ram:.2f}×",
            str(k2["hit_tokens"] or k3["hit_tokens"]),
        )
        table.add_row("kvci disk hit (after restart)", f"{t_disk:.3f}", f"{t_cold / t_disk:.2f}×",
                      f"{k5['hit_tokens']} ({k5['hit_tier']})")
        console.print(table)
        console.rule("explain — the persisted checkpoint")
        console.print_json(data=_explain_summary(explain_persisted))
        console.rule("explain — the refused checkpoint")
        console.print_json(data=_explain_summary(explain_refused))
        ok = (
            k5["hit_tier"] == "disk"
            and k4["persist"]["status"] == "refused"
            and latest["kvci"] == k3
            and k_never["tier"] == "none"
        )
        console.print(
            "[bold green]demo complete[/]" if ok else "[bold red]demo finished with surprises[/]"
        )
        return 0 if ok else 1

    def _wait_persisted(self, checkpoint_id: str) -> None:
        with console.status("waiting for the persisted checkpoint to reach disk"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                info = self.control(
                    "explain", checkpoint_id=checkpoint_id, session_token=self.token
                )
                if "disk" in str(info.get("explanation", info).get("tier", "")):
                    return
                self.ask([3, 4, 5], max_tokens=1)  # one engine step carries the persist job
        raise RuntimeError("the persisted checkpoint never reached disk")


def _explain_summary(info: dict[str, Any]) -> dict[str, Any]:
    info = info.get("explanation", info)
    decision = info.get("eligibility_decision") or {}
    checks = (decision.get("derivation") or {}).get("checks", [])
    return {
        "checkpoint_id": info.get("checkpoint_id"), "tier": info.get("tier"),
        "trigger": info.get("trigger"), "gate_in_force": info.get("gate_in_force"),
        "refusal": info.get("refusal"), "permitted": decision.get("permitted"),
        "failed_check": decision.get("failed_check"),
        "checks": [f"{c['name']}: {c['verdict']}" for c in checks],
        "retention_expiry": decision.get("retention_expiry"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvci demo", description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvci-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    console.print(f"kvci demo — working folder {workdir}")
    return Demo(workdir, args.prompt_tokens).run()
