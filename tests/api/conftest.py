"""Fixtures: a control plane over a real checkpoint manager, without vLLM.

The manager is the real `TieredCheckpointManager` over a real `RAMIndex`, `PagePool` (with
`LocalPageMover`, from tests/support), the disk tier (`DiskTierForTests`, the same) and
`DerivedAuthorityGate` with a real HS256 verifier and SQLite label
catalog. `EngineSide` plays the scheduler's part of `ControlTarget`: the tenant rule of the
connector's `TenantResolver` (verified session wins, a disagreeing declared tenant is refused;
with `tenancy` "verified" no declared tenant is taken),
a record of armed sessions, the forget gate (`governance.authorize_forget`, as the scheduler), the
verdicts finished requests published, the RAM admission bar (a real `PressureAwareAdmission` when
the test gives one, else the advisor's fixed threshold), and a cache reset asked for from the
control surface, applied to the real manager at the scheduler's next hook (`step`): at once by
default, as a busy engine does; when `idle`, only once the test steps it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from support.disk_tier import DiskTierForTests
from support.local_mover import LocalPageMover

from kvci_plugin.api.control import ControlPlane
from kvci_plugin.governance import (
    CatalogLabelResolver,
    CredentialConfig,
    CredentialError,
    CredentialIssuer,
    CredentialVerifier,
    DerivedAuthorityGate,
    SourceLabels,
    authorize_forget,
    write_hmac_key_file,
)
from kvci_plugin.policy.admission import AdmissionStats, PressureAwareAdmission
from kvci_plugin.tiering.blobs.folder import BlobStore
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.outcomes import ForgetOutcome, ResetOutcome
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.ram.pool import PagePool
from kvci_plugin.worthiness import PublishedVerdict, PublishedVerdicts

TENANT = "acme"
SLOT_BYTES = 256
NAMESPACE = bytes(range(32))
PUBLIC_SOURCE = "doc-public"


@dataclass
class EngineSide:
    manager: TieredCheckpointManager
    verifier: CredentialVerifier
    armed: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    bar: PressureAwareAdmission[bytes] | None = None
    verdicts: PublishedVerdicts = field(default_factory=PublishedVerdicts)
    idle: bool = False  # no scheduler hook runs until the test calls `step`
    reset_asked: Future[ResetOutcome] | None = None
    tenancy: str = "declared"  # as the connector's `tenancy`: "verified" takes no declared tenant

    @property
    def ram_threshold(self) -> float:
        return self.bar.threshold if self.bar is not None else self.manager.advisor.ram_threshold

    def admission_stats(self) -> AdmissionStats | None:
        return self.bar.stats() if self.bar is not None else None

    def resolve_tenant(self, tenant: str | None, session_token: str | None) -> str:
        if session_token is None:
            if self.tenancy == "verified":
                raise ValueError("tenancy is \"verified\": only a verified session credential "
                                 "(session_token) sets the tenant")
            return tenant or "default"
        try:
            session = self.verifier.verify_session(session_token)
        except CredentialError as exc:
            raise ValueError(f"session_token refused: {exc}") from None
        if tenant is not None and tenant != session.tenant:
            raise ValueError("declared tenant disagrees with the session credential's tenant")
        return session.tenant

    def arm_checkpoint(self, tenant: str, session_id: str, *, trigger: str, persist: bool,
                       session_token: str | None) -> None:
        self.armed[(tenant, session_id)] = dict(trigger=trigger, persist=persist,
                                                session_token=session_token)

    def latest_verdict(
        self, tenant: str, session_id: str, *, verified: bool
    ) -> PublishedVerdict | None:
        return self.verdicts.latest(tenant, session_id, verified=verified)

    def forget_tenant(self, tenant: str, session_token: str | None,
                      delegation_tokens: tuple[str, ...]) -> ForgetOutcome:
        # As SchedulerControl.forget_tenant: the governance check, then the real manager.
        authorize_forget(self.verifier, tenant, session_token, delegation_tokens)
        return self.manager.forget(tenant)

    def ask_reset(self) -> Future[ResetOutcome]:
        # As SchedulerControl.ask_reset: one future until the scheduler's thread applies it.
        with self.manager.lock:
            if self.reset_asked is None or self.reset_asked.done():
                self.reset_asked = Future()
            asked = self.reset_asked
        if not self.idle:
            self.step()
        return asked

    def step(self) -> None:
        """The scheduler's next hook: it applies an asked reset (its failure goes to the asker)."""
        asked = self.reset_asked
        if asked is None or asked.done():
            return
        try:
            asked.set_result(self.manager.reset())
        except Exception as exc:
            asked.set_exception(exc)


@dataclass
class World:
    root: Path
    issuer: CredentialIssuer
    side: EngineSide
    plane: ControlPlane
    disk: DiskTierForTests

    @property
    def manager(self) -> TieredCheckpointManager:
        return self.side.manager

    def session(self, *, tenant: str = TENANT, **overrides: Any) -> str:
        claims: dict[str, Any] = dict(actor="alice", tenant=tenant, scopes=["kv:persist"],
                                      clearance="INTERNAL", markings=[], regions=["eu"],
                                      policy_version=1)
        claims.update(overrides)
        return self.issuer.issue_session(**claims)

    def moving_bar(self) -> PressureAwareAdmission[bytes]:
        """Give the engine side a pressure-aware RAM bar over this tier, as the connector builds
        one for the system trigger; the test moves it."""
        bar: PressureAwareAdmission[bytes] = PressureAwareAdmission.for_advisor(
            self.manager.advisor, capacity_bytes=self.manager.index.capacity_bytes)
        self.side.bar = bar
        return bar

    def expired_session(self) -> str:
        return self.session(now=time.time() - 7200, ttl_s=60)

    def checkpoint(self, *, tenant: str = TENANT, pages: int = 3,
                   source_ids: Sequence[str] = (PUBLIC_SOURCE,)) -> str:
        """A real RAM checkpoint of random pages, as a finished request would leave one."""
        keys = [os.urandom(16) for _ in range(pages)]
        data = {k: torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8) for k in keys}
        outcome = self.manager.checkpoint_now(tenant=tenant, keys=keys, trigger="user",
                                              recommendation=None, source=data,
                                              source_ids=source_ids)
        assert outcome.checkpoint_id is not None and not outcome.pending
        return outcome.checkpoint_id


def make_world(root: Path) -> World:
    key_file = write_hmac_key_file(root / "hmac.key")
    verifier = CredentialVerifier(CredentialConfig(algorithm="HS256", key_file=key_file))
    labels = CatalogLabelResolver(root / "labels.sqlite")
    labels.set_labels(PUBLIC_SOURCE, SourceLabels(classification="PUBLIC", mandatory_markings=[]))
    gate = DerivedAuthorityGate(verifier, labels, durable_store_region="eu")
    disk = DiskTierForTests(root / "disk", NAMESPACE, 1 << 24)
    mover = LocalPageMover(
        PagePool(64, SLOT_BYTES, pin_memory=False), BlobStore(root / "disk", NAMESPACE)
    )
    manager = TieredCheckpointManager(index=RAMIndex(64, SLOT_BYTES, 16), mover=mover, disk=disk,
                                      disk_region="eu", gate=gate)
    side = EngineSide(manager, verifier)
    return World(root=root, issuer=CredentialIssuer.from_key_file("HS256", key_file), side=side,
                  plane=ControlPlane(side), disk=disk)


@pytest.fixture
def world(tmp_path: Path) -> World:
    return make_world(tmp_path)


@pytest.fixture(scope="module")
def module_world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("world"))
