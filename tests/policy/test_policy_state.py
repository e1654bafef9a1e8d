"""What the value policy learned, kept across restarts: the counts a restarted tier starts from,
the file they live in (real files), its refusals of what it did not write, and the saver's
cadence; the scheduler side saves at shutdown and a new one starts from it."""

from __future__ import annotations

import hashlib
import json
import logging
import stat
import threading
from pathlib import Path

import pytest

from kvci_plugin.connector.config import KVCIConfig
from kvci_plugin.connector.scheduler import KVCIScheduler
from kvci_plugin.policy import LRUPolicy, Offer, PolicyStateFile, PolicyStateSaver, ValuePolicy
from kvci_plugin.policy.reuse_hazard import EDGES, HazardCounts, ReuseHazard
from kvci_plugin.request.tenancy import TenantResolver
from kvci_plugin.tiering.ram.index import RAMIndex

ONE_OFF = (-1, 0, None)  # an unscored context never re-sent, nothing said of it
RESENT = (-1, 2, None)  # one re-sent more than once


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def taught(clock: Clock, policy: ValuePolicy | None = None) -> RAMIndex:
    """An index whose policy saw one context re-sent every 10 s and 100 one-offs never re-sent."""
    ix = RAMIndex(8, 1, 100, policy=policy or ValuePolicy(), clock=clock)
    hot = [key(1), key(2)]
    ix.sight(Offer(anchor=hot[-1]))
    ix.reserve("hot", "t", hot, offer=Offer(anchor=hot[-1]))
    ix.commit("hot")
    for n in range(100):
        clock.now += 10.0
        ix.observe_lookup(hot)
        ix.observe_lookup([key(1000 + n)])
        ix.sight(Offer(anchor=key(1000 + n)))
    return ix


def probabilities(hazard: ReuseHazard) -> list[float]:
    return [hazard.resend_probability(cls, age, horizon)
            for cls in (ONE_OFF, RESENT) for age in (0.0, 5.0, 300.0) for horizon in (10.0, 600.0)]


def test_a_tier_restarted_from_the_file_weighs_as_the_one_that_learned(tmp_path: Path) -> None:
    clock = Clock()
    policy = ValuePolicy()
    ix = taught(clock, policy)
    state = PolicyStateFile(tmp_path / "policy.json")
    state.save(ix.policy_learned())
    restored = state.load()
    assert restored is not None
    assert probabilities(restored) == pytest.approx(probabilities(policy.reuse_hazard(clock.now)))
    # What it learned is not the prior a fresh tier starts from.
    assert (
        restored.resend_probability(ONE_OFF, 0.0, 600.0)
        < ReuseHazard().resend_probability(ONE_OFF, 0.0, 600.0) / 2
    )
    assert restored.resend_probability(RESENT, 0.0, 600.0) > 5 * restored.resend_probability(
        ONE_OFF, 0.0, 600.0
    )
    # And it learns on from there: a second run's re-sends add to the first's.
    again = taught(Clock(clock.now), ValuePolicy(hazard=restored)).policy_learned()
    assert sum(again.reuses[RESENT]) == 2 * sum(ix.policy_learned().reuses[RESENT]) > 0


def test_contexts_still_idle_are_kept_as_idle_time_not_dropped() -> None:
    """The one-offs never ended an idle period: without their idle time so far, the restarted
    tier would know nothing against them and weigh them by the optimistic prior."""
    clock = Clock()
    policy = ValuePolicy()
    taught(clock, policy)
    ended_only = ReuseHazard.from_counts(policy._hazard.counts({}))
    censored = ReuseHazard.from_counts(policy.learned(clock.now))
    assert (
        censored.resend_probability(ONE_OFF, 0.0, 600.0)
        < ended_only.resend_probability(ONE_OFF, 0.0, 600.0) / 2
    )


def test_a_save_takes_the_anchors_held_when_asked_and_walks_them_when_read() -> None:
    """The index's lock is held only to list the anchors: their idle ages are gathered when the
    saver reads the counts (on its own thread), and a context first seen after the ask is not in
    them."""
    clock = Clock()
    policy = ValuePolicy()
    ix = taught(clock, policy)
    asked = ix.policy_learned()
    assert asked is not None
    clock.now += 5.0
    for n in range(50):  # seen after the ask: not in this save
        ix.sight(Offer(anchor=key(5000 + n)))
    closed = asked.closed()
    assert len(asked.idle) == 101  # "hot" and the 100 one-offs
    now = ix.policy_learned().closed()
    assert sum(now.exposure[ONE_OFF]) > sum(closed.exposure[ONE_OFF])


def test_the_lru_baseline_has_nothing_to_keep() -> None:
    assert RAMIndex(4, 1, 10, policy=LRUPolicy()).policy_learned() is None


def test_the_file_is_owner_only_and_replaced_whole(tmp_path: Path) -> None:
    clock = Clock()
    ix = taught(clock)
    path = tmp_path / "policy.json"
    path.write_text("an older file")
    PolicyStateFile(path).save(ix.policy_learned())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["policy.json"]  # no temporary left behind
    data = json.loads(path.read_text())
    assert data["format"] == "kvci-policy-state/1" and data["edges_s"] == list(EDGES)
    # Counts only: no key, no tenant.
    assert key(1).hex() not in path.read_text() and '"t"' not in path.read_text()


def valid(tmp_path: Path) -> dict:
    path = tmp_path / "source.json"
    PolicyStateFile(path).save(taught(Clock()).policy_learned())
    return json.loads(path.read_text())


@pytest.mark.parametrize(
    "spoil, says",
    [
        (lambda d: "not json", "is not a kvci policy state"),
        (lambda d: {**d, "format": "kvci-policy-state/9"}, "is not a kvci policy state"),
        (
            lambda d: {**d, "edges_s": [0.0, 1.0, 3.0] + d["edges_s"][3:]},
            "other classes or idle-age buckets",
        ),
        (
            lambda d: {**d, "classes": [{**d["classes"][0], "reuses": [-1.0] * len(EDGES)}]},
            "greater than or equal to 0",
        ),
        (lambda d: {**d, "classes": [{**d["classes"][0], "exposure_s": [1.0]}]}, "at least"),
        (lambda d: {**d, "classes": [d["classes"][0], d["classes"][0]]}, "twice"),
        (lambda d: {**d, "count_cap": 3}, "other classes"),
        (lambda d: {**d, "score_bands": 8}, "other classes"),
        (lambda d: {**d, "classes": [{**d["classes"][0], "band": 4}]}, "less than 4"),
        (lambda d: {**d, "classes": [{**d["classes"][0], "resent": 3}]}, "less than or equal to 2"),
        (lambda d: {**d, "classes": [{**d["classes"][0], "pending": "yes"}]}, "valid boolean"),
        # Each finite, but their sums would overflow every hazard to infinity.
        (
            lambda d: {**d, "classes": [{**d["classes"][0], "exposure_s": [1e308] * len(EDGES)}]},
            "less than or equal",
        ),
    ],
)
def test_a_file_this_version_did_not_write_is_refused_saying_why(
    tmp_path: Path, spoil, says: str
) -> None:
    path = tmp_path / "policy.json"
    spoilt = spoil(valid(tmp_path))
    path.write_text(spoilt if isinstance(spoilt, str) else json.dumps(spoilt))
    with pytest.raises(ValueError, match=says):
        PolicyStateFile(path).load()


def test_what_clients_said_is_kept_per_class_and_a_file_from_before_reads_as_nothing_said(
    tmp_path: Path,
) -> None:
    clock = Clock()
    ix = taught(clock)
    for n in range(20):  # contexts said to be back, and back 10 s later
        clock.now += 10.0
        ix.sight(Offer(anchor=key(5000 + n), pending=True))
        clock.now += 10.0
        ix.observe_lookup([key(5000 + n)])
    path = tmp_path / "policy.json"
    PolicyStateFile(path).save(ix.policy_learned())
    rows = {
        (row["band"], row["resent"], row["pending"])
        for row in json.loads(path.read_text())["classes"]
    }
    assert (-1, 1, True) in rows and ONE_OFF in rows
    restored = PolicyStateFile(path).load()
    assert restored is not None
    assert restored.resend_probability((-1, 0, True), 0.0, 30.0) > 5 * restored.resend_probability(
        ONE_OFF, 0.0, 30.0
    )
    # A file written before kvci classed by the client's word: every class read as nothing said.
    older = json.loads(path.read_text())
    older["classes"] = [{k: v for k, v in row.items() if k != "pending"} for row in older["classes"]
                        if row["pending"] is None]
    path.write_text(json.dumps(older))
    before = PolicyStateFile(path).load()
    assert before is not None
    assert before.counts({}).reuses.keys() == {
        cls for cls in restored.counts({}).reuses if cls[2] is None
    }


def test_restore_learns_afresh_from_a_file_it_cannot_read(tmp_path: Path, caplog) -> None:
    path = tmp_path / "policy.json"
    assert PolicyStateFile(path).restore() is None  # no file yet: nothing to report
    assert not caplog.records
    path.write_text("{}")
    with caplog.at_level(logging.WARNING):
        assert PolicyStateFile(path).restore() is None
    assert "learning the workload afresh" in caplog.text and str(path) in caplog.text
    caplog.clear()
    path.unlink()
    path.symlink_to(path)  # unreadable (a loop): an OSError, not a refusal to start
    with caplog.at_level(logging.WARNING):
        assert PolicyStateFile(path).restore() is None
    assert "learning the workload afresh" in caplog.text
    with pytest.raises(OSError):
        PolicyStateFile(path).load()
    PolicyStateFile(path).save(taught(Clock()).policy_learned())
    assert PolicyStateFile(path).restore() is not None


def test_counts_of_another_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="finite counts"):
        ReuseHazard.from_counts(HazardCounts(reuses={ONE_OFF: (1.0,)}, exposure={}))
    with pytest.raises(ValueError, match="finite counts"):
        ReuseHazard.from_counts(
            HazardCounts(reuses={}, exposure={ONE_OFF: (float("nan"),) * len(EDGES)})
        )


def test_a_write_cut_short_leaves_nothing_behind_at_the_next_start(tmp_path: Path) -> None:
    (tmp_path / ".policy.json.k3x9").write_text("half")
    (tmp_path / ".other.json.k3x9").write_text("not ours")
    PolicyStateFile(tmp_path / "policy.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.json.k3x9"]


def test_a_path_that_cannot_hold_the_file_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        PolicyStateFile(tmp_path / "missing" / "policy.json")
    with pytest.raises(ValueError, match="is a folder"):
        PolicyStateFile(tmp_path)


def test_the_saver_writes_when_due_off_the_callers_thread_and_reports_a_failed_write(
    tmp_path: Path, caplog
) -> None:
    clock = Clock(0.0)
    learned = taught(Clock()).policy_learned()
    folder = tmp_path / "state"
    folder.mkdir()
    saver = PolicyStateSaver(
        PolicyStateFile(folder / "policy.json"), lambda: learned, every_s=60.0, clock=clock
    )

    def settled() -> None:
        if saver._writing is not None:
            saver._writing.join()

    clock.now = 59.0
    saver.tick()
    settled()
    assert saver.saves == 0 and not (folder / "policy.json").exists()
    clock.now = 60.0
    saver.tick()
    assert saver._writing is not None and saver._writing.name == "kvci-policy-state"
    settled()
    assert saver.saves == 1 and PolicyStateFile(folder / "policy.json").load() is not None
    clock.now = 100.0
    saver.tick()
    settled()
    assert saver.saves == 1  # not due again until 120
    (folder / "policy.json").unlink()
    folder.rmdir()
    clock.now = 120.0
    with caplog.at_level(logging.WARNING):
        saver.tick()  # the folder is gone: reported, not raised
        settled()
    assert saver.saves == 1 and "could not save the policy state" in caplog.text
    folder.mkdir()
    saver.save()  # at shutdown: on this thread, whenever asked
    assert saver.saves == 2 and (folder / "policy.json").exists()
    with pytest.raises(ValueError, match="every_s"):
        PolicyStateSaver(PolicyStateFile(tmp_path / "p.json"), lambda: learned, every_s=0.0)


class SlowFile(PolicyStateFile):
    """A real state file whose writes wait until the test lets them through."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.release = threading.Event()
        self.started = threading.Event()

    def save(self, counts: HazardCounts) -> None:
        self.started.set()
        assert self.release.wait(10)
        super().save(counts)


def test_a_save_in_flight_is_never_doubled_and_the_shutdown_save_waits_for_it(
    tmp_path: Path,
) -> None:
    clock = Clock(0.0)
    learned = taught(Clock()).policy_learned()
    file = SlowFile(tmp_path / "policy.json")
    saver = PolicyStateSaver(file, lambda: learned, every_s=60.0, clock=clock)
    clock.now = 60.0
    saver.tick()
    assert file.started.wait(10)
    first = saver._writing
    clock.now = 200.0
    saver.tick()  # due again, but the first write is still in flight
    assert saver._writing is first and first.is_alive()
    threading.Timer(0.2, file.release.set).start()
    saver.save()  # waits for the write in flight, then writes again
    assert not first.is_alive() and saver.saves == 2


def test_a_failed_save_at_shutdown_is_reported_not_raised(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    saver = PolicyStateSaver(
        PolicyStateFile(folder / "policy.json"), lambda: taught(Clock()).policy_learned()
    )
    folder.rmdir()
    with caplog.at_level(logging.WARNING):
        saver.save()
    assert saver.saves == 0 and "could not save the policy state" in caplog.text


def test_only_the_value_policy_takes_a_state_file(tmp_path: Path) -> None:
    assert (
        KVCIConfig(policy_state_file=tmp_path / "p.json").policy_state_file == tmp_path / "p.json"
    )
    with pytest.raises(ValueError, match="'lru' learns nothing"):
        KVCIConfig(policy_state_file=tmp_path / "p.json", ram_policy="lru")
    with pytest.raises(
        ValueError, match="ram_threshold, ram_admission and ram_threshold_min choose it"
    ):
        KVCIConfig(policy_state_file=tmp_path / "p.json", ram_threshold=0.5)


def test_each_data_parallel_rank_keeps_its_own_file(tmp_path: Path) -> None:
    config = KVCIConfig(policy_state_file=tmp_path / "policy.json")
    assert config.for_data_parallel_rank(0, 1) is config
    assert config.for_data_parallel_rank(2, 4).policy_state_file == tmp_path / "policy.dp2.json"
    assert KVCIConfig().for_data_parallel_rank(2, 4).policy_state_file is None


def scheduler(path: Path) -> KVCIScheduler:
    return KVCIScheduler(
        config=KVCIConfig(ram_bytes=1 << 20, policy_state_file=path),
        block_size=32,
        slot_bytes=1 << 16,
        namespace=hashlib.sha256(b"state").digest(),
        secret=b"s" * 32,
        tp_size=1,
        tenants=TenantResolver(None),
        disk=None,
    )


def test_the_scheduler_saves_at_shutdown_and_the_next_one_starts_from_it(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    first = scheduler(path)
    index = first.manager.index
    for n in range(50):  # one context re-sent again and again, and one-offs
        index.observe_lookup([key(1), key(2)])
        index.sight(Offer(anchor=key(2)))
        index.observe_lookup([key(100 + n)])
        index.sight(Offer(anchor=key(100 + n)))
    assert not path.exists() and not first.policy_restored
    first.shutdown()
    learned = PolicyStateFile(path).load()
    assert learned is not None
    second = scheduler(path)
    assert second.policy_restored
    policy = second.manager.index._policy
    assert isinstance(policy, ValuePolicy)
    assert probabilities(policy.reuse_hazard(0.0)) == pytest.approx(probabilities(learned))
    assert probabilities(learned) != pytest.approx(probabilities(ReuseHazard()))
