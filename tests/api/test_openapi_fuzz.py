"""The published OpenAPI schema, fuzzed with schemathesis in a bounded run (in process, no
engine): every generated request, valid or not, gets a documented status and a JSON body that
matches the schema documented for that status, never a server error, and invalid requests are
refused.

`negative_data_rejection` is replaced by an explicit 400/413/422 check (schemathesis does not
count 413 as a rejection). `positive_data_acceptance` is left out on purpose: JSON Schema cannot
express the observation's cross-field rules (novel_items <= retrieved_items, ...) or its strict
integers (7.0 is refused for a count), so some schema-valid bodies are rightly answered 422
invalid_request.

The Hypothesis strategies are driven directly (`as_strategy`): schemathesis's pytest plugin
does not run under pytest 9 (it reads `Function._nodeid`).
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from control_support import OPERATOR_TOKEN, TEST_HOST, bearer, control_app, control_client
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from kvci_plugin.api.schema import ENDPOINT


@pytest.mark.parametrize(
    "mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
)
def test_fuzz_control_endpoint(module_world: Any, mode: schemathesis.GenerationMode) -> None:
    module_world.checkpoint()
    schema = schemathesis.openapi.from_asgi("/openapi.json", control_app(module_world.plane),
                                            headers=bearer(OPERATOR_TOKEN))
    operation = schema[ENDPOINT]["POST"]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=50, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    def check(case: schemathesis.Case) -> None:
        response = case.call(headers={**bearer(OPERATOR_TOKEN), "host": TEST_HOST})
        # schemathesis's own rejection check does not count 413 as a rejection; an invalid body
        # that is also oversized is rightly refused for its size first.
        case.validate_response(
            response, excluded_checks=[positive_data_acceptance, negative_data_rejection]
        )
        if mode is schemathesis.GenerationMode.NEGATIVE:
            assert response.status_code in (400, 413, 422), response.status_code

    check()


def test_schema_publishes_the_endpoint_with_every_action(world: Any) -> None:
    document = control_client(world.plane).get("/openapi.json").json()
    operation = document["paths"][ENDPOINT]["post"]
    assert operation["operationId"] == "graph_kv_checkpoint"
    for status in ("200", "400", "401", "403", "404", "410", "413", "422", "500"):
        assert status in operation["responses"], status
    request_ref = operation["requestBody"]["content"]["application/json"]["schema"]
    variants = {ref["$ref"].rsplit("/", 1)[1] for ref in request_ref["oneOf"]}
    assert variants == {"RecommendRequest", "CheckpointNowRequest", "PromoteRequest",
                        "ExplainRequest", "RamStatsRequest", "AdvisoryRequest", "ResetRequest",
                        "ForgetRequest"}
    assert set(request_ref["discriminator"]["mapping"]) == {
        "recommend", "checkpoint_now", "promote", "explain", "ram_stats", "advisory", "reset",
        "forget"}
