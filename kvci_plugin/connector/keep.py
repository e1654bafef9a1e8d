"""The end of a request on the scheduler side: what the keep decision reads, and its plan
carried out.

vLLM's `request_finished_all_groups` ends here (``Keeper.finished``): the request's state is
taken, its lookup accounted, the finished request described as `KeepDecider` reads it
(``finished_request``), the decision made (the same `KeepDecider` the simulator replays), its
plan carried out by the manager (``keep``: the leading blocks into the RAM tier, a durable copy
if asked), the decider taught what became of it, and the reply composed (`reply.py`). A keep
whose copy is queued holds the request's blocks until the workers report it done
(``stores_done``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvci_plugin.connector import counters as c
from kvci_plugin.connector.auto_retentions import AutoRetentions
from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.groups import GroupLayout
from kvci_plugin.connector.metadata import KVCIWorkerMetadata
from kvci_plugin.connector.mover import ConnectorMover
from kvci_plugin.connector.reply import compose_reply, failure_reply, publish
from kvci_plugin.connector.request_state import RequestState, RequestStates, pages
from kvci_plugin.connector.step_stats import StepStats
from kvci_plugin.connector.window_stages import WindowStages
from kvci_plugin.policy import FinishedRequest, KeepDecider, KeepOutcome, KeepPlan, session_key
from kvci_plugin.request.tool_calls import ToolCallMarkers
from kvci_plugin.tiering.load_or_recompute import LoadOrRecompute
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.outcomes import CheckpointOutcome, RetainAsk
from kvci_plugin.tiering.types import PageKey
from kvci_plugin.worthiness import CheckpointObservation, PublishedVerdicts, RequestHistory

FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")

Finish = tuple[bool, dict[str, Any] | None]  # (hold the blocks for a queued copy, the reply)


class Keeper:
    """Decides and keeps what a finished request leaves (scheduler thread, manager's lock)."""

    def __init__(self, *, config: KVCIConfig, requests: RequestStates,
                 manager: TieredCheckpointManager, mover: ConnectorMover, decider: KeepDecider,
                 history: RequestHistory, load_rule: LoadOrRecompute, verdicts: PublishedVerdicts,
                 stats: StepStats, layout: GroupLayout, events: Any,
                 windows: WindowStages | None = None,
                 markers: ToolCallMarkers | None = None) -> None:
        self._config = config
        self._requests = requests
        self._manager = manager
        self._mover = mover
        self._decider = decider
        self._history = history
        self._load_rule = load_rule
        self._verdicts = verdicts
        self._stats = stats
        self._layout = layout
        self._events = events
        self._windows = windows  # a sliding-window group's windows staged during prefill
        self._markers = markers  # the model's tool-call markers: the engine's word on a turn
        self.store_of: dict[str, str] = {}  # request id -> checkpoint id of its pending store
        self.auto = AutoRetentions()  # the engine's own retentions, for their hits and expiries

    def finished(self, request: Any, group_block_ids: Sequence[list[int]]) -> Finish:
        """The request finished: decide, keep, teach, reply."""
        st = self._requests.pop(request.request_id)
        if (st is None or st.first_scheduled is None) and request.status.name not in FINISHED_OK:
            # Aborted before it ran (e.g. sent while generation was paused): it built no KV and
            # used none, so it leaves no trace — no lookup, session turn, armed checkpoint
            # consumed or lesson for the bar.
            return False, None
        st = st or self._requests.fresh(request)
        if st.generation != self._requests.generation:
            st.keys = None  # keyed before a cache reset: its KV is neither matched nor kept
        if st.error is not None:
            self._stats.count(c.PARAMS_ERRORS)
            return False, {"kvci": {"error": st.error}}
        if st.keys is not None:
            self._stats.count(c.LOOKUPS)
            self._decider.looked_up(st.ext_tokens > 0)
        try:
            finished = self.finished_request(request, st, group_block_ids)
        except ValueError as exc:
            self._stats.count(c.PARAMS_ERRORS)
            error = {"error": f"invalid observation: {exc}"}
            return False, {"kvci": publish(self._verdicts, st, error)}
        plan = self._decider.decide(finished)
        self._count_plan(plan)
        outcome = None
        if plan.trigger is not None and finished.prompt_keys is not None:
            outcome = self.keep(request, st, plan, group_block_ids)
        self._decider.learn(plan, None if outcome is None else KeepOutcome(
            kept=outcome.checkpoint_id is not None, evicted_pages=outcome.evicted_pages))
        return outcome is not None and outcome.pending, self._reply(st, plan, outcome)

    def failed(self, request: Any) -> Finish:
        """Deciding failed (contained): nothing new is kept, and the client is told so; blocks a
        queued store will read are still held until it has (else vLLM could hand them to
        another request before the copy)."""
        req_id = request.request_id
        self._requests.pop(req_id)
        for job in self._mover.stores:
            if job.req_id == req_id:  # queued before the failure: it commits when copied
                self.store_of.setdefault(req_id, job.checkpoint_id)
        return req_id in self.store_of, failure_reply(request)

    def finished_request(self, request: Any, st: RequestState,
                         group_block_ids: Sequence[list[int]]) -> FinishedRequest:
        """What the keep decision reads of a finished request; ValueError for a bad observation."""
        p = st.params
        explicit = p.explicit_trigger if p else None
        if explicit is None and st.retain is not None and st.retain.word == "kv_hints":
            explicit = (p.trigger if p else None) or "agent"  # a hint's retention keeps, as retain
        client = CheckpointObservation.from_inputs(
            p.observation if p else None, p.evidence_bundle if p else None,
            p.context_bundle if p else None)
        history = None
        if st.keys is not None:
            session = session_key(st.tenant, st.session_id) if st.session_id is not None else None
            history = self._history.measure(session, st.keys, st.hit_key)
        # The prompt's keys when this request's KV may be kept: it is keyable and ended normally.
        prompt_keys = st.keys if request.status.name in FINISHED_OK else None
        blocks = 0 if prompt_keys is None else min(
            request.num_computed_tokens // self._requests.block_size,
            *(len(ids) for ids in group_block_ids))
        return FinishedRequest(
            tenant=st.tenant, observation=client, session_id=st.session_id,
            explicit_trigger=explicit, persist=bool(p and p.persist),
            opted_out=bool(p and p.opted_out), session_token=p.session_token if p else None,
            delegation_tokens=tuple(p.delegation_tokens) if p else (),
            context_tokens=request.num_prompt_tokens, output_tokens=request.num_output_tokens,
            cached_tokens=min(st.local_tokens + st.ext_tokens, request.num_prompt_tokens),
            # What rebuilding the whole prompt would take at this engine's measured prefill rate
            # (from requests that loaded nothing), not this request's own time scaled up: when
            # most of a prompt hit, that multiplies a step's fixed cost by the prompt over a few
            # tokens.
            rebuild_s=self._load_rule.recompute_s(st.prompt_tokens),
            history=history, prompt_keys=prompt_keys, blocks=blocks,
            tool_call=self._tool_call(request, st))

    def _tool_call(self, request: Any, st: RequestState) -> bool | None:
        """Whether the turn ended on a tool call, from its output ids (None: not known)."""
        if self._markers is None:
            return None
        constrained = bool(getattr(request, "use_structured_output", False))
        word = self._markers.word(request.output_token_ids, constrained=constrained)
        if word:
            self._stats.count(c.TOOL_CALLS_DETECTED)
        st.tool_call = word
        return word

    def keep(self, request: Any, st: RequestState, plan: KeepPlan,
             group_block_ids: Sequence[list[int]]) -> CheckpointOutcome:
        """Carry ``plan`` out: its leading blocks into the RAM tier, a durable copy if asked."""
        prompt_keys, n_full = st.keys, plan.blocks
        assert prompt_keys is not None and plan.trigger is not None
        # Past the prompt the chain runs on into the output, keyed as the prompt was.
        bs = self._requests.block_size
        chain = (prompt_keys[:n_full] if n_full <= len(prompt_keys) else
                 self._requests.keys_for(request.all_token_ids[: n_full * bs], st.key_tenant))
        group_keys = self._layout.group_keys(chain) if self._layout.hybrid else [chain]
        kept = pages(group_keys, group_block_ids, 0, n_full)
        keys = [key for key, _, _ in kept]
        staged = (self._windows.windows(request.request_id, n_full)
                  if self._windows is not None else set())
        if staged.difference(keys):  # block by block, as the end's pages are
            keys = with_windows(group_keys, n_full, set(keys) | staged)
        if self._events is not None:
            self._events.describe(request, group_keys, n_full, keys)
        outcome = self._manager.checkpoint_now(
            tenant=st.tenant, keys=keys, trigger=plan.trigger, recommendation=plan.recommendation,
            source=(request.request_id, {key: (b, g) for key, b, g in kept}),
            source_ids=st.params.source_ids if st.params else (), persist=plan.persist,
            session_token=plan.session_token, delegation_tokens=plan.delegation_tokens,
            offer=plan.offer, retain=st.retain or _automatic(plan, st), pool=st.pool,
            erasure_epoch=st.erasure_epoch, tool_call=_tool_call_word(st, plan))
        self.count_outcome(outcome)
        if (st.retain is None and outcome.retain is not None
                and outcome.retain.status == "retained" and outcome.checkpoint_id is not None
                and plan.retain_s is not None):
            self._stats.count(c.RETENTIONS_AUTOMATIC)
            self.auto.granted(outcome.checkpoint_id, st.tenant, plan.retain_session,
                              chain[:n_full], plan.retain_s)
        if outcome.pending:
            self.store_of[request.request_id] = outcome.checkpoint_id
        return outcome

    def _reply(self, st: RequestState, plan: KeepPlan,
               outcome: CheckpointOutcome | None) -> dict[str, Any] | None:
        if st.params is None and st.retain is None:
            return None  # nothing asked, nothing said: the advisory channel stays silent
        reply = compose_reply(st, plan, outcome, max_retain_s=self._config.max_retain_s,
                              block_size=self._requests.block_size, stats=self._stats.current)
        return {"kvci": publish(self._verdicts, st, reply)}

    def _count_plan(self, plan: KeepPlan) -> None:
        self._stats.count(c.RECOMMENDATIONS + plan.recommendation.tier.value)
        if plan.opted_out:
            self._stats.count(c.STORE_OPTED_OUT)
        elif plan.gate is not None and not plan.gate.allow:
            self._stats.count(c.CACHE_GATE_PREFIX_KEEPS if plan.churn_keep else c.CACHE_GATE_PAUSES)

    def count_outcome(self, outcome: CheckpointOutcome) -> None:
        if outcome.checkpoint_id is None:
            self._stats.count(c.STORE_DECLINED)
            return
        self._stats.count(c.CHECKPOINTS_RAM)
        self._stats.count(c.EVICTED_CHECKPOINTS, len(outcome.evicted))
        if outcome.persist is not None:
            p = outcome.persist
            if p.status == "refused":
                check = p.decision.failed_check if p.decision is not None else "no_disk_tier"
                self._stats.count(f"{c.GATE_REFUSALS}{check}")
            count_persist(self._stats, p)

    def stores_done(self, output: Any, report: KVCIWorkerMetadata | None) -> None:
        """The workers finished the copies of these requests' keeps (or one rank failed)."""
        failed = set(report.failed_stores) if report is not None else set()
        for req_id in output.finished_sending or ():
            cid = self.store_of.pop(req_id, None)
            if cid is not None:
                # A store that failed on any rank is not loadable: its slots hold nothing.
                count_persist(self._stats, self._manager.on_stored(cid, ok=req_id not in failed))


def with_windows(group_keys: list[list[PageKey]], n_blocks: int,
                 held: set[PageKey]) -> list[PageKey]:
    """The keys of ``held`` among the pages of blocks [0, n_blocks), block by block (a
    checkpoint's pages: the end's and the windows staged during prefill)."""
    return [group_keys[g][i] for i in range(n_blocks) for g in range(len(group_keys))
            if group_keys[g][i] in held]


def count_persist(stats: c.Counts, outcome: Any) -> None:
    """A persist that started (or ended) now: counted once it is durable, or failed."""
    if outcome is not None and outcome.status == "persisted":
        stats.count(c.PERSISTED_CHECKPOINTS)
    elif outcome is not None and outcome.status == "failed" and outcome.decision is not None:
        stats.count(c.PERSIST_FAILURES)  # permitted, and not written


def _tool_call_word(st: RequestState, plan: KeepPlan) -> dict[str, bool | None] | None:
    """What `explain` says of the turn's end: the engine's word and the one in force (None:
    neither the engine nor the client said anything)."""
    pending = plan.observation.tool_call_pending
    if st.tool_call is None and pending is None:
        return None
    return {"detected": st.tool_call, "pending": pending}


def _automatic(plan: KeepPlan, st: RequestState) -> RetainAsk | None:
    """The decider's automatic retention of a turn that ended on a tool call (a client's own
    ``kvci.retain`` replaces it): within the same bounds, refused past the tenant's share."""
    if plan.retain_s is None:
        return None
    return RetainAsk(plan.retain_s, plan.retain_session, word="engine",
                     session_by=st.session.by if st.session is not None else "client")
