"""Per-request state on the scheduler side, and the keys a request's KV is found and kept under.

A request's state is made at its first hook (its `kvci` parameters parsed once, its tenant
resolved, its prefix keys computed with the native op) and lives until it finishes. Keys are
made in the tiers' generation: a cache reset or a forget leaves the requests in flight keyed
before it, so they neither hit nor keep (``RequestState.generation``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.groups import GroupLayout
from kvci_plugin.connector.retain import hint_ask, retain_ask
from kvci_plugin.ops import prefix_key_list
from kvci_plugin.request.hints import read_kv_hints
from kvci_plugin.request.params import KVCIRequestParams, ParamsError, parse_request_params
from kvci_plugin.request.session import RequestSession, request_session
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.tiering.keys import generation_namespace
from kvci_plugin.tiering.outcomes import RetainAsk
from kvci_plugin.tiering.ram.room import DECLARED_POOL
from kvci_plugin.tiering.types import PageKey

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0  # vLLM's BlockPool hands out block 0 as its null block (never holds KV)
ERASED = -1  # the generation of a request whose tenant was forgotten while it ran


class HitTier(str, Enum):
    """The tier a request's hit is loaded from; formatted as its value (a stats name's label)."""

    RAM = "ram"
    DISK = "disk"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass
class RequestState:
    params: KVCIRequestParams | None
    error: str | None
    tenant: str
    key_tenant: str
    keys: list[PageKey] | None  # None: this request is never matched or stored (not keyable)
    pool: str  # the fair share its keeps count against (ram_room)
    group_keys: list[list[PageKey]] | None = None  # each KV cache group's, made when first needed
    generation: int = 0  # its keys' generation: stale after a reset, ERASED after a forget
    local_tokens: int = 0
    ext_tokens: int = 0
    hit_tier: HitTier | None = None
    disk_sync: bool = False  # its disk hit is read in its first step (nothing else to run)
    hit_key: PageKey | None = None
    prompt_tokens: int = 0
    first_scheduled: float | None = None
    prompt_done: bool = False
    prefill_s: float | None = None
    scheduled_tokens: int = 0  # counted until its prefill is timed (``scheduled``)
    lookup_learned: bool = False  # the tier policy (and the bar) learned this request's lookup
    resident: int | None = None  # the RAM run its lookup found; the bar learns it once it runs
    disk_declined: bool = False  # counted once a request, however often vLLM asks
    retain: RetainAsk | None = None  # the client's kvci.retain, else its KV hints' order
    tool_call: bool | None = None  # the engine's word on its turn's end, once it finished
    session: RequestSession | None = None  # the client's session, else vLLM's Request.session_id
    ends_retention: bool = False  # its session's retentions end once it is scheduled
    # The erasure epoch when its KV was computed: a forget after it refuses the keep (#46).
    erasure_epoch: int = 0

    @property
    def session_id(self) -> str | None:
        return None if self.session is None else self.session.session_id

    @property
    def settled(self) -> bool:
        """Whether its steps have nothing left to teach (``learns_lookup`` and ``scheduled``
        would do nothing, and no retention waits on it): a decoding request, most of a batch."""
        return (self.prefill_s is not None and not self.ends_retention
                and (self.lookup_learned or self.resident is None))

    def learns_lookup(self) -> bool:
        """Whether the tier policy (and the bar) learn this request's lookup now: once a request,
        though vLLM may look it up again (after a preemption), and only once it runs — one
        aborted before it ran leaves no trace."""
        if self.lookup_learned or self.resident is None:
            return False
        self.lookup_learned = True
        return True

    def scheduled(self, n: int, now: float, block_size: int) -> tuple[int, float] | None:
        """vLLM scheduled ``n`` of its tokens in the step built ``now``; a recompute-rate sample
        (tokens computed, seconds) once the forward that completed its prompt has run."""
        sample = None
        if self.prompt_done and self.prefill_s is None:
            # The step after the one that completed the prompt: that forward has run.
            self.prefill_s = now - (self.first_scheduled or now)
            computed = self.prompt_tokens - self.local_tokens
            if self.ext_tokens == 0 and computed >= block_size:  # a recompute rate
                sample = (computed, self.prefill_s)
        if self.first_scheduled is None:
            self.first_scheduled = now
        self.scheduled_tokens += n
        if self.local_tokens + self.ext_tokens + self.scheduled_tokens >= self.prompt_tokens:
            self.prompt_done = True
        return sample


class RequestStates:
    """Every request in flight, by id, and how its keys are made (scheduler thread)."""

    def __init__(self, *, config: KVCIConfig, block_size: int, layout: GroupLayout,
                 namespace: bytes, secret: bytes, tenants: TenantResolver,
                 generation: int, erasure_epoch: Callable[[], int]) -> None:
        self.config = config
        self._erasure_epoch = erasure_epoch  # one attribute read: no catalog call per request
        self.block_size = block_size
        self.layout = layout
        self.tenants = tenants
        self._base_namespace = namespace
        self._secret = secret
        self._reqs: dict[str, RequestState] = {}
        self.generation = generation
        self.namespace = generation_namespace(namespace, generation)

    def rekey(self, generation: int) -> None:
        """Keys are made in ``generation`` from now on (a reset, or a disk tier attached)."""
        self.generation = generation
        self.namespace = generation_namespace(self._base_namespace, generation)

    def get(self, req_id: str) -> RequestState | None:
        return self._reqs.get(req_id)

    def pop(self, req_id: str) -> RequestState | None:
        return self._reqs.pop(req_id, None)

    def only(self, req_id: str) -> bool:
        """Whether ``req_id`` is the one request in flight."""
        return self._reqs.keys() == {req_id}

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._reqs.values()))

    def erase(self, tenant: str) -> None:
        """``tenant`` was forgotten: its requests in flight neither hit again nor keep."""
        for st in self:
            if st.tenant == tenant:
                st.generation = ERASED

    def state(self, request: Any) -> RequestState:
        """The request's state, made at its first hook."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = self.fresh(request)
        return st

    def fresh(self, request: Any) -> RequestState:
        """A new state for ``request``, not kept (``state`` keeps the one it makes)."""
        params: KVCIRequestParams | None = None
        error = retain = session = None
        try:
            params = parse_request_params(request.kv_transfer_params, self.config.max_params_bytes)
            session = request_session(params, request)
            retain = retain_ask(params, self.config.max_retain_s, session)
            tenant = self.tenants.resolve(params)
        except ParamsError as exc:
            error, tenant, session = str(exc), self.tenants.default, None
        if error is None and retain is None:
            retain = self.hinted_retain(request, params, session)
        key_tenant = self.key_tenant(tenant, request)
        keys = None
        if error is None and self.keyable(request):
            keys = self.keys_for(request.prompt_token_ids, key_tenant)
        # A verified tenant has a fair share of its own; declared ones share one (ram_room).
        verified = error is None and params is not None and params.session_token is not None
        return RequestState(
            params=params, error=error, tenant=tenant, key_tenant=key_tenant, keys=keys,
            pool=tenant if verified else DECLARED_POOL, generation=self.generation,
            prompt_tokens=request.num_prompt_tokens, retain=retain, session=session,
            ends_retention=session is not None,
            erasure_epoch=self._erasure_epoch())

    def hinted_retain(self, request: Any, params: KVCIRequestParams | None,
                      session: RequestSession | None) -> RetainAsk | None:
        """The retention the request's KV hints (vLLM's ``Request.kv_hints``) order, when its
        client ordered none; what is ignored is said on a debug line, never a failed request."""
        ask, problems = hint_ask(read_kv_hints(request), params, self.config.max_retain_s, session)
        if problems:
            logger.debug("kvci: request %s: %s", request.request_id, "; ".join(problems))
        return ask

    @staticmethod
    def key_tenant(tenant: str, request: Any) -> str:
        """LoRA adapter and cache_salt change the KV, so they are part of who may share it."""
        lora = getattr(request, "lora_request", None)
        lora_name = getattr(lora, "lora_name", "") if lora is not None else ""
        salt = getattr(request, "cache_salt", None) or ""
        return "\0".join([tenant, "lora=" + lora_name, "salt=" + salt])

    @staticmethod
    def keyable(request: Any) -> bool:
        """Whether kvci can key ``request``. Prompt-embeds requests carry placeholder token ids,
        and multimodal features are not keyed: either would let different KV share a key."""
        return (getattr(request, "prompt_embeds", None) is None
                and not getattr(request, "mm_features", None)
                and request.prompt_token_ids is not None)

    def keys_for(self, token_ids: Sequence[int], key_tenant: str) -> list[PageKey]:
        """The keys of the full blocks of ``token_ids`` (the kernel leaves a partial one out)."""
        if len(token_ids) < self.block_size:
            return []
        return prefix_key_list(token_ids, self.block_size, self.namespace, key_tenant, self._secret)

    def group_keys(self, st: RequestState) -> list[list[PageKey]]:
        """Each KV cache group's keys of the request's prompt (one list without groups)."""
        assert st.keys is not None
        if st.group_keys is None:
            st.group_keys = self.layout.group_keys(st.keys) if self.layout.hybrid else [st.keys]
        return st.group_keys


def pages(group_keys: list[list[PageKey]], group_block_ids: Sequence[Sequence[int]],
          first: int, last: int) -> list[tuple[PageKey, int, int]]:
    """(key, block id, group) of every page of blocks [first, last) that holds KV, block by
    block. A sliding-window group's blocks out of its window are vLLM's null block: the
    forward never reads them, and nothing is copied from or into them."""
    return [(group_keys[g][i], ids[i], g) for i in range(first, last)
            for g, ids in enumerate(group_block_ids) if ids[i] != NULL_BLOCK_ID]
