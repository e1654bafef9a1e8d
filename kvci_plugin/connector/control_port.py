"""The control surface's port into the scheduler side: what `api.control.ControlTarget` asks.

It runs on the control server's threads, beside vLLM's scheduler thread: what it changes of the
scheduler side is changed under the manager's lock, a forget outside a step's lookup window
(`LookupWindow`), and a reset is only asked for — the scheduler's thread applies it
(`CacheResets`).
"""

from __future__ import annotations

from concurrent.futures import Future

from kvci_plugin.connector.cache_reset import CacheResets
from kvci_plugin.connector.lookup_window import LookupWindow
from kvci_plugin.connector.request_state import RequestStates
from kvci_plugin.policy import (
    AdmissionStats,
    ArmedCheckpoint,
    KeepDecider,
    PressureAwareAdmission,
    arm_binding,
)
from kvci_plugin.request.params import KVCIRequestParams
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.outcomes import ForgetOutcome, ResetOutcome
from kvci_plugin.tiering.types import PageKey
from kvci_plugin.worthiness import PublishedVerdict, PublishedVerdicts


class SchedulerControl:
    """The scheduler side as the control plane sees it (`ControlTarget`)."""

    def __init__(self, *, manager: TieredCheckpointManager, decider: KeepDecider,
                 bar: PressureAwareAdmission[PageKey] | None, tenants: TenantResolver,
                 requests: RequestStates, verdicts: PublishedVerdicts, window: LookupWindow,
                 resets: CacheResets) -> None:
        self.manager = manager
        self._decider = decider
        self._bar = bar
        self._tenants = tenants
        self._requests = requests
        self._verdicts = verdicts
        self._window = window
        self._resets = resets

    @property
    def ram_threshold(self) -> float:
        """The RAM threshold requests are scored at now."""
        return self._decider.ram_threshold

    def admission_stats(self) -> AdmissionStats | None:
        """The moving RAM bar's threshold and counts; None when the bar is fixed. Each figure is
        read whole, and the snapshot may straddle one update of the scheduler thread's."""
        return self._bar.stats() if self._bar is not None else None

    def resolve_tenant(self, tenant: str | None, session_token: str | None) -> str:
        """The caller's tenant (a verified session wins); ParamsError if refused."""
        return self._tenants.resolve(KVCIRequestParams(tenant=tenant, session_token=session_token))

    def arm_checkpoint(self, tenant: str, session_id: str, *, trigger: str, persist: bool,
                       session_token: str | None) -> None:
        """Keep the KV of this session's next finished request."""
        with self.manager.lock:
            self._decider.arm(tenant, session_id, ArmedCheckpoint(
                trigger=trigger, persist=persist, bound_to=arm_binding(session_token)))

    def latest_verdict(self, tenant: str, session_id: str, *,
                       verified: bool) -> PublishedVerdict | None:
        """What this session's latest finished request was told."""
        return self._verdicts.latest(tenant, session_id, verified=verified)

    def forget_tenant(self, tenant: str, session_token: str | None,
                      delegation_tokens: tuple[str, ...]) -> ForgetOutcome:
        """Crypto-erase ``tenant`` once its verified credential with the forget scope allows it
        (ForgetRefusedError otherwise)."""
        self._tenants.authorize_forget(tenant, session_token, delegation_tokens)
        return self.manager.forget_disk(tenant, self._window.run(lambda: self._forget(tenant)))

    def _forget(self, tenant: str) -> ForgetOutcome:
        """Under the manager's lock, outside a lookup window: the tiers forget the tenant, and its
        requests in flight were keyed before it — they neither hit again (after a preemption)
        nor keep. Checkpoints it armed are dropped."""
        outcome = self.manager.forget_ram(tenant)
        self._requests.erase(tenant)
        self._decider.disarm(tenant)
        return outcome

    def ask_reset(self) -> Future[ResetOutcome]:
        """A cache reset, applied by the scheduler's thread at its next hook — before the next
        lookup, and after the jobs of a step already planned."""
        return self._resets.ask()
