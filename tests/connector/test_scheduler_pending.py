"""What a client says of its turn's end reaches the RAM tier's policy (no engine: a real vLLM
Request, the real scheduler side and RAM index): ``kvci.observation.tool_call_pending`` classes
the context the policy remembers, so the policy learns how often such contexts come back."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.request.tenancy import TenantResolver

BS = 32
SLOT = 1 << 16


def finished(req_id: str, prompt: list[int], **kvci: Any) -> Request:
    request = Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"kvci": kvci}}),
        None,
    )
    request.num_computed_tokens = len(prompt)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return request


@pytest.mark.parametrize("said", [True, False, None])
def test_the_clients_word_on_a_pending_tool_call_classes_what_the_policy_remembers(said) -> None:
    scheduler = KVCIScheduler(
        config=KVCIConfig(ram_bytes=64 * SLOT),
        block_size=BS,
        slot_bytes=SLOT,
        namespace=hashlib.sha256(b"pending").digest(),
        secret=b"s" * 32,
        tp_size=1,
        tenants=TenantResolver(None),
        disk=None,
    )
    observation = {} if said is None else {"observation": {"tool_call_pending": said}}
    request = finished("r", list(range(1, 2 * BS + 2)), **observation)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.request_finished(request, [[1, 2, 3]])
    learned = scheduler.manager.index.policy_learned()
    assert learned is not None
    assert [cls[2] for cls in learned.idle.spent()] == [said]
