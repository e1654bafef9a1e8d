"""The facade inside vLLM's real scheduler, against LMCache's real scheduler and worker sides.

vLLM's `Scheduler` builds `KVCILMCacheConnector` itself and calls its hooks exactly as in
serving; the facade runs LMCache's real `LMCacheConnectorV1Impl` (scheduler role), whose lookups
go over ZMQ to LMCache's real lookup server in front of LMCache's real worker engine (CPU tier +
kvci's gated disk tier). What a GPU worker would do per step is done by `_worker_step`: the
store call of `LMCacheConnectorV1Impl.wait_for_save`, with LMCache's MockGPUConnector in place
of the GPU copy. No model runs: one sampled token per request is handed to the scheduler.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.integration.vllm.utils import lmcache_get_or_create_config
from lmcache.integration.vllm.vllm_service_factory import VllmServiceFactory
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.lookup_client.factory import LookupClientFactory
from lmcache_support import (
    CHUNK,
    HEAD_SIZE,
    chunk_keys,
    gated,
    lmcache_settings,
    start_engine,
    store,
    wait_until,
)
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvci_plugin.governance import CredentialIssuer, write_hmac_key_file
from kvci_plugin.lmcache import KVCILMCacheConnector
from kvci_plugin.lmcache.request_configs import DURABLE_UNTIL, SKIP_SAVE, TENANT_TAG, tenant_tag

NUM_BLOCKS = 256
rng = random.Random(5)


def _prompt() -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(3 * CHUNK + 4)]  # three full LMCache chunks


def _kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=CHUNK, num_kv_heads=2, head_size=HEAD_SIZE, dtype=torch.bfloat16
    )
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )


def _vllm_config(model: Path, extra: dict[str, Any]):
    transfer = {
        "kv_connector": "KVCILMCacheConnector",
        "kv_connector_module_path": "kvci_plugin.lmcache",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    config = EngineArgs(
        model=str(model),
        block_size=CHUNK,
        max_model_len=4096,
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
    ).create_engine_config()
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config


def _model_runner_output(req_id: str) -> ModelRunnerOutput:
    """One sampled token for ``req_id``; ``req_id_to_index`` only where the vLLM has it (it
    left ModelRunnerOutput in 0.34: the order of ``req_ids`` says it)."""
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    index = {"req_id_to_index": {req_id: 0}} if "req_id_to_index" in fields else {}
    return ModelRunnerOutput(req_ids=[req_id], sampled_token_ids=[[7]], **index)


class Loop:
    def __init__(self, model: Path, extra: dict[str, Any], name: str) -> None:
        self.name = name
        self.vllm_config = _vllm_config(model, extra)
        self.scheduler = Scheduler(vllm_config=self.vllm_config, kv_cache_config=_kv_cache_config(),
                                   structured_output_manager=StructuredOutputManager(self.vllm_config),
                                   block_size=CHUNK)
        assert isinstance(self.scheduler.connector, KVCILMCacheConnector)
        # The configuration LMCache's worker reads: the facade's `lmcache.*` overlay is applied.
        config = lmcache_get_or_create_config()
        metadata = VllmServiceFactory(config, self.vllm_config, "worker").get_or_create_metadata()
        self.engine = start_engine(name, config, metadata)
        self.lookup_server = LookupClientFactory.create_lookup_server(self.engine, metadata)

    @property
    def connector(self) -> KVCILMCacheConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, KVCILMCacheConnector)
        return connector

    def run(self, req_id: str, tokens: list[int],
            kv_transfer_params: dict[str, Any] | None) -> tuple[SchedulerOutput, EngineCoreOutput]:
        """One request through one step: scheduled, stored by the worker, one token, finished."""
        extra = (
            {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        )
        self.scheduler.add_request(
            Request(req_id, list(tokens), SamplingParams(max_tokens=1, extra_args=extra), None)
        )
        step = self.scheduler.schedule()
        self._worker_step(step)
        result = self.scheduler.update_from_output(
            step,
            _model_runner_output(req_id),
        )
        (output,) = result[0].outputs
        assert output.finished
        return step, output

    def _worker_step(self, step: SchedulerOutput) -> None:
        for meta in step.kv_connector_metadata.requests:
            self.engine.lookup_unpin(meta.req_id)
            if meta.save_spec is not None and meta.save_spec.can_save:
                store(
                    self.engine,
                    meta.token_ids,
                    meta.request_configs,
                    skip_leading=meta.save_spec.skip_leading_tokens // CHUNK * CHUNK,
                    req_id=meta.req_id,
                )

    def close(self) -> None:
        self.lookup_server.close()
        self.scheduler.shutdown()
        LMCacheEngineBuilder.destroy(self.name)


def _hits(step: SchedulerOutput) -> int:
    (new,) = step.scheduled_new_reqs
    return new.num_computed_tokens  # prefix caching is off: every computed token came from LMCache


@pytest.fixture(scope="module")
def governance_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("governance")
    labels = folder / "labels.json"
    labels.write_text(json.dumps({"crm": {"classification": "INTERNAL", "residency_regions": ["eu"],
                                          "retention_days": 30, "mandatory_markings": []}}))
    return {
        "key": write_hmac_key_file(folder / "hs256.key"),
        "labels": labels,
        "catalog": folder / "labels.db",
        "disk": tmp_path_factory.mktemp("gated_disk"),
    }


@pytest.fixture(scope="module")
def loop(tiny_model: Path, governance_files: dict[str, Path]) -> Iterator[Loop]:
    settings = lmcache_settings(disk=governance_files["disk"])
    extra: dict[str, Any] = {f"lmcache.{name}": value for name, value in settings.items()}
    extra["kvci"] = {
        "credentials": {"algorithm": "HS256", "key_file": str(governance_files["key"])},
        "label_catalog": str(governance_files["catalog"]),
        "label_catalog_json": str(governance_files["labels"]),
        "durable_region": "eu",
    }
    loop = Loop(tiny_model, extra, "kvci-scheduler-loop")
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def issuer(governance_files: dict[str, Path]) -> CredentialIssuer:
    return CredentialIssuer.from_key_file("HS256", governance_files["key"])


def _session(issuer: CredentialIssuer, tenant: str = "acme") -> str:
    return issuer.issue_session(
        actor="alice",
        tenant=tenant,
        scopes=["kv:persist"],
        clearance="INTERNAL",
        markings=[],
        regions=["eu"],
        policy_version=1,
    )


def _kvci(**fields: Any) -> dict[str, Any]:
    return {"kvci": {"session_id": "s-1", **fields}}


def test_the_facade_overrides_only_the_three_scheduler_hooks():
    own = {
        name
        for name in vars(KVCILMCacheConnector)
        if not name.startswith("__") and name != "_abc_impl"
    }
    assert own == {
        "get_num_new_matched_tokens",
        "build_connector_meta",
        "request_finished",
        "_admit",
    }
    assert issubclass(KVCILMCacheConnector, LMCacheConnectorV1)


def test_a_checkpoint_is_found_again_by_its_tenant_only(loop: Loop):
    prompt = _prompt()
    _, first = loop.run("acme-1", prompt, _kvci(tenant="acme", checkpoint="now"))
    assert first.kv_transfer_params is not None
    reply = first.kv_transfer_params["kvci"]
    assert (
        reply["decided_at"] == "admission" and reply["save"] is True and reply["durable"] is False
    )
    again, _ = loop.run("acme-2", prompt, _kvci(tenant="acme"))
    assert _hits(again) == 3 * CHUNK
    other, _ = loop.run("globex-1", prompt, _kvci(tenant="globex"))
    assert _hits(other) == 0
    anonymous, output = loop.run("anon-1", prompt, None)
    assert _hits(anonymous) == 0
    assert output.kv_transfer_params is None  # nothing asked, nothing said


def test_a_request_not_worth_keeping_is_not_saved(loop: Loop):
    prompt = _prompt()
    _, output = loop.run("plain-1", prompt, None)
    again, _ = loop.run("plain-2", prompt, None)
    assert _hits(again) == 0
    assert output.kv_transfer_params is None


def test_the_clients_own_skip_save_is_honoured(loop: Loop):
    prompt = _prompt()
    _, output = loop.run("skip-1", prompt, {**_kvci(checkpoint="now"), SKIP_SAVE: True})
    assert (
        output.kv_transfer_params is not None and output.kv_transfer_params["kvci"]["save"] is False
    )
    again, _ = loop.run("skip-2", prompt, _kvci())
    assert _hits(again) == 0


def test_a_permitted_persist_reaches_the_gated_disk_and_a_refused_one_does_not(loop: Loop, issuer):
    permitted, refused = _prompt(), _prompt()
    disk = gated(loop.engine, "kvci_disk")
    admitted, refusals = disk.admitted, disk.refused
    _, output = loop.run(
        "persist-ok",
        permitted,
        _kvci(session_token=_session(issuer), persist=True, source_ids=["crm"]),
    )
    reply = output.kv_transfer_params["kvci"]
    assert reply["durable"] is True and reply["persist"]["permitted"] is True
    assert (disk.admitted, disk.refused) == (admitted + 3, refusals)
    _, output = loop.run("persist-no", refused, _kvci(session_token=_session(issuer), persist=True,
                                                        source_ids=["unlabelled"]))
    reply = output.kv_transfer_params["kvci"]
    assert reply["durable"] is False and reply["persist"]["failed_check"] == "labels_present"
    assert (disk.admitted, disk.refused) == (admitted + 3, refusals + 3)
    tag = {TENANT_TAG: tenant_tag("acme", "default")}
    assert wait_until(
        lambda: all(disk.contains(key) for key in chunk_keys(loop.engine, permitted, tag))
    )
    assert not any(disk.contains(key) for key in chunk_keys(loop.engine, refused, tag))
    again, _ = loop.run("persist-again", refused, _kvci(session_token=_session(issuer)))
    assert _hits(again) == 3 * CHUNK  # the refused request still went to LMCache's CPU tier


def test_a_permit_or_tenant_tag_forged_by_the_client_is_dropped(loop: Loop):
    prompt = _prompt()
    disk = gated(loop.engine, "kvci_disk")
    admitted, refusals = disk.admitted, disk.refused
    loop.run(
        "forge-permit",
        prompt,
        {**_kvci(tenant="acme", checkpoint="now"), DURABLE_UNTIL: "inf", "lmcache.kvci.other": "x"},
    )
    assert (disk.admitted, disk.refused) == (admitted, refusals + 3)
    own, _ = loop.run("forge-own", prompt, _kvci(tenant="acme"))
    assert _hits(own) == 3 * CHUNK
    acme_tag = {TENANT_TAG: tenant_tag("acme", "default")}
    anonymous, _ = loop.run("forge-anonymous", prompt, acme_tag)
    assert _hits(anonymous) == 0
    globex, _ = loop.run("forge-globex", prompt, {**_kvci(tenant="globex"), **acme_tag})
    assert _hits(globex) == 0


def test_a_request_first_seen_when_scheduled_is_decided_before_lmcache_reads_it(loop: Loop):
    request = Request("late-1", _prompt(), SamplingParams(max_tokens=1, extra_args=None), None)
    step = SchedulerOutput.make_empty()
    # prefill_token_ids: optional before vLLM 0.34, required from it (the scheduler passes them).
    step.scheduled_new_reqs = [
        NewRequestData.from_request(request, ([0, 1, 2, 3],), list(request.all_token_ids))
    ]
    step.num_scheduled_tokens = {request.request_id: request.num_prompt_tokens}
    step.total_num_scheduled_tokens = request.num_prompt_tokens
    meta = loop.connector.build_connector_meta(step)
    assert [
        m.req_id for m in meta.requests
    ] == []  # short, unannotated: not worth a save, nothing to load
    assert request.sampling_params.extra_args["kv_transfer_params"][SKIP_SAVE] is True
    loop.connector.request_finished(request, [])


def test_an_lmcache_configuration_with_an_ungated_tier_is_refused_before_lmcache_starts(
    tiny_model: Path,
):
    config = _vllm_config(
        tiny_model, {"lmcache.local_disk": "/tmp/kvci-never-created", "lmcache.chunk_size": CHUNK}
    )
    with pytest.raises(ValueError, match="local_disk"):
        KVCILMCacheConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config())
