"""RAMIndex reads that never walk the index: a checkpoint by id, its meta, the counts of stats."""

from __future__ import annotations

from kvci_plugin.tiering.ram.index import RAMIndex

SLOT = 64


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(16, "big") for i in ids]


def test_find_reads_a_checkpoint_of_any_tenant_by_id_and_none_when_not_held() -> None:
    index = RAMIndex(num_slots=8, slot_bytes=SLOT, max_entries=8)
    index.reserve("a", "t", keys(1, 2), meta={"trigger": "system"})
    found = index.find("a")
    assert found is not None and found.tenant == "t" and found.pending
    assert found.meta["trigger"] == "system" and not found.complete
    index.commit("a")
    assert index.find("a").complete  # type: ignore[union-attr]
    assert index.find("b") is None


class _Opaque:
    """A meta value marshal cannot pack: kept as given."""


def test_meta_round_trips_plain_values_and_keeps_others_as_given() -> None:
    index = RAMIndex(num_slots=8, slot_bytes=SLOT, max_entries=8)
    rec = {"score": 0.5, "reasons": ["a", "b"], "nested": {"x": None, "y": (1, 2)}, "ok": True}
    index.reserve("a", "t", keys(1), meta={"recommendation": rec})
    assert index.get("a", "t").meta["recommendation"] == rec
    # A read is a copy: changing it changes nothing held.
    index.get("a", "t").meta["recommendation"]["score"] = 1.0
    assert index.get("a", "t").meta["recommendation"]["score"] == 0.5
    opaque = _Opaque()
    index.set_meta("a", refusal=opaque)
    meta = index.get("a", "t").meta
    assert meta["refusal"] is opaque and meta["recommendation"] == rec


def test_stats_count_pending_entries_and_pinned_pages_as_they_change() -> None:
    index = RAMIndex(num_slots=8, slot_bytes=SLOT, max_entries=8)
    index.reserve("a", "t", keys(1, 2, 3))
    index.reserve("b", "t", keys(1, 2, 4))
    assert index.stats().pending_entries == 2
    index.commit("a")
    index.abort("b")
    assert index.stats().pending_entries == 0
    index.pin(keys(1, 2), "t")
    index.pin(keys(1), "t")
    assert index.stats().pinned_pages == 2
    index.unpin(keys(1, 2))
    assert index.stats().pinned_pages == 1
    index.unpin(keys(1))
    assert index.stats().pinned_pages == 0
