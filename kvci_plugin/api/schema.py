"""`graph_kv_checkpoint`: one request and one response model per action.

The REST endpoint and the MCP tool share these models, so their schemas are the same. A request
is a tagged union on `action`; fields that do not apply to an action are refused (a typo or a
misplaced credential must not be silently ignored).

`observation_json`, `evidence_bundle_json` and `context_bundle_json` are JSON objects: the
bundles fill the grounding, contradiction and novelty axes, and every non-null
`observation_json` field wins over a value derived from a bundle.

`reset` is the operator's: it takes no tenant credential but the operator's bearer token (the
tenant token is answered 403 operator_required). `forget` crypto-erases a tenant, so it is gated
like a promote, on a verified session credential of that tenant holding the `kv:forget` scope.
With the tenant token, `explain` and `ram_stats` act within the caller's tenant (see
`kvci_plugin.api.roles`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from kvci_plugin.governance import EligibilityDecision
from kvci_plugin.governance.names import TenantName
from kvci_plugin.worthiness import (
    CheckpointObservation,
    CheckpointRecommendation,
    ContextBundle,
    EvidenceBundle,
)

ENDPOINT = "/api/graph/kv_checkpoint"
ACTIONS = ("recommend", "checkpoint_now", "promote", "explain", "ram_stats", "advisory", "reset",
           "forget")

RESET_WAIT_S_DEFAULT = 10.0
RESET_WAIT_S_MAX = 60.0
RESET_SCOPE = ("kvci's RAM and disk tiers only: vLLM's own prefix cache (the KV in its GPU blocks) "
               "is not reset; for that, use vLLM's reset_prefix_cache (LLM.reset_prefix_cache(), "
               "or POST /reset_prefix_cache on a server in dev mode)")

_IN = ConfigDict(extra="forbid", frozen=True)

# The same shapes as a request's `kv_transfer_params.kvci` (connector/params.py), so a session
# armed here matches the requests that name it.
SessionId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@/-]+$")]
Credential = Annotated[str, Field(min_length=1, max_length=8192)]
CheckpointId = Annotated[str, Field(
    min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$",
    description="as returned in a response's kv_transfer_params.kvci.checkpoint_id")]
Trigger = Annotated[Literal["user", "agent"], Field(
    description="who asked (provenance, not authority: every trigger is gated alike)")]

_OBSERVATION_DOC = "what the caller measured; its non-null fields win over bundle-derived ones"
_EVIDENCE_DOC = (
    "a retrieval result (items, claims, contradictions) to derive observation fields from"
)
_CONTEXT_DOC = "a context-compile result (items, claims, contradictions, dropped_items)"
_TENANT_DOC = "declared tenant; a verified session_token's tenant wins and must agree with it"
_SESSION_DOC = (
    "the caller's own session credential (signed); authority is derived from it at the write"
)
_DELEGATION_DOC = "delegation credentials whose ceilings cap the session's authority"


class _Scoring(BaseModel):
    model_config = _IN

    observation_json: CheckpointObservation | None = Field(None, description=_OBSERVATION_DOC)
    evidence_bundle_json: EvidenceBundle | None = Field(None, description=_EVIDENCE_DOC)
    context_bundle_json: ContextBundle | None = Field(None, description=_CONTEXT_DOC)


class RecommendRequest(_Scoring):
    """Score a moment and return the advisory. Takes no checkpoint."""

    action: Literal["recommend"]


class CheckpointNowRequest(_Scoring):
    """Keep the KV of the session's next finished request (a finished request's blocks are
    already freed, so "now" is the end of the session's current or next turn). The tenant comes
    from the verified `session_token`, else from `tenant`, else the default tenant. The arm is
    bound to your credential (a digest of it; none kept): only a request of that tenant and
    session carrying the same credential spends it (without one, the session's next request),
    and a disk copy (`persist`) is gated on that request's own credential, or on yours at a
    later `promote`."""

    action: Literal["checkpoint_now"]
    session_id: SessionId = Field(description="the session whose next finished request is kept")
    tenant: TenantName | None = Field(None, description=_TENANT_DOC)
    session_token: Credential | None = Field(
        None, description="the caller's own session credential (signed): sets the tenant; it is "
        "verified now and not kept")
    trigger: Trigger = "user"
    persist: bool = Field(False, description="also ask the eligibility gate for a disk copy, with "
                          "the finishing request's own credential")


class PromoteRequest(BaseModel):
    """RAM -> disk through the eligibility gate, with authority derived now from the caller's own
    session credential. Without one (or with one that no longer verifies) the gate refuses and
    the refusal is recorded on the checkpoint, so `explain` says why."""

    model_config = _IN

    action: Literal["promote"]
    checkpoint_id: CheckpointId
    session_token: Credential | None = Field(None, description=_SESSION_DOC)
    delegation_tokens: list[Credential] = Field(default_factory=list, max_length=8,
                                                description=_DELEGATION_DOC)
    tenant: TenantName | None = Field(None, description=_TENANT_DOC)
    trigger: Trigger = "user"


class ExplainRequest(BaseModel):
    """Why this checkpoint exists and why it is where it is. Only the caller's tenant's
    checkpoints are visible: the tenant of its verified session credential, else (tenancy
    "declared") the one it declares, else the default tenant; the operator token naming neither
    sees any. One a cache reset fenced answers 410 checkpoint_fenced, one a forget erased 410
    checkpoint_forgotten (to its tenant, or to the operator naming none)."""

    model_config = _IN

    action: Literal["explain"]
    checkpoint_id: CheckpointId
    tenant: TenantName | None = Field(None, description=_TENANT_DOC)
    session_token: Credential | None = Field(None, description=_SESSION_DOC)


class RamStatsRequest(BaseModel):
    """RAM-tier occupancy, the RAM admission bar, the eligibility gate in force and the
    registered scorers.
    `tenant_bytes` lists every tenant for the operator token naming none; otherwise only the
    caller's tenant (as for explain)."""

    model_config = _IN

    action: Literal["ram_stats"]
    tenant: TenantName | None = Field(None, description=_TENANT_DOC)
    session_token: Credential | None = Field(None, description=_SESSION_DOC)


class AdvisoryRequest(BaseModel):
    """The `kvci` object the session's latest finished request would have carried back: for
    clients whose responses carried no kv_transfer_params (streams on vLLM 0.32, aborts and stop
    strings on every version). Visible to its tenant only;
    a request made with a session credential is visible only with one (of that tenant)."""

    model_config = _IN

    action: Literal["advisory"]
    session_id: SessionId = Field(description="the session_id the request sent in its kvci params")
    tenant: TenantName | None = Field(None, description=_TENANT_DOC)
    session_token: Credential | None = Field(None, description=_SESSION_DOC)


class ResetRequest(BaseModel):
    """Operator action: a cache reset of kvci's tiers, as vLLM's `reset_cache` does after an
    in-place weight update. Every checkpoint computed before it is fenced: RAM forgets it, and the
    disk tier starts a new generation for every node sharing its catalog, so no KV from before the
    reset is loaded after it; `explain` of a fenced checkpoint answers 410 checkpoint_fenced. The
    engine's scheduler applies it before its next lookup. Takes no tenant credential: it needs the
    operator's bearer token (the tenant token is answered 403 operator_required). Resets kvci's
    tiers only, not vLLM's own prefix cache (for that: vLLM's reset_prefix_cache)."""

    model_config = _IN

    action: Literal["reset"]
    wait_s: float = Field(
        RESET_WAIT_S_DEFAULT, ge=0, le=RESET_WAIT_S_MAX, strict=True, allow_inf_nan=False,
        description="seconds to wait for the engine to apply it (an idle engine applies it when "
        "its next request arrives); after them the answer is `pending`")


class ForgetRequest(BaseModel):
    """Crypto-erasure of one tenant's KV: its key material is destroyed and its checkpoints
    forgotten, so no node sharing the disk tier loads any of its blobs again (their bytes are
    deleted too); this engine's RAM tier forgets its checkpoints. Gated like promote: a verified
    session credential of that tenant whose authority (after the delegation ceilings) holds the
    `kv:forget` scope; anything less answers 403 credential_refused, naming the check."""

    model_config = _IN

    action: Literal["forget"]
    tenant: TenantName = Field(description="the tenant to forget (the credential's own)")
    session_token: Credential | None = Field(None, description=_SESSION_DOC)
    delegation_tokens: list[Credential] = Field(default_factory=list, max_length=8,
                                                description=_DELEGATION_DOC)


KVCheckpointRequest = Annotated[
    RecommendRequest | CheckpointNowRequest | PromoteRequest | ExplainRequest | RamStatsRequest
    | AdvisoryRequest | ResetRequest | ForgetRequest,
    Field(discriminator="action"),
]
REQUEST_ADAPTER: TypeAdapter[Any] = TypeAdapter(KVCheckpointRequest)

# ---- responses ---------------------------------------------------------------------------------

_OUT = ConfigDict(extra="forbid", frozen=True)
# Views of the manager's dicts: a figure added there must not turn a read into a 500.
_VIEW = ConfigDict(extra="allow", frozen=True)


class RecommendResponse(BaseModel):
    model_config = _OUT

    action: Literal["recommend"]
    recommendation: CheckpointRecommendation
    advisory: str = Field(description="the rendered advisory block; empty when not worth it")


class CheckpointNowResponse(BaseModel):
    model_config = _OUT

    action: Literal["checkpoint_now"]
    armed: bool
    tenant: str
    session_id: str
    trigger: Trigger
    persist: bool
    detail: str
    recommendation: CheckpointRecommendation
    advisory: str


class PromoteResponse(BaseModel):
    model_config = _OUT

    action: Literal["promote"]
    checkpoint_id: str
    status: Literal["persisting", "persisted", "refused", "failed"]
    reason: str
    decision: EligibilityDecision | None = None


class ToolCallWord(BaseModel):
    """Whether the turn that made a checkpoint ended on a tool call."""

    model_config = _VIEW

    detected: bool | None = Field(
        None, description="the engine's word, from the output's tool-call markers (None: not "
        "known: no markers, or structured output)")
    pending: bool | None = Field(
        None, description="the word in force: the client's tool_call_pending, else the engine's")


class RetentionSession(BaseModel):
    """The session whose next request ends a retention, and who named it."""

    model_config = _VIEW

    id: str
    by: Literal["client", "vllm"] = Field(
        description="the client's kvci.session_id, or vLLM's Request.session_id (its OpenAI "
        "server's session_id, X-Session-ID header or vllm_xargs) where the client named none")


class RetentionGiven(BaseModel):
    """A retention asked for a checkpoint: exempt from eviction for ``ttl_s`` or until its
    session's next request."""

    model_config = _VIEW

    by: Literal["client", "kv_hints", "engine"] = Field(
        description="whose word: the client's kvci.retain, a kvci.retain action of vLLM's KV "
        "hints, or the engine's automatic retention of a tool call's pause")
    status: Literal["retained", "refused"]
    ttl_s: float
    reason: str
    priority: int | None = Field(None, description="the KV hint's priority")
    asked_ttl_s: float | None = Field(
        None, description="the TTL asked, when it was trimmed to max_retain_s")
    session: RetentionSession | None = Field(
        None, description="the session whose next request ends it (None: the TTL alone)")


class CheckpointExplanation(BaseModel):
    model_config = _VIEW

    checkpoint_id: str
    gate_in_force: str
    tier: str = Field(description="ram, ram+disk or disk")
    tenant: str
    trigger: str | None
    pages: int
    bytes: int
    created: float
    pending: bool = Field(description="the RAM copy is still being made")
    persisting: Literal["waiting", "writing"] | None = Field(
        None, description="a permitted persist waiting for the RAM copy, or writing blobs")
    source_ids: list[str] = Field(
        default_factory=list, description="the sources whose labels gate it"
    )
    recommendation: CheckpointRecommendation | None = None
    eligibility_decision: EligibilityDecision | None = None
    refusal: str | None = Field(None, description="why the last promotion was refused")
    persist_error: str | None = None
    retention_expiry: float | None = None
    tool_call: ToolCallWord | None = Field(
        None, description="whether the turn that made it ended on a tool call (RAM only)")
    retention: RetentionGiven | None = Field(
        None, description="the retention asked for it, by whose word, and what became of it")


class ExplainResponse(BaseModel):
    model_config = _OUT

    action: Literal["explain"]
    explanation: CheckpointExplanation


class DiskTierHealth(BaseModel):
    """The disk tier's dependencies (catalog, blob store): degraded after a failure, skipped
    (lookups miss, writes are dropped) and probed in the background until they answer."""

    model_config = _VIEW

    name: str
    state: Literal["healthy", "degraded"]
    failures: int
    incidents: int
    degraded_for_s: float | None
    last_error: str | None


class DiskTierStats(BaseModel):
    """Counts are None while the tier is degraded (its catalog is not asked)."""

    model_config = _VIEW

    checkpoints: int | None
    pages: int | None
    unreferenced_pages: int | None
    bytes_used: int | None
    capacity_bytes: int | None
    quarantined: int | None
    health: DiskTierHealth


class RAMAdmissionStats(BaseModel):
    """The RAM admission bar: the threshold the engine scores a request at, and `recommend` too."""

    model_config = _OUT

    mode: Literal["pressure", "fixed"] = Field(
        description="`pressure`: the bar moves with the tier's mistakes; `fixed`: it stays at "
        "ram_threshold (ram_admission `fixed`, or no system trigger)")
    threshold: float = Field(description="the RAM threshold a request is scored at now")
    wasted_writes: int | None = Field(
        description="system checkpoints evicted before any hit (each raised the bar); none when "
                    "fixed"
    )
    missed_reuses: int | None = Field(
        description="requests that wanted a checkpoint only the bar held back (each lowered it); "
        "none when fixed")
    paid_writes: int | None = Field(
        description="system checkpoints a request hit before their eviction; none when fixed")


class RAMPolicyStats(BaseModel):
    """What the RAM tier's policy did since the engine started (`ram_policy`)."""

    model_config = _VIEW

    policy: str = Field(
        description="`kvci` (ram_policy value) or `lru` (ram_policy lru or threshold)"
    )
    admitted: int = Field(description="checkpoints the policy let in")
    admitted_explicit: int = Field(
        description="of those, explicit checkpoints (kept whatever it weighed)"
    )
    displaced: int = Field(description="checkpoints evicted to make room for an admitted one")
    refused_under_pressure: int = Field(
        description="offers worth less than the checkpoints they would have evicted")
    evicted_before_hit: int = Field(description="evicted checkpoints no request re-sent while held")
    tracked_anchors: int = Field(
        description="contexts remembered (held or not) to learn reuse from"
    )


class RAMTierStats(BaseModel):
    model_config = _VIEW

    entries: int
    pending_entries: int
    pages: int
    pinned_pages: int
    bytes_used: int
    capacity_bytes: int
    max_entries: int
    slot_bytes: int
    evictions: int
    tenant_bytes: dict[str, int]
    tenant_quota_bytes: int | None
    persists_in_flight: int
    gate_in_force: str
    scorers: dict[str, float] = Field(description="registered scorers and their weights")
    admission: RAMAdmissionStats
    policy: RAMPolicyStats
    disk: DiskTierStats | None


class RamStatsResponse(BaseModel):
    model_config = _OUT

    action: Literal["ram_stats"]
    stats: RAMTierStats


class AdvisoryResponse(BaseModel):
    model_config = _OUT

    action: Literal["advisory"]
    tenant: str
    session_id: str
    finished_at: float = Field(description="when that request finished (Unix time)")
    kvci: dict[str, Any] = Field(
        description="that request's kv_transfer_params.kvci: recommendation, advisory, trigger, "
        "tier, checkpoint_id, hit_tokens, hit_tier, cache_gate, persist, not_kept (or error)")


class ResetResponse(BaseModel):
    model_config = _OUT

    action: Literal["reset"]
    status: Literal["done", "pending"] = Field(
        description="`done`: applied; `pending`: asked, and applied before the engine's next lookup"
    )
    generation: int | None = Field(
        description="the generation KV is keyed in from now on; none while pending")
    ram_checkpoints: int | None = Field(description="RAM checkpoints fenced; none while pending")
    disk_checkpoints: int | None = Field(description="disk checkpoints fenced; none while pending")
    detail: str
    scope: str = Field(description="what a reset covers: kvci's tiers, never vLLM's prefix cache")


class ForgetResponse(BaseModel):
    model_config = _OUT

    action: Literal["forget"]
    tenant: str
    ram_checkpoints: int = Field(description="checkpoints this engine's RAM tier forgot")
    disk_checkpoints: int = Field(description="disk checkpoints forgotten for every node")
    key_destroyed: bool = Field(description="whether key material existed and was destroyed")
    detail: str


KVCheckpointResponse = Annotated[
    RecommendResponse | CheckpointNowResponse | PromoteResponse | ExplainResponse | RamStatsResponse
    | AdvisoryResponse | ResetResponse | ForgetResponse,
    Field(discriminator="action"),
]
RESPONSE_ADAPTER: TypeAdapter[Any] = TypeAdapter(KVCheckpointResponse)


def tool_input_schema(offered: tuple[str, ...] = ACTIONS) -> dict[str, Any]:
    """The request schema of the `offered` actions flattened for the MCP tool: one object whose
    `action` picks the action and whose other properties say which actions take them (agents'
    tool-use APIs refuse a union at the root of a tool schema). The endpoint still enforces each
    action's own model."""
    full = REQUEST_ADAPTER.json_schema()
    defs = dict(full["$defs"])
    properties: dict[str, Any] = {}
    takers: dict[str, list[str]] = {}
    actions: list[str] = []
    for ref in full["oneOf"]:
        variant = defs.pop(ref["$ref"].rsplit("/", 1)[1])
        action = variant["properties"]["action"]["const"]
        if action not in offered:
            continue
        actions.append(action)
        for name, prop in variant["properties"].items():
            if name != "action":
                properties.setdefault(name, dict(prop))
                required = " (required)" if name in variant.get("required", ()) else ""
                takers.setdefault(name, []).append(action + required)
    for name, prop in properties.items():
        note = "action " + ", ".join(takers[name])
        prop["description"] = f"{prop['description']}; {note}" if "description" in prop else note
    action_doc = " | ".join(actions)
    used = _referenced(properties, defs)
    return {"type": "object", "additionalProperties": False, "required": ["action"],
            "properties": {"action": {"type": "string", "enum": actions, "description": action_doc},
                           **properties},
            "$defs": {name: schema for name, schema in defs.items() if name in used}}


def tool_output_schema(offered: tuple[str, ...] = ACTIONS) -> dict[str, Any]:
    """The responses of the `offered` actions."""
    full = RESPONSE_ADAPTER.json_schema(mode="serialization")
    variants = [
        ref
        for ref in full["oneOf"]
        if full["$defs"][ref["$ref"].rsplit("/", 1)[1]]["properties"]["action"]["const"] in offered
    ]
    mapping = {a: r for a, r in full["discriminator"]["mapping"].items() if a in offered}
    used = _referenced(variants, full["$defs"])
    return {"type": "object", "oneOf": variants,
            "discriminator": {**full["discriminator"], "mapping": mapping},
            "$defs": {name: schema for name, schema in full["$defs"].items() if name in used}}


def _referenced(root: Any, defs: dict[str, Any]) -> set[str]:
    """The names of the `$defs` entries `root` refers to, directly or through other entries."""
    found: set[str] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.rsplit("/", 1)[1]
                if name not in found:
                    found.add(name)
                    stack.append(defs.get(name))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found
