"""TieredCheckpointManager end to end: a real RAM tier (RAMIndex + PagePool), a real disk tier
(blobs + SQLite catalog), a real DerivedAuthorityGate with HS256 credentials, a SQLite
revocation list and a SQLite label catalog. Nothing is mocked; `QueuedMover` plays the
connector's part (copies queued, run later, reported back) over the same real mover."""

from __future__ import annotations

import contextvars
import hashlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support.disk_tier import DiskTierForTests
from support.local_mover import LocalPageMover
from support.ram_store import RAMCheckpointStore

from kvci_plugin.governance import (
    CHECK_ORDER,
    AlwaysDenyEligibility,
    CatalogLabelResolver,
    CredentialConfig,
    CredentialIssuer,
    CredentialVerifier,
    DerivedAuthorityGate,
    EligibilityDecision,
    PersistenceEligibilityGate,
    RevocationList,
    SourceLabels,
    Trigger,
    set_persistence_eligibility_gate,
    write_hmac_key_file,
)
from kvci_plugin.policy import Offer, ValuePolicy
from kvci_plugin.tiering.blobs.folder import BlobStore
from kvci_plugin.tiering.blobs.tenant_keys import TOMBSTONE
from kvci_plugin.tiering.disk.catalog import CheckpointCatalog
from kvci_plugin.tiering.manager import TieredCheckpointManager
from kvci_plugin.tiering.outcomes import CheckpointOutcome, PromotionOutcome, RetainAsk
from kvci_plugin.tiering.ram.index import RAMIndex
from kvci_plugin.tiering.types import (
    CheckpointFencedError,
    CheckpointForgottenError,
    CheckpointNotFoundError,
    DoesNotFitError,
    PageKey,
    PageNotFoundError,
    Reservation,
    TenantMismatchError,
)
from kvci_plugin.worthiness import CheckpointAdvisor, CheckpointObservation, current_recommendation

NS = hashlib.sha256(b"model=tiny;rev=1;dtype=bf16;block=32;tp=0/1").digest()
SLOT = 512
SLOTS = 16
TENANT = "acme"
OTHER = "globex"
HANDBOOK = "doc:handbook"  # INTERNAL, eu only, 30 days
PUBLIC = "doc:public"  # PUBLIC: no residency or retention limit
DAY = 86_400.0


def keys_for(name: str, n: int) -> list[PageKey]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest()[:16] for i in range(n)]


def pages_for(keys: Sequence[PageKey]) -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray(hashlib.shake_128(k).digest(SLOT)),
                                         dtype=torch.uint8) for k in keys])


def blob_files(root: Path) -> list[Path]:
    return sorted((root / "blobs").rglob("*.safetensors"))


def comparable(decision: EligibilityDecision) -> dict[str, Any]:
    """A decision without what differs between two checkpoints evaluated moments apart: the
    id, the trigger (provenance only) and the evaluation time with what derives from it."""
    dumped = decision.model_dump(mode="json")
    for name in ("checkpoint_id", "trigger", "evaluated_at", "retention_expiry"):
        dumped.pop(name)
    dumped["reason"] = dumped["reason"].replace(decision.checkpoint_id, "<id>")
    for check in dumped["derivation"]["checks"]:
        if check["name"] == "retention":
            check["detail"] = check["detail"].split(", until")[0]
    return dumped


class QueuedMover:
    """The connector's way of moving pages: every copy is queued and returns False; the test
    runs the queue (with the real mover) and reports back, as the workers do in vLLM."""

    def __init__(self, local: LocalPageMover) -> None:
        self.local = local
        self.stores: list[tuple[Reservation, Any]] = []
        self.persists: list[tuple[str, str, list[PageKey], list[int]]] = []

    def store(self, reservation: Reservation, source: Any) -> bool:
        self.stores.append((reservation, source))
        return False

    def persist(self, checkpoint_id: str, tenant: str, keys: Sequence[PageKey],
                slots: Sequence[int]) -> bool:
        self.persists.append((checkpoint_id, tenant, list(keys), list(slots)))
        return False

    def finish_store(self, manager: TieredCheckpointManager, checkpoint_id: str,
                     ok: bool = True) -> PromotionOutcome | None:
        reservation, source = next(j for j in self.stores if j[0].checkpoint_id == checkpoint_id)
        self.stores = [j for j in self.stores if j[0].checkpoint_id != checkpoint_id]
        if ok:
            self.local.store(reservation, source)
        return manager.on_stored(checkpoint_id, ok)

    def finish_persists(self, manager: TieredCheckpointManager) -> list[PromotionOutcome]:
        jobs, self.persists = self.persists, []
        outcomes = []
        for cid, tenant, keys, slots in jobs:
            try:
                self.local.persist(cid, tenant, keys, slots)
            except Exception as exc:  # as a worker reports a write that failed
                outcomes.append(manager.on_persisted(cid, ok=False, error=str(exc)))
                continue
            outcomes.append(manager.on_persisted(cid, ok=True))
        return outcomes


@dataclass
class World:
    root: Path
    issuer: CredentialIssuer
    revocations: RevocationList
    gate: DerivedAuthorityGate
    ram: RAMCheckpointStore
    disk: DiskTierForTests | None
    mover: Any
    manager: TieredCheckpointManager

    @property
    def disk_root(self) -> Path:
        return self.root / "disk"

    def session(self, **overrides: Any) -> str:
        claims: dict[str, Any] = dict(actor="alice", tenant=TENANT, scopes=["kv:persist"],
                                      clearance="CONFIDENTIAL", markings=[], regions=["eu"],
                                      policy_version=1)
        claims.update(overrides)
        return self.issuer.issue_session(**claims)

    def checkpoint(self, name: str, *, n: int = 3, tenant: str = TENANT, trigger: Trigger = "user",
                   persist: bool = False, session_token: str | None = None,
                   delegation_tokens: Sequence[str] = (), source_ids: Sequence[str] = (HANDBOOK,),
                   ) -> tuple[str, list[PageKey], CheckpointOutcome]:
        keys = keys_for(f"{tenant}/{name}", n)
        outcome = self.manager.checkpoint_now(
            tenant=tenant, keys=keys, trigger=trigger, recommendation=None,
            source=pages_for(keys), source_ids=source_ids, persist=persist,
            session_token=session_token, delegation_tokens=delegation_tokens)
        assert outcome.checkpoint_id is not None, outcome.reason
        return outcome.checkpoint_id, keys, outcome

    def reopen(self, clock: Callable[[], float] = time.time) -> TieredCheckpointManager:
        """A restarted process: the disk store reopened on the same folder, an empty RAM tier."""
        assert self.disk is not None
        self.disk.close()
        self.disk = DiskTierForTests(self.disk_root, NS, 1 << 22, clock=clock)
        ram = RAMCheckpointStore(SLOTS * SLOT, SLOT, max_entries=8, pin_memory=False)
        mover = LocalPageMover(ram.pool, BlobStore(self.disk_root, NS))
        return TieredCheckpointManager(index=ram.index, mover=mover, disk=self.disk,
                                       disk_region="eu", gate=self.gate, clock=clock)


@pytest.fixture(scope="module")
def issuer_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hmac_key_file(tmp_path_factory.mktemp("keys") / "hs256.key")


def make_world(root: Path, key_file: Path, *, disk: bool = True, queued: bool = False,
               gate: PersistenceEligibilityGate | None = None, use_seam: bool = False,
               disk_bytes: int = 1 << 22) -> World:
    root.mkdir()
    revocations = RevocationList(root / "revocations.sqlite3")
    # No clock-skew leeway: a credential is expired the second its exp passes.
    verifier = CredentialVerifier(
        CredentialConfig(algorithm="HS256", key_file=key_file, leeway_s=0.0), revocations)
    labels = CatalogLabelResolver(root / "labels.sqlite3")
    labels.set_labels(HANDBOOK, SourceLabels.model_validate(
        {"classification": "INTERNAL", "residency_regions": ["eu"], "retention_days": 30,
         "mandatory_markings": []}))
    labels.set_labels(PUBLIC, SourceLabels.model_validate(
        {"classification": "PUBLIC", "mandatory_markings": []}))
    derived = DerivedAuthorityGate(verifier, labels, durable_store_region="eu")
    ram = RAMCheckpointStore(SLOTS * SLOT, SLOT, max_entries=8, pin_memory=False)
    store = DiskTierForTests(root / "disk", NS, disk_bytes) if disk else None
    local = LocalPageMover(ram.pool, BlobStore(root / "disk", NS) if disk else None)
    mover: Any = QueuedMover(local) if queued else local
    manager = TieredCheckpointManager(
        index=ram.index, mover=mover, disk=store, disk_region="eu",
        gate=None if use_seam else (gate or derived))
    return World(root=root, issuer=CredentialIssuer.from_key_file("HS256", key_file),
                 revocations=revocations, gate=derived, ram=ram, disk=store, mover=mover,
                 manager=manager)


@pytest.fixture
def make(tmp_path: Path, issuer_key: Path) -> Iterator[Callable[..., World]]:
    """Builds worlds under tmp_path; closes each one's disk store (its folder lock) at the end."""
    worlds: list[World] = []

    def build(**options: Any) -> World:
        worlds.append(make_world(tmp_path / f"world{len(worlds)}", issuer_key, **options))
        return worlds[-1]

    yield build
    for w in worlds:
        if w.disk is not None:
            w.disk.close()


@pytest.fixture
def world(make: Callable[..., World]) -> World:
    return make()


@pytest.fixture
def queued(make: Callable[..., World]) -> World:
    return make(queued=True)


def ram_pages(world: World, keys: Sequence[PageKey], tenant: str = TENANT) -> torch.Tensor:
    return world.ram.load_prefix(keys, tenant)


# ---- scoring ------------------------------------------------------------------------------------


def test_recommend_scores_at_a_moved_bar_and_publishes_the_verdict(world: World) -> None:
    # Scores 0.50 (rebuild cost 0.75, reuse 0.0): under the advisor's 0.55, over a bar moved to
    # 0.45.
    observation = CheckpointObservation(
        context_tokens=229, output_tokens=4, cached_tokens=0, observed_reuse=0, wall_time_s=3.0
    )

    def in_a_run() -> None:  # the verdict is published to this run's context, not the suite's
        own = world.manager.recommend(observation)
        assert own.score == pytest.approx(0.50)
        assert (own.ram_threshold, own.tier.value) == (world.manager.advisor.ram_threshold, "none")
        assert current_recommendation() == own
        moved = world.manager.recommend(observation, ram_threshold=0.45)
        assert (moved.ram_threshold, moved.tier.value, moved.score) == (0.45, "ram", own.score)
        assert current_recommendation() == moved
        with pytest.raises(ValueError, match="ram_threshold"):
            world.manager.recommend(observation, ram_threshold=0.0)

    contextvars.copy_context().run(in_a_run)
    assert current_recommendation() is None


# ---- RAM ----------------------------------------------------------------------------------------


def test_checkpoint_now_keeps_the_pages_in_ram_and_nothing_on_disk(world: World) -> None:
    advisor = CheckpointAdvisor()
    rec = advisor.recommend(CheckpointObservation(context_tokens=8192, tool_calls=6))
    keys = keys_for("a", 4)
    outcome = world.manager.checkpoint_now(
        tenant=TENANT,
        keys=keys,
        trigger="agent",
        recommendation=rec,
        source=pages_for(keys),
        source_ids=(HANDBOOK,),
    )
    assert (outcome.tier, outcome.pending, outcome.new_pages) == ("ram", False, 4)
    assert outcome.persist is None
    assert outcome.checkpoint_id is not None
    assert torch.equal(ram_pages(world, keys), pages_for(keys))
    explained = world.manager.explain(outcome.checkpoint_id, TENANT)
    assert explained["tier"] == "ram" and explained["trigger"] == "agent"
    assert explained["recommendation"] == rec.model_dump(mode="json")
    assert explained["eligibility_decision"] is None and explained["refusal"] is None
    assert explained["pages"] == 4 and explained["bytes"] == 4 * SLOT
    assert blob_files(world.disk_root) == []


def test_a_checkpoint_sharing_a_prefix_copies_only_its_new_pages(world: World) -> None:
    _, first, _ = world.checkpoint("shared", n=3)
    tail = keys_for("tail", 2)
    keys = first[:2] + tail
    # A mapping source, and a tensor source in key order: both put each page in its own slot.
    by_key = {k: p for k, p in zip(keys, pages_for(keys))}
    outcome = world.manager.checkpoint_now(
        tenant=TENANT, keys=keys, trigger="user", recommendation=None, source=by_key
    )
    assert (outcome.new_pages, outcome.reused_pages) == (2, 2)
    assert torch.equal(ram_pages(world, keys), pages_for(keys))
    longer = keys + keys_for("more", 1)
    outcome = world.manager.checkpoint_now(
        tenant=TENANT, keys=longer, trigger="user", recommendation=None, source=pages_for(longer)
    )
    assert (outcome.new_pages, outcome.reused_pages) == (1, 4)
    assert torch.equal(ram_pages(world, longer), pages_for(longer))


def test_an_outcome_names_the_pages_its_evictions_freed(world: World) -> None:
    def keep(keys: list[PageKey]) -> CheckpointOutcome:
        return world.manager.checkpoint_now(
            tenant=TENANT, keys=keys, trigger="user", recommendation=None, source=pages_for(keys)
        )

    a = keys_for("a", 6)
    b = a[:4] + keys_for("b", 2)  # shares four pages with "a"
    first, second = keep(a), keep(b)
    assert (first.evicted, first.evicted_pages) == ((), ())
    # 8 of 16 pages held; 10 more need 2 freed: "a" goes, but only its own 2 pages leave.
    third = keep(keys_for("c", 10))
    assert third.evicted == (first.checkpoint_id,)
    assert third.evicted_pages == tuple(a[4:])
    assert world.manager.index.longest_prefix(b, TENANT) == 6  # a lookup, not a load: no touch
    # "b" is next; one page is wanted, so only its last page leaves and its head stays loadable.
    fourth = keep(keys_for("d", 1))
    assert (fourth.evicted, fourth.trimmed) == ((), (second.checkpoint_id,))
    assert fourth.evicted_pages == (b[-1],)
    assert world.manager.index.longest_prefix(b, TENANT) == 5
    # Then it leaves whole, with the pages it shared with "a".
    fifth = keep(keys_for("e", 5))
    assert fifth.evicted == (second.checkpoint_id,)
    assert fifth.evicted_pages == tuple(b[:5])
    assert world.manager.index.absent(a + b) == tuple(dict.fromkeys(a + b))


def test_bad_input_is_refused_and_keeps_nothing(world: World) -> None:
    keys = keys_for("bad", 2)
    with pytest.raises(ValueError, match="trigger"):
        world.manager.checkpoint_now(
            tenant=TENANT,
            keys=keys,
            trigger="admin",  # type: ignore[arg-type]
            recommendation=None,
            source=pages_for(keys),
        )
    with pytest.raises(ValueError, match=r"source_ids\[1\]"):
        world.manager.checkpoint_now(
            tenant=TENANT,
            keys=keys,
            trigger="user",
            recommendation=None,
            source=pages_for(keys),
            source_ids=(HANDBOOK, ""),
        )
    with pytest.raises(ValueError, match="source must be"):
        world.manager.checkpoint_now(
            tenant=TENANT,
            keys=keys,
            trigger="user",
            recommendation=None,
            source=pages_for(keys)[:1],
        )
    with pytest.raises(ValueError, match="no page for key"):
        world.manager.checkpoint_now(
            tenant=TENANT,
            keys=keys,
            trigger="user",
            recommendation=None,
            source={keys[0]: pages_for(keys)[0]},
        )
    stats = world.manager.ram_stats()
    assert (stats["entries"], stats["pending_entries"], stats["pages"]) == (0, 0, 0)
    none = world.manager.checkpoint_now(
        tenant=TENANT, keys=[], trigger="user", recommendation=None, source=None
    )
    assert none.tier == "none" and none.checkpoint_id is None


# ---- the gated disk write ------------------------------------------------------------------------


def test_a_permitted_persist_writes_blobs_and_the_catalog_row(world: World) -> None:
    assert world.disk is not None
    before = time.time()
    cid, keys, outcome = world.checkpoint("p", n=3, persist=True, session_token=world.session())
    persist = outcome.persist
    assert persist is not None and persist.status == "persisted", persist
    assert persist.decision is not None and persist.decision.permitted
    assert all(BlobStore(world.disk_root, NS).path_for(k).is_file() for k in keys)
    assert {p.stem for p in blob_files(world.disk_root)} == {k.hex() for k in keys}
    record = world.disk.explain(cid)
    assert record is not None and record.page_keys == tuple(keys) and record.tenant == TENANT
    assert json.loads(record.decision_json)["permitted"] is True
    assert torch.equal(world.disk.load(cid, TENANT), pages_for(keys))  # the bytes, verified
    explained = world.manager.explain(cid, TENANT)
    assert explained["tier"] == "ram+disk" and explained["refusal"] is None
    checks = explained["eligibility_decision"]["derivation"]["checks"]
    assert [c["name"] for c in checks] == list(CHECK_ORDER)
    assert {c["verdict"] for c in checks} == {"pass"}
    assert before + 30 * DAY <= explained["retention_expiry"] <= time.time() + 30 * DAY
    stats = world.manager.ram_stats()
    assert stats["pinned_pages"] == 0 and stats["persists_in_flight"] == 0
    again = world.manager.promote(cid, tenant=TENANT, trigger="user", session_token=None)
    assert (again.status, again.reason) == ("persisted", "already durable")
    assert world.disk.stats().checkpoints == 1


def test_a_persist_the_disk_tier_cannot_take_fails_with_the_reason_and_keeps_the_ram_copy(
    world: World,
) -> None:
    import sqlite3

    assert world.disk is not None
    # A real fault: another process holds the catalog's write lock past the wait kvci allows.
    other = sqlite3.connect(world.disk_root / "catalog.sqlite3", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        cid, keys, outcome = world.checkpoint("p", n=2, persist=True, session_token=world.session())
        assert outcome.tier == "ram" and outcome.persist is not None
        assert outcome.persist.status == "failed" and "database is locked" in outcome.persist.reason
        assert world.disk.health.report().state == "degraded"
        # Degraded: the next persist is not tried, the gate still decides, the reason says why.
        cid2, _, outcome2 = world.checkpoint("q", n=2, persist=True, session_token=world.session())
        assert outcome2.persist is not None and outcome2.persist.status == "failed"
        assert "disk tier is unavailable" in outcome2.persist.reason
        assert outcome2.persist.decision is not None and outcome2.persist.decision.permitted
        refused = world.checkpoint("r", n=2, persist=True)[2].persist
        assert refused is not None and refused.status == "refused"  # no credential: the gate's word
        assert world.manager.explain(cid2, TENANT)["persist_error"] == outcome2.persist.reason
        assert world.manager.ram_stats()["persists_in_flight"] == 0
        assert world.manager.index.longest_prefix(keys, TENANT) == 2  # the RAM copy serves
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert blob_files(world.disk_root) == [] or all(  # nothing half-written was left named
        p.stem not in {k.hex() for k in keys} for p in blob_files(world.disk_root)
    )


def test_a_persist_without_credentials_is_refused_and_the_refusal_is_kept(world: World) -> None:
    assert world.disk is not None
    cid, keys, outcome = world.checkpoint("r", persist=True, session_token=None)
    persist = outcome.persist
    assert persist is not None and persist.status == "refused"
    assert persist.decision is not None and persist.decision.failed_check == "verified_authority"
    assert blob_files(world.disk_root) == [] and world.disk.stats().checkpoints == 0
    assert world.ram.get(cid, TENANT).meta["refusal"] == persist.reason
    explained = world.manager.explain(cid, TENANT)
    assert explained["tier"] == "ram"
    assert explained["refusal"].startswith("refused at verified_authority: no checked session")
    assert explained["eligibility_decision"]["failed_check"] == "verified_authority"
    # The refusal is a record, not a verdict on the checkpoint: a later promote with authority
    # is judged afresh, and its permit supersedes the refusal.
    later = world.manager.promote(cid, tenant=TENANT, trigger="user", session_token=world.session())
    assert later.status == "persisted"
    explained = world.manager.explain(cid, TENANT)
    assert explained["tier"] == "ram+disk" and explained["refusal"] is None


def test_the_refusal_names_the_unlabelled_source(world: World) -> None:
    cid, _, outcome = world.checkpoint(
        "u", persist=True, session_token=world.session(), source_ids=(HANDBOOK, "doc:unknown")
    )
    assert outcome.persist is not None and outcome.persist.status == "refused"
    assert outcome.persist.decision is not None
    assert outcome.persist.decision.failed_check == "labels_present"
    assert "doc:unknown" in world.manager.explain(cid, TENANT)["refusal"]


def test_promote_refuses_once_the_session_has_expired(world: World) -> None:
    assert world.disk is not None
    expires = int(time.time()) + 2
    token = world.session(now=expires - 3600, ttl_s=3600)  # exp is `expires`, to the second
    # While it is valid the token persists: a sibling checkpoint shows it.
    _, _, sibling = world.checkpoint("valid", persist=True, session_token=token)
    assert sibling.persist is not None and sibling.persist.status == "persisted"
    cid, _, kept = world.checkpoint("later", session_token=token)
    assert kept.persist is None
    time.sleep(max(0.0, expires - time.time()) + 0.05)
    outcome = world.manager.promote(cid, tenant=TENANT, trigger="user", session_token=token)
    assert outcome.status == "refused"
    assert outcome.decision is not None and outcome.decision.failed_check == "verified_authority"
    assert "expired" in outcome.reason
    assert world.manager.explain(cid, TENANT)["refusal"] == outcome.reason
    assert world.disk.explain(cid) is None and world.disk.stats().checkpoints == 1


def test_promote_refuses_once_the_delegation_is_revoked(world: World) -> None:
    assert world.disk is not None
    token = world.session(actor="agent-7")
    delegation = world.issuer.issue_delegation(
        tenant=TENANT,
        delegator="alice",
        delegate="agent-7",
        scopes=["kv:persist"],
        clearance="CONFIDENTIAL",
        markings=[],
        regions=["eu"],
        jti="deleg-1",
    )
    _, _, sibling = world.checkpoint(
        "before", persist=True, session_token=token, delegation_tokens=[delegation]
    )
    assert sibling.persist is not None and sibling.persist.status == "persisted"
    authority = sibling.persist.decision.derivation.authority  # type: ignore[union-attr]
    assert authority is not None and [h.delegator for h in authority.delegation_chain] == ["alice"]
    cid, _, _ = world.checkpoint("after", session_token=token, delegation_tokens=[delegation])
    world.revocations.revoke("deleg-1", "task cancelled")
    outcome = world.manager.promote(
        cid, tenant=TENANT, trigger="agent", session_token=token, delegation_tokens=[delegation]
    )
    assert outcome.status == "refused"
    assert outcome.decision is not None and outcome.decision.failed_check == "verified_authority"
    assert "revoked" in outcome.reason and "delegation[0]" in outcome.reason
    assert world.disk.explain(cid) is None


def test_the_always_deny_gate_refuses_valid_authority(make: Callable[..., World]) -> None:
    world = make(gate=AlwaysDenyEligibility())
    cid, _, outcome = world.checkpoint("d", persist=True, session_token=world.session())
    assert outcome.persist is not None and outcome.persist.status == "refused"
    assert outcome.persist.decision is not None
    assert outcome.persist.decision.failed_check == "always_deny"
    explained = world.manager.explain(cid, TENANT)
    assert explained["gate_in_force"] == "always_deny" and "always_deny" in explained["refusal"]
    assert blob_files(world.disk_root) == []


def test_without_a_gate_the_seam_decides_at_each_promotion(make: Callable[..., World]) -> None:
    world = make(use_seam=True)
    previous = set_persistence_eligibility_gate(world.gate)
    try:
        token = world.session()
        _, _, permitted = world.checkpoint("s1", persist=True, session_token=token)
        assert permitted.persist is not None and permitted.persist.status == "persisted"
        set_persistence_eligibility_gate(AlwaysDenyEligibility())
        cid, _, refused = world.checkpoint("s2", persist=True, session_token=token)
        assert refused.persist is not None and refused.persist.status == "refused"
        assert world.manager.explain(cid, TENANT)["gate_in_force"] == "always_deny"
        assert world.manager.ram_stats()["gate_in_force"] == "always_deny"
    finally:
        set_persistence_eligibility_gate(previous)


@pytest.mark.parametrize("token", ["valid", "none", "other-tenant"])
def test_the_trigger_does_not_change_the_decision(world: World, token: str) -> None:
    session = {"valid": world.session(), "none": None, "other-tenant": world.session(tenant=OTHER)}[
        token
    ]
    decisions = {}
    triggers: tuple[Trigger, ...] = ("system", "user", "agent")
    for trigger in triggers:
        cid, _, _ = world.checkpoint(f"t-{token}-{trigger}", trigger=trigger)
        outcome = world.manager.promote(cid, tenant=TENANT, trigger=trigger, session_token=session)
        assert outcome.decision is not None and outcome.decision.trigger == trigger
        decisions[trigger] = (outcome.status, comparable(outcome.decision))
    assert decisions["system"] == decisions["user"] == decisions["agent"]
    assert decisions["user"][0] == ("persisted" if token == "valid" else "refused")


# ---- restart -------------------------------------------------------------------------------------


def test_a_restarted_manager_finds_every_durable_checkpoint_not_expired(world: World) -> None:
    token = world.session()
    kept, kept_keys, _ = world.checkpoint("kept", persist=True, session_token=token)
    public, public_keys, _ = world.checkpoint(
        "pub", persist=True, session_token=token, source_ids=(PUBLIC,)
    )
    ram_only, ram_keys, _ = world.checkpoint("ram-only")

    manager = world.reopen()
    assert world.disk is not None
    explained = manager.explain(kept, TENANT)
    assert (explained["tier"], explained["trigger"], explained["pages"]) == ("disk", "user", 3)
    assert explained["eligibility_decision"]["permitted"] is True
    checks = explained["eligibility_decision"]["derivation"]["checks"]
    assert [c["name"] for c in checks] == list(CHECK_ORDER)
    assert world.disk.longest_prefix(kept_keys, TENANT) == 3
    assert torch.equal(world.disk.load_prefix(kept_keys, TENANT), pages_for(kept_keys))
    assert manager.explain(public, TENANT)["retention_expiry"] is None
    with pytest.raises(CheckpointNotFoundError):
        manager.explain(ram_only, TENANT)  # RAM never implied disk
    assert world.disk.longest_prefix(ram_keys, TENANT) == 0
    again = manager.promote(kept, tenant=TENANT, trigger="user", session_token=None)
    assert (again.status, again.reason) == ("persisted", "already durable")
    with pytest.raises(CheckpointNotFoundError):
        manager.promote(ram_only, tenant=TENANT, trigger="user", session_token=token)

    # 31 days on: the 30-day checkpoint has expired, the PUBLIC one (no limit) has not.
    later = world.reopen(clock=lambda: time.time() + 31 * DAY)
    with pytest.raises(CheckpointNotFoundError):
        later.explain(kept, TENANT)
    assert world.disk.longest_prefix(kept_keys, TENANT) == 0
    assert later.explain(public, TENANT)["tier"] == "disk"
    assert world.disk.longest_prefix(public_keys, TENANT) == 3


# ---- tenancy -------------------------------------------------------------------------------------


def test_another_tenant_can_neither_explain_nor_promote(world: World) -> None:
    token = world.session()
    durable, _, _ = world.checkpoint("t1", persist=True, session_token=token)
    in_ram, _, _ = world.checkpoint("t2")
    theirs = world.session(tenant=OTHER)
    for cid in (durable, in_ram):
        with pytest.raises(TenantMismatchError) as err:
            world.manager.explain(cid, OTHER)
        assert TENANT not in str(err.value)
        with pytest.raises(TenantMismatchError):
            world.manager.promote(cid, tenant=OTHER, trigger="user", session_token=theirs)
    assert world.ram.get(in_ram, TENANT).meta["refusal"] is None  # the attempt left no trace
    manager = world.reopen()
    with pytest.raises(TenantMismatchError) as err:
        manager.explain(durable, OTHER)
    assert TENANT not in str(err.value)
    with pytest.raises(TenantMismatchError):
        manager.promote(durable, tenant=OTHER, trigger="user", session_token=theirs)
    with pytest.raises(CheckpointNotFoundError):
        manager.explain("never-held", TENANT)


# ---- stats ---------------------------------------------------------------------------------------


def test_ram_stats_reports_occupancy_gate_and_scorers(world: World) -> None:
    world.checkpoint("s1", n=3, persist=True, session_token=world.session())
    world.checkpoint("s2", n=2)
    stats = world.manager.ram_stats()
    assert (stats["entries"], stats["pages"], stats["bytes_used"]) == (2, 5, 5 * SLOT)
    assert stats["capacity_bytes"] == SLOTS * SLOT and stats["tenant_bytes"] == {TENANT: 5 * SLOT}
    assert stats["gate_in_force"] == "derived_authority"
    expected = {e.name: e.weight for e in world.manager.advisor.registry.entries()}
    assert stats["scorers"] == expected and len(expected) > 0
    assert stats["disk"]["checkpoints"] == 1 and stats["disk"]["pages"] == 3
    assert json.loads(json.dumps(stats)) == stats  # plain data, ready for any surface


def test_without_a_disk_tier_a_persist_is_refused_without_a_decision(
    make: Callable[..., World],
) -> None:
    world = make(disk=False)
    cid, _, outcome = world.checkpoint("nd", persist=True, session_token=world.session())
    assert outcome.persist is not None and outcome.persist.status == "refused"
    assert outcome.persist.decision is None and "disk_root" in outcome.persist.reason
    explained = world.manager.explain(cid, TENANT)
    assert explained["tier"] == "ram" and "disk_root" in explained["refusal"]
    assert world.manager.ram_stats()["disk"] is None


# ---- queued copies (the connector's path) -------------------------------------------------------


def test_a_persist_waits_for_its_ram_copy_and_pins_until_written(queued: World) -> None:
    mover, manager = queued.mover, queued.manager
    assert isinstance(mover, QueuedMover) and queued.disk is not None
    cid, keys, outcome = queued.checkpoint("q", n=3, persist=True, session_token=queued.session())
    assert outcome.pending and outcome.persist is not None
    assert (outcome.persist.status, outcome.persist.reason) == (
        "persisting",
        "permitted; waiting for the RAM copy",
    )
    assert manager.explain(cid, TENANT)["persisting"] == "waiting"
    # A second promote starts no second write.
    again = manager.promote(cid, tenant=TENANT, trigger="user", session_token=queued.session())
    assert again.status == "persisting" and mover.persists == []

    assert mover.finish_store(manager, cid) is not None
    assert [job[0] for job in mover.persists] == [cid]
    assert manager.explain(cid, TENANT)["persisting"] == "writing"
    assert manager.ram_stats()["pinned_pages"] == 3
    # Pinned pages are never evicted: filling RAM evicts everything else or does not fit.
    evicted: list[str] = []
    for i in range(4):
        filler, _, fill = queued.checkpoint(f"fill{i}", n=4)
        mover.finish_store(manager, filler)
        evicted += fill.evicted + fill.trimmed
    assert evicted and cid not in evicted
    assert manager.explain(cid, TENANT)["tier"] == "ram"

    (done,) = mover.finish_persists(manager)
    assert done.status == "persisted"
    assert torch.equal(queued.disk.load(cid, TENANT), pages_for(keys))
    assert manager.explain(cid, TENANT)["tier"] == "ram+disk"
    assert manager.ram_stats()["pinned_pages"] == 0
    duplicate = manager.on_persisted(cid, ok=True)  # a second report changes nothing
    assert duplicate.status == "failed" and queued.disk.stats().checkpoints == 1


def test_a_failed_blob_write_is_recorded_and_a_later_promote_retries(queued: World) -> None:
    mover, manager = queued.mover, queued.manager
    assert isinstance(mover, QueuedMover) and queued.disk is not None
    token = queued.session()
    cid, _, _ = queued.checkpoint("f", persist=True, session_token=token)
    mover.finish_store(manager, cid)
    mover.persists.clear()  # the worker never wrote them: it reports an error instead
    failed = manager.on_persisted(cid, ok=False, error="rank 1: No space left on device")
    assert failed.status == "failed" and "No space left" in failed.reason
    explained = manager.explain(cid, TENANT)
    assert "No space left" in explained["persist_error"] and explained["tier"] == "ram"
    assert manager.ram_stats()["pinned_pages"] == 0 and queued.disk.stats().checkpoints == 0
    retry = manager.promote(cid, tenant=TENANT, trigger="user", session_token=token)
    assert retry.status == "persisting"
    assert [o.status for o in mover.finish_persists(manager)] == ["persisted"]
    assert manager.explain(cid, TENANT)["persist_error"] is None


def test_a_persist_sharing_pages_waits_for_the_other_checkpoints_copy(queued: World) -> None:
    mover, manager = queued.mover, queued.manager
    assert isinstance(mover, QueuedMover) and queued.disk is not None
    first, keys, _ = queued.checkpoint("sh", n=3)
    # Same prefix, finished in the same step: nothing new to copy, but the pages are not in yet.
    second = manager.checkpoint_now(
        tenant=TENANT,
        keys=keys[:2],
        trigger="system",
        recommendation=None,
        source=pages_for(keys[:2]),
        source_ids=(HANDBOOK,),
        persist=True,
        session_token=queued.session(),
    )
    assert second.checkpoint_id is not None and not second.pending and second.new_pages == 0
    assert second.persist is not None and second.persist.status == "persisting"
    assert mover.persists == []
    assert mover.finish_store(manager, first) is None  # `first` itself asked for no persist
    assert [job[0] for job in mover.persists] == [second.checkpoint_id]
    assert [o.status for o in mover.finish_persists(manager)] == ["persisted"]
    assert torch.equal(queued.disk.load(second.checkpoint_id, TENANT), pages_for(keys[:2]))


def test_a_persist_sharing_pages_with_a_failed_store_is_dropped_and_recorded(queued: World) -> None:
    mover, manager = queued.mover, queued.manager
    assert isinstance(mover, QueuedMover)
    first, keys, _ = queued.checkpoint("fs", n=3)
    second = manager.checkpoint_now(
        tenant=TENANT,
        keys=keys[:2],
        trigger="user",
        recommendation=None,
        source=pages_for(keys[:2]),
        source_ids=(HANDBOOK,),
        persist=True,
        session_token=queued.session(),
    )
    assert second.checkpoint_id is not None
    mover.finish_store(manager, first, ok=False)
    assert mover.persists == [] and manager.ram_stats()["persists_in_flight"] == 0
    explained = manager.explain(second.checkpoint_id, TENANT)
    assert explained["persisting"] is None and "never copied in" in explained["persist_error"]
    with pytest.raises(CheckpointNotFoundError):
        manager.explain(first, TENANT)  # its store failed: it is gone


def test_a_catalog_row_that_cannot_be_written_fails_the_persist(make: Callable[..., World]) -> None:
    # A disk tier smaller than one checkpoint: the blobs are written, the row is refused.
    world = make(disk_bytes=2 * SLOT)
    assert world.disk is not None
    cid, _, outcome = world.checkpoint("big", n=3, persist=True, session_token=world.session())
    assert outcome.persist is not None and outcome.persist.status == "failed"
    assert "disk_bytes" in outcome.persist.reason
    explained = world.manager.explain(cid, TENANT)
    assert explained["tier"] == "ram" and "disk_bytes" in explained["persist_error"]
    assert world.manager.ram_stats()["pinned_pages"] == 0
    assert world.disk.stats().checkpoints == 0


# ---- cache reset --------------------------------------------------------------------------------


def test_a_reset_forgets_ram_fences_disk_and_a_restart_keeps_the_fence(world: World) -> None:
    assert world.disk is not None
    ram_only, ram_keys, _ = world.checkpoint("ram-only")
    durable, disk_keys, outcome = world.checkpoint(
        "durable", persist=True, session_token=world.session()
    )
    assert outcome.persist is not None and outcome.persist.status == "persisted"
    old_namespace = world.disk.namespace
    assert world.manager.generation == 0 and blob_files(world.disk_root)

    reset = world.manager.reset()

    assert (reset.generation, reset.ram_checkpoints, reset.disk_checkpoints) == (1, 2, 1)
    assert world.manager.generation == world.disk.generation == 1
    assert world.disk.namespace != old_namespace
    assert world.ram.index.entries() == [] and world.ram.index.longest_prefix(ram_keys, TENANT) == 0
    assert world.disk.longest_prefix(disk_keys, TENANT) == 0 and world.disk.list() == []
    assert blob_files(world.disk_root) == []  # the fenced pages' blobs are deleted
    for cid in (ram_only, durable):
        with pytest.raises(CheckpointFencedError, match="fenced by a cache reset"):
            world.manager.explain(cid, TENANT)
        with pytest.raises(CheckpointNotFoundError) as other:  # no oracle for another tenant
            world.manager.explain(cid, OTHER)
        assert not isinstance(other.value, CheckpointFencedError)

    restarted = world.reopen()
    assert restarted.generation == 1 and world.disk.namespace != old_namespace
    with pytest.raises(CheckpointFencedError):
        restarted.explain(durable, TENANT)


def test_copies_in_flight_at_a_reset_are_never_kept(queued: World) -> None:
    assert queued.disk is not None
    storing, store_keys, _ = queued.checkpoint("storing")
    writing, write_keys, _ = queued.checkpoint(
        "writing", persist=True, session_token=queued.session()
    )
    queued.mover.finish_store(queued.manager, writing)  # its persist starts: blobs being written
    assert queued.mover.persists

    queued.manager.reset()

    assert queued.mover.finish_store(queued.manager, storing) is None  # the copy ran: ignored
    assert queued.ram.index.longest_prefix(store_keys, TENANT) == 0
    (written,) = queued.mover.finish_persists(queued.manager)
    assert (written.status, written.reason) == (
        "failed",
        "fenced by a cache reset or a forget: not recorded",
    )
    assert queued.disk.list() == [] and queued.disk.longest_prefix(write_keys, TENANT) == 0
    assert queued.manager.ram_stats()["persists_in_flight"] == 0


def test_a_forget_erases_one_tenant_copies_in_flight_included(queued: World) -> None:
    assert queued.disk is not None
    storing, store_keys, _ = queued.checkpoint("storing")
    writing, write_keys, _ = queued.checkpoint(
        "writing", persist=True, session_token=queued.session()
    )
    queued.mover.finish_store(queued.manager, writing)
    assert queued.mover.persists
    others, other_keys, _ = queued.checkpoint("others", tenant=OTHER)
    queued.mover.finish_store(queued.manager, others)

    outcome = queued.manager.forget(TENANT)

    assert (outcome.ram_checkpoints, outcome.disk_checkpoints) == (2, 0)
    assert queued.mover.finish_store(queued.manager, storing) is None  # the copy ran: ignored
    (written,) = queued.mover.finish_persists(queued.manager)
    assert written.status == "failed" and "not recorded" in written.reason
    assert queued.disk.list() == [] and queued.disk.longest_prefix(write_keys, TENANT) == 0
    assert queued.ram.index.longest_prefix(store_keys, TENANT) == 0
    # The persist's pages were pinned when forget ran: unloadable since, and freed by its report.
    assert queued.ram.index.longest_prefix(write_keys, TENANT) == 0
    assert queued.ram.index.stats().tenant_bytes.keys() == {OTHER}
    for cid in (storing, writing):
        with pytest.raises(CheckpointForgottenError, match="forgotten"):
            queued.manager.explain(cid, TENANT)
        with pytest.raises(CheckpointNotFoundError) as other:
            queued.manager.explain(cid, OTHER)
        assert not isinstance(other.value, CheckpointForgottenError)
    assert queued.ram.index.longest_prefix(other_keys, OTHER) == len(other_keys)


def test_a_forget_unloads_the_pages_a_persist_still_pins_before_it_reports(queued: World) -> None:
    writing, write_keys, _ = queued.checkpoint(
        "writing", persist=True, session_token=queued.session()
    )
    queued.mover.finish_store(queued.manager, writing)
    assert queued.mover.persists  # its blobs are being written from the pinned pages

    queued.manager.forget(TENANT)

    index = queued.ram.index
    assert index.longest_prefix(write_keys, TENANT) == 0
    with pytest.raises(PageNotFoundError):
        index.pin(write_keys, TENANT)
    with pytest.raises(DoesNotFitError, match="erased"):  # a new request cannot revive them
        index.reserve("again", TENANT, write_keys)
    queued.mover.finish_persists(queued.manager)
    assert index.stats().bytes_used == 0
    # The write ran after the forget: it made no key material (a tombstone stands in its place).
    materials = [path.read_bytes() for path in (queued.disk_root / "keys").glob("*.key")]
    assert materials == [TOMBSTONE]
    again = queued.manager.checkpoint_now(
        tenant=TENANT,
        keys=write_keys,
        trigger="user",
        recommendation=None,
        source=pages_for(write_keys),
    )
    assert again.tier == "ram"  # KV computed after the forget is kept as any other


def test_a_forget_ends_the_tenants_retentions_now(world: World) -> None:
    kept = world.manager.checkpoint_now(
        tenant=TENANT,
        keys=keys_for("held", 3),
        trigger="user",
        recommendation=None,
        source=pages_for(keys_for("held", 3)),
        retain=RetainAsk(ttl_s=300.0, session="s1"),
    )
    assert kept.retain is not None and kept.retain.status == "retained"
    assert world.manager.retentions.stats().retentions == 1

    world.manager.forget(TENANT)

    stats = world.manager.retentions.stats()
    assert (stats.retentions, stats.retained_bytes) == (0, 0)
    assert world.ram.index.stats().bytes_used == 0  # unpinned: nothing holds its pages


def test_a_forget_holds_no_lock_while_the_disk_tier_erases(world: World) -> None:
    """The disk tier's part of a forget (a catalog transaction, the key material's tombstone)
    runs outside the manager's lock, which the scheduler's thread takes at every lookup and
    finished request: here the catalog is slow (another connection holds its write lock), and
    the lock, and a keep of another tenant, are free meanwhile; RAM was erased before."""
    assert world.disk is not None
    cid, keys, _ = world.checkpoint("durable", persist=True, session_token=world.session())
    assert world.disk.explain(cid) is not None
    other = CheckpointCatalog(world.disk_root / "catalog.sqlite3")
    outcome: list[Any] = []
    with ThreadPoolExecutor(1) as pool:
        with other.locked():
            forgot = pool.submit(world.manager.forget, TENANT)
            deadline = time.monotonic() + 5
            while world.ram.index.longest_prefix(keys, TENANT) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert world.ram.index.longest_prefix(keys, TENANT) == 0  # the RAM part is done
            time.sleep(0.1)
            assert not forgot.done()  # its disk part waits for the catalog...
            assert world.manager.lock.acquire(timeout=0.5)  # ...without the manager's lock
            world.manager.lock.release()
            kept = world.manager.checkpoint_now(
                tenant=OTHER, keys=keys_for("other", 2), trigger="user", recommendation=None,
                source=pages_for(keys_for("other", 2)))
            assert kept.tier == "ram"
        outcome.append(forgot.result(timeout=10))
    other.close()
    assert (outcome[0].ram_checkpoints, outcome[0].disk_checkpoints) == (1, 1)
    assert outcome[0].key_destroyed and world.disk.explain(cid) is None


def test_kv_computed_before_a_forget_is_neither_kept_nor_recorded(queued: World) -> None:
    """The erasure epoch read when a request's KV was computed travels with its keep and its
    persist: computed before a forget, it is refused in RAM and its write is never leased,
    even when the request finishes (and persists) after the forget returned."""
    assert queued.disk is not None
    computed_at = queued.manager.erasure_epoch  # read at the request's lookup
    queued.manager.forget(TENANT)
    assert queued.manager.erasure_epoch > computed_at
    keys = keys_for("late", 3)
    late = queued.manager.checkpoint_now(
        tenant=TENANT, keys=keys, trigger="user", recommendation=None, source=pages_for(keys),
        source_ids=(HANDBOOK,), persist=True, session_token=queued.session(),
        erasure_epoch=computed_at)
    assert late.checkpoint_id is None and "before its tenant was forgotten" in late.reason
    assert queued.ram.index.longest_prefix(keys, TENANT) == 0
    # KV computed after it is kept, and persisted, as any other.
    fresh = queued.manager.checkpoint_now(
        tenant=TENANT, keys=keys, trigger="user", recommendation=None, source=pages_for(keys),
        source_ids=(HANDBOOK,), persist=True, session_token=queued.session(),
        erasure_epoch=queued.manager.erasure_epoch)
    assert fresh.checkpoint_id is not None and fresh.tier == "ram"
    queued.mover.finish_store(queued.manager, fresh.checkpoint_id)
    (written,) = queued.mover.finish_persists(queued.manager)
    assert written.status == "persisted", written.reason


def test_a_persist_of_kv_computed_before_a_forget_is_refused_by_the_catalog(
        queued: World) -> None:
    """Even where this node never learned of the forget (another node made it), the catalog
    refuses the lease of a write whose KV was computed at an older erasure epoch."""
    assert queued.disk is not None
    cid, keys, _ = queued.checkpoint("computed", persist=False)
    queued.mover.finish_store(queued.manager, cid)
    queued.disk.forget(TENANT)  # as another node's forget: this manager was not told
    outcome = queued.manager.promote(cid, tenant=TENANT, trigger="user",
                                     session_token=queued.session())
    assert outcome.status == "failed" and "forgotten" in outcome.reason
    assert queued.mover.persists == []  # nothing was leased, so nothing is written
    assert queued.disk.longest_prefix(keys, TENANT) == 0


@pytest.mark.parametrize("copy", ["at once", "queued"])
@pytest.mark.parametrize("trigger", ["system", "user"])
def test_a_system_checkpoint_keeps_the_prefix_its_prompt_re_sent(
    make: Callable[..., World], copy: str, trigger: Trigger
) -> None:
    """The connector's path: the earlier turn was not kept (the policy only remembers it), the
    next re-sends it. Once the copy commits, the system's checkpoint leaves its re-sent prefix
    a checkpoint of its own; an explicit one needs none (it leaves last)."""
    w = make(queued=copy == "queued")
    ram = RAMCheckpointStore(SLOTS * SLOT, SLOT, max_entries=8, pin_memory=False)
    index = RAMIndex(SLOTS, SLOT, 8, policy=ValuePolicy())
    local = LocalPageMover(ram.pool, None)
    mover: Any = QueuedMover(local) if copy == "queued" else local
    manager = TieredCheckpointManager(index=index, mover=mover, disk=None, gate=w.gate)
    turn1, turn2 = keys_for("turn1", 2), keys_for("turn1", 2) + keys_for("turn2", 2)
    index.sight(Offer(anchor=turn1[-1]))
    index.observe_lookup(turn2)
    outcome = manager.checkpoint_now(
        tenant=TENANT,
        keys=turn2,
        trigger=trigger,
        recommendation=None,
        source=pages_for(turn2),
        offer=Offer(anchor=turn2[-1], explicit=trigger != "system"),
    )
    assert outcome.checkpoint_id is not None and outcome.new_pages == 4
    if copy == "queued":
        assert len(index.entries(TENANT)) == 1  # nothing before the pages are in RAM
        mover.finish_store(manager, outcome.checkpoint_id)
    entries = {e.checkpoint_id: e for e in index.entries(TENANT)}
    if trigger != "system":
        assert list(entries) == [outcome.checkpoint_id]
        return
    (prefix,) = (e for cid, e in entries.items() if cid != outcome.checkpoint_id)
    assert prefix.keys == tuple(turn1) and prefix.meta["trigger"] == "system"
    assert index.stats().pages == 4
    index.remove(outcome.checkpoint_id, TENANT)
    assert index.longest_prefix(turn2, TENANT) == 2
