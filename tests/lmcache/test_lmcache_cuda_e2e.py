"""End to end on a CUDA machine: `vllm.LLM` with LMCache behind the kvci facade, real KV copies.

Skipped without CUDA: LMCache's vLLM connector refuses the CPU platform ("No supported cpu
connector found"), which is why the CPU suite stands LMCache's MockGPUConnector in for the copy.
Needs torch with CUDA, a CUDA build of vLLM 0.32 and LMCache 0.5.x, and kvci importable by
vLLM's worker processes (installed, or on PYTHONPATH).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache_support import lmcache_settings, wait_until

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.engine,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="LMCache's vLLM connector needs a CUDA device"
    ),
]

BLOCK = 16
rng = random.Random(3)


def _prompt(n: int = 200) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def setup(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from vllm import LLM

    from kvci_plugin.governance import CredentialIssuer, write_hmac_key_file

    folder = tmp_path_factory.mktemp("lmcache_e2e")
    key = write_hmac_key_file(folder / "hs256.key")
    labels = folder / "labels.json"
    labels.write_text(json.dumps({"crm": {"classification": "INTERNAL", "residency_regions": ["eu"],
                                          "retention_days": 30, "mandatory_markings": []}}))
    disk = folder / "gated_disk"
    extra: dict[str, Any] = {
        f"lmcache.{name}": value for name, value in lmcache_settings(disk=disk).items()
    }
    extra["kvci"] = {"credentials": {"algorithm": "HS256", "key_file": str(key)},
                     "label_catalog": str(folder / "labels.db"), "label_catalog_json": str(labels),
                     "durable_region": "eu"}
    llm = LLM(
        model=str(tiny_model),
        block_size=BLOCK,
        gpu_memory_utilization=0.2,
        max_model_len=2048,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
        kv_transfer_config={
            "kv_connector": "KVCILMCacheConnector",
            "kv_connector_module_path": "kvci_plugin.lmcache",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    yield {"llm": llm, "issuer": CredentialIssuer.from_key_file("HS256", key), "disk": disk}
    llm.llm_engine.engine_core.shutdown()


def _generate(llm: Any, tokens: list[int], kv_transfer_params: dict[str, Any] | None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=tokens)],
        SamplingParams(temperature=0.0, max_tokens=8, extra_args=extra),
        use_tqdm=False,
    )
    return out


def _kvci(**fields: Any) -> dict[str, Any]:
    return {"kvci": {"session_id": "s-1", **fields}}


def test_a_checkpoint_is_loaded_back_for_its_tenant_only_with_identical_output(setup):
    llm, prompt = setup["llm"], _prompt()
    first = _generate(llm, prompt, _kvci(tenant="acme", checkpoint="now"))
    assert first.kv_transfer_params["kvci"]["save"] is True
    again = _generate(llm, prompt, _kvci(tenant="acme"))
    assert again.num_cached_tokens >= 128
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert _generate(llm, prompt, _kvci(tenant="globex")).num_cached_tokens == 0


def test_an_unannotated_short_prompt_is_not_saved(setup):
    llm, prompt = setup["llm"], _prompt()
    assert _generate(llm, prompt, None).kv_transfer_params is None
    assert _generate(llm, prompt, None).num_cached_tokens == 0


def test_only_a_permitted_persist_reaches_the_gated_disk(setup):
    llm, issuer, disk = setup["llm"], setup["issuer"], setup["disk"]
    token = issuer.issue_session(
        actor="alice",
        tenant="acme",
        scopes=["kv:persist"],
        clearance="INTERNAL",
        markings=[],
        regions=["eu"],
        policy_version=1,
    )
    refused = _generate(
        llm, _prompt(), _kvci(session_token=token, persist=True, source_ids=["unlabelled"])
    )
    assert refused.kv_transfer_params["kvci"]["durable"] is False
    assert not list(disk.glob("*.pt"))
    permitted = _generate(
        llm, _prompt(), _kvci(session_token=token, persist=True, source_ids=["crm"])
    )
    assert permitted.kv_transfer_params["kvci"]["durable"] is True
    assert wait_until(lambda: len(list(disk.glob("*.pt"))) >= 6)  # 200 tokens = six 32-token chunks
