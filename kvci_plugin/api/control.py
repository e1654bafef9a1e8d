"""ControlPlane: the `graph_kv_checkpoint` actions over the engine's checkpoint manager:
`recommend`, `checkpoint_now`, `promote`, `explain` and `ram_stats`, `advisory`, which hands a
streaming client the verdict its response could not carry, `reset`, the operator's cache reset of
kvci's tiers, and `forget`.

Each call comes with the role its bearer token proved (`kvci_plugin.api.roles`): `reset` is the
operator's; with the tenant token `explain` and `ram_stats` act within the caller's own tenant.

It runs on the control server's threads, beside vLLM's scheduler thread: everything it changes
goes through `TieredCheckpointManager` (which takes its lock) or through `arm_checkpoint`, and
only `reset` waits on the engine (up to its `wait_s`, for the scheduler thread to apply it). A
persist queued by `promote` reaches the workers at the engine's next step. `recommend` and
`checkpoint_now` score at the engine's RAM admission bar as it stands, so their advisory is the
engine's verdict for the same observation.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import Any, Protocol

from pydantic import ValidationError

from kvci_plugin.api.errors import ControlError, ErrorCode
from kvci_plugin.api.roles import OPERATOR_ACTIONS, Role
from kvci_plugin.api.schema import (
    RESET_SCOPE,
    AdvisoryRequest,
    AdvisoryResponse,
    CheckpointExplanation,
    CheckpointNowRequest,
    CheckpointNowResponse,
    ExplainRequest,
    ExplainResponse,
    ForgetRequest,
    ForgetResponse,
    PromoteRequest,
    PromoteResponse,
    RAMAdmissionStats,
    RamStatsRequest,
    RamStatsResponse,
    RAMTierStats,
    RecommendRequest,
    RecommendResponse,
    ResetRequest,
    ResetResponse,
)
from kvci_plugin.governance import ForgetRefusedError
from kvci_plugin.policy.admission import AdmissionStats
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.outcomes import ForgetOutcome, ResetOutcome
from kvci_plugin.tiering.types import (
    CheckpointFencedError,
    CheckpointForgottenError,
    CheckpointNotFoundError,
    TenantMismatchError,
)
from kvci_plugin.worthiness import (
    CheckpointObservation,
    CheckpointRecommendation,
    PublishedVerdict,
    render_advisory,
)

ControlRequest = (
    RecommendRequest | CheckpointNowRequest | PromoteRequest | ExplainRequest | RamStatsRequest
    | AdvisoryRequest | ResetRequest | ForgetRequest
)
ControlResponse = (
    RecommendResponse | CheckpointNowResponse | PromoteResponse | ExplainResponse | RamStatsResponse
    | AdvisoryResponse | ResetResponse | ForgetResponse
)


class ControlTarget(Protocol):
    """What the control plane needs from the engine's scheduler side."""

    @property
    def manager(self) -> TieredCheckpointManager: ...

    @property
    def ram_threshold(self) -> float:
        """The RAM threshold the engine scores a finished request at now (its admission bar)."""
        ...

    def admission_stats(self) -> AdmissionStats | None:
        """The moving RAM bar's threshold and counts; None when the bar is fixed."""
        ...

    def resolve_tenant(self, tenant: str | None, session_token: str | None) -> str:
        """The tenant a caller acts in: the verified session's, else the declared one, else the
        default. Raises ValueError (with a message safe to return) when the credential does not
        verify or disagrees with the declared tenant."""
        ...

    def arm_checkpoint(self, tenant: str, session_id: str, *, trigger: str, persist: bool,
                       session_token: str | None) -> None:
        """Keep the KV of this session's next finished request with this trigger, if the
        arming caller sends it: with ``session_token`` (the caller's credential, or None) only
        a request carrying the same credential spends the arm. The arm keeps a digest of it,
        never the credential: that request persists with its own credential only."""
        ...

    def latest_verdict(
        self, tenant: str, session_id: str, *, verified: bool
    ) -> PublishedVerdict | None:
        """What this tenant's session's latest finished request was told; None if nothing, or if
        it was published under a verified credential and the caller (``verified``) has none."""
        ...

    def forget_tenant(self, tenant: str, session_token: str | None,
                      delegation_tokens: tuple[str, ...]) -> ForgetOutcome:
        """Crypto-erase ``tenant`` (`TieredCheckpointManager.forget`) once a verified credential
        of that tenant with the forget scope allows it; raises ForgetRefusedError (its message
        safe to return) otherwise."""
        ...

    def ask_reset(self) -> Future[ResetOutcome]:
        """A cache reset of kvci's tiers (`TieredCheckpointManager.reset`), applied by the
        scheduler's thread at its next hook, before its next lookup; asked again before then, the
        same future. It raises when the reset failed: the disk tier is then not loaded from until
        a reset succeeds."""
        ...


class ControlPlane:
    def __init__(self, target: ControlTarget) -> None:
        self._target = target

    @property
    def manager(self) -> TieredCheckpointManager:
        return self._target.manager

    def handle(self, request: ControlRequest, role: Role) -> ControlResponse:
        """The action's response, for a caller in `role`; ControlError when refused."""
        if request.action in OPERATOR_ACTIONS and role is not Role.OPERATOR:
            raise ControlError(
                ErrorCode.OPERATOR_REQUIRED,
                f"{request.action} is an operator action: it needs the operator token",
            )
        if isinstance(request, RecommendRequest):
            return self.recommend(request)
        if isinstance(request, CheckpointNowRequest):
            return self.checkpoint_now(request)
        if isinstance(request, PromoteRequest):
            return self.promote(request)
        if isinstance(request, ExplainRequest):
            return self.explain(request, role)
        if isinstance(request, RamStatsRequest):
            return self.ram_stats(request, role)
        if isinstance(request, AdvisoryRequest):
            return self.advisory(request)
        if isinstance(request, ResetRequest):
            return self.reset(request)
        if isinstance(request, ForgetRequest):
            return self.forget(request)
        raise TypeError(f"not a control request: {type(request).__name__}")

    # ---- actions --------------------------------------------------------------------------------

    def recommend(self, request: RecommendRequest) -> RecommendResponse:
        rec = self._recommend(request)
        return RecommendResponse(
            action="recommend", recommendation=rec, advisory=render_advisory(rec)
        )

    def checkpoint_now(self, request: CheckpointNowRequest) -> CheckpointNowResponse:
        tenant = self._verified_tenant(request.tenant, request.session_token)
        rec = self._recommend(request)
        # The caller's credential only binds the arm (its digest): the arm holds none, so the
        # request that spends it persists with its own credential, or a promote with yours.
        self._target.arm_checkpoint(
            tenant, request.session_id, trigger=request.trigger, persist=request.persist,
            session_token=request.session_token)
        detail = (
            f"armed: the next request of session {request.session_id!r} to finish keeps its KV "
            "in RAM"
            + (
                " and asks the eligibility gate for a disk copy with that request's "
                "own credential (the arm holds none; or promote the checkpoint with "
                "yours)"
                if request.persist
                else ""
            )
        )
        return CheckpointNowResponse(
            action="checkpoint_now", armed=True, tenant=tenant, session_id=request.session_id,
            trigger=request.trigger, persist=request.persist, detail=detail, recommendation=rec,
            advisory=render_advisory(rec))

    def promote(self, request: PromoteRequest) -> PromoteResponse:
        # Authority is derived by the eligibility gate at the write, from the credential as it
        # stands now. A credential that does not verify is not an error here: the gate refuses
        # and the refusal is recorded on the checkpoint for `explain`.
        try:
            tenant = self._target.resolve_tenant(request.tenant, request.session_token)
        except ValueError:
            tenant = self._verified_tenant(request.tenant, None)
        try:
            outcome = self.manager.promote(
                request.checkpoint_id, tenant=tenant, trigger=request.trigger,
                session_token=request.session_token,
                delegation_tokens=tuple(request.delegation_tokens))
        except (CheckpointNotFoundError, TenantMismatchError):
            raise _not_found(request.checkpoint_id) from None
        return PromoteResponse(action="promote", checkpoint_id=outcome.checkpoint_id,
                               status=outcome.status, reason=outcome.reason,
                               decision=outcome.decision)

    def explain(self, request: ExplainRequest, role: Role) -> ExplainResponse:
        tenant = self._caller_tenant(role, request.tenant, request.session_token)
        try:
            raw = self.manager.explain(request.checkpoint_id, tenant)
        except CheckpointFencedError as exc:
            # Raised to the owning tenant, or to an explain naming none: its message names no
            # tenant.
            raise ControlError(ErrorCode.CHECKPOINT_FENCED, str(exc)) from None
        except CheckpointForgottenError as exc:
            raise ControlError(ErrorCode.CHECKPOINT_FORGOTTEN, str(exc)) from None
        except (CheckpointNotFoundError, TenantMismatchError):
            raise _not_found(request.checkpoint_id) from None
        # Through JSON: the stored recommendation and decision are JSON dumps of strict models.
        explanation = CheckpointExplanation.model_validate_json(json.dumps(raw))
        return ExplainResponse(action="explain", explanation=explanation)

    def ram_stats(self, request: RamStatsRequest, role: Role) -> RamStatsResponse:
        tenant = self._caller_tenant(role, request.tenant, request.session_token)
        raw = self.manager.ram_stats()
        if tenant is not None:
            raw = _own_figures(raw, tenant)
        stats = RAMTierStats.model_validate({**raw, "admission": self._admission()})
        return RamStatsResponse(action="ram_stats", stats=stats)

    def advisory(self, request: AdvisoryRequest) -> AdvisoryResponse:
        tenant = self._verified_tenant(request.tenant, request.session_token)
        # A session_token that reaches here verified (_verified_tenant refuses any other).
        verdict = self._target.latest_verdict(tenant, request.session_id,
                                              verified=request.session_token is not None)
        if verdict is None:
            # One answer for "no such session" and "another tenant's session": no existence oracle.
            raise ControlError(
                ErrorCode.NO_ADVISORY,
                f"no finished request of session {request.session_id!r} for this caller",
            )
        return AdvisoryResponse(action="advisory", tenant=tenant, session_id=request.session_id,
                                finished_at=verdict.finished_at, kvci=verdict.kvci)

    def reset(self, request: ResetRequest) -> ResetResponse:
        # An operator action: `handle` let it through for the operator token only.
        asked = self._target.ask_reset()
        wait_for([asked], timeout=request.wait_s)
        if not asked.done():
            return ResetResponse(
                action="reset", status="pending", generation=None, ram_checkpoints=None,
                disk_checkpoints=None, scope=RESET_SCOPE,
                detail="asked: the engine applies it before its next lookup (an idle engine, when "
                       "its next request arrives), so no KV from before it is loaded after it; a "
                       "reset asked again until then is this same one")
        disk = self.manager.disk is not None
        if asked.cancelled() or asked.exception() is not None:
            # The scheduler logged the failure; its text may name paths or hosts: only its type.
            what = "cancelled" if asked.cancelled() else type(asked.exception()).__name__
            suspended = (" Until a reset succeeds the engine loads nothing from the disk tier."
                         if disk else "")
            raise ControlError(ErrorCode.INTERNAL_ERROR,
                               f"the cache reset failed ({what}); see the engine's log.{suspended} "
                               "Ask again to retry.")
        outcome = asked.result()
        shared = (
            (
                ", nor by any node from the disk tier its catalog shares (another node's RAM tier "
                "needs that node's own reset)"
            )
            if disk
            else ""
        )
        return ResetResponse(
            action="reset", status="done", generation=outcome.generation,
            ram_checkpoints=outcome.ram_checkpoints, disk_checkpoints=outcome.disk_checkpoints,
            scope=RESET_SCOPE,
            detail=f"fenced {outcome.ram_checkpoints} RAM and {outcome.disk_checkpoints} disk "
                   f"checkpoints: no KV from before the reset is loaded after it from this node's "
                   f"tiers{shared}; KV is keyed in generation {outcome.generation} from now on")

    def forget(self, request: ForgetRequest) -> ForgetResponse:
        try:
            outcome = self._target.forget_tenant(request.tenant, request.session_token,
                                                 tuple(request.delegation_tokens))
        except ForgetRefusedError as exc:
            raise ControlError(ErrorCode.CREDENTIAL_REFUSED, f"forget refused at {exc}") from None
        shared = (" by any node sharing the disk tier (another node's RAM tier is its own)"
                  if self.manager.disk is not None else "")
        return ForgetResponse(
            action="forget", tenant=request.tenant, ram_checkpoints=outcome.ram_checkpoints,
            disk_checkpoints=outcome.disk_checkpoints, key_destroyed=outcome.key_destroyed,
            detail=f"forgot {outcome.ram_checkpoints} RAM and {outcome.disk_checkpoints} disk "
                   "checkpoints; the tenant's key material was "
                   f"{'destroyed' if outcome.key_destroyed else 'absent'}: none of its KV "
                   f"written before now is loaded again{shared}")

    # ---- helpers --------------------------------------------------------------------------------

    def _recommend(
        self, request: RecommendRequest | CheckpointNowRequest
    ) -> CheckpointRecommendation:
        try:
            observation = CheckpointObservation.from_inputs(
                request.observation_json, request.evidence_bundle_json, request.context_bundle_json)
        except ValidationError as exc:
            raise ControlError(ErrorCode.INVALID_OBSERVATION, _first_error(exc)) from None
        except (TypeError, ValueError) as exc:
            raise ControlError(ErrorCode.INVALID_OBSERVATION, str(exc)) from None
        # At the engine's live bar, so the advisory says what the engine would do now.
        return self.manager.recommend(observation, ram_threshold=self._target.ram_threshold)

    def _admission(self) -> RAMAdmissionStats:
        bar = self._target.admission_stats()
        if bar is None:
            return RAMAdmissionStats(mode="fixed", threshold=self._target.ram_threshold,
                                     wasted_writes=None, missed_reuses=None, paid_writes=None)
        return RAMAdmissionStats(
            mode="pressure",
            threshold=bar.threshold,
            wasted_writes=bar.wasted_writes,
            missed_reuses=bar.missed_reuses,
            paid_writes=bar.paid_writes,
        )

    def _caller_tenant(
        self, role: Role, tenant: str | None, session_token: str | None
    ) -> str | None:
        """The tenant whose records the caller sees: None (every tenant) only for the operator
        naming none. The operator's declared tenant is a filter, taken as named; a tenant's is
        resolved as a request's is (tenancy "verified" takes none)."""
        if role is Role.OPERATOR and session_token is None:
            return tenant
        return self._verified_tenant(tenant, session_token)

    def _verified_tenant(self, tenant: str | None, session_token: str | None) -> str:
        try:
            return self._target.resolve_tenant(tenant, session_token)
        except ValueError as exc:
            raise ControlError(ErrorCode.CREDENTIAL_REFUSED, str(exc)) from None


def _own_figures(stats: dict[str, Any], tenant: str) -> dict[str, Any]:
    """`stats` with every per-tenant table (a `tenant_*` mapping, at any depth: tenant_bytes,
    tenant_retained_bytes, ...) cut to ``tenant``'s row: another tenant's name and figures are not
    this caller's to see."""
    own: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, dict) and key.startswith("tenant_"):
            value = {t: v for t, v in value.items() if t == tenant}
        elif isinstance(value, dict):
            value = _own_figures(value, tenant)
        own[key] = value
    return own


def _not_found(checkpoint_id: str) -> ControlError:
    # One answer for "never held" and "held for another tenant": no existence oracle.
    return ControlError(ErrorCode.CHECKPOINT_NOT_FOUND,
                        f"checkpoint {checkpoint_id!r} is not held for this caller")


def _first_error(exc: ValidationError) -> str:
    errors: list[Any] = exc.errors(include_input=False, include_url=False)
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in errors]
    return "invalid observation: " + "; ".join(parts)
