"""What became of the engine's automatic retentions (#49): a hit when the session's next request
loads a retained block, an expiry when the TTL ends first; a reset ends them as neither."""

from __future__ import annotations

from kvci_plugin.connector.auto_retentions import AutoRetentions, ram_loaded
from kvci_plugin.connector.request_state import HitTier, RequestState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_the_sessions_next_request_loading_a_retained_block_is_a_hit() -> None:
    auto = AutoRetentions(Clock())
    auto.granted("c1", "acme", "s-1", [key(0), key(1), key(2)], 30.0)
    assert auto.returned("acme", "s-2", [key(1)]) == 0  # another session: still held
    assert auto.returned("other", "s-1", [key(1)]) == 0  # another tenant's session of that name
    assert auto.returned("acme", "s-1", [key(2), key(3)]) == 1
    assert len(auto) == 0 and auto.expire() == 0


def test_a_return_loading_nothing_retained_ends_it_without_a_hit() -> None:
    clock = Clock()
    auto = AutoRetentions(clock)
    auto.granted("c1", "acme", "s-1", [key(0)], 30.0)
    assert auto.returned("acme", "s-1", []) == 0
    clock.now += 60
    assert auto.expire() == 0  # ended by the return, not by its TTL


def test_a_ttl_that_ends_first_is_an_expiry_once() -> None:
    clock = Clock()
    auto = AutoRetentions(clock)
    auto.granted("c1", "acme", "s-1", [key(0)], 10.0)
    auto.granted("c2", "acme", None, [key(5)], 20.0)  # no session: only its TTL ends it
    clock.now += 15
    assert auto.expire() == 1
    clock.now += 10
    assert auto.expire() == 1 and auto.expire() == 0
    assert auto.returned("acme", "s-1", [key(0)]) == 0


def test_a_reset_ends_them_as_neither() -> None:
    clock = Clock()
    auto = AutoRetentions(clock)
    auto.granted("c1", "acme", "s-1", [key(0)], 10.0)
    auto.clear()
    clock.now += 60
    assert auto.expire() == 0 and auto.returned("acme", "s-1", [key(0)]) == 0


def state(**fields: object) -> RequestState:
    return RequestState(params=None, error=None, tenant="acme", key_tenant="acme",
                        keys=[key(i) for i in range(4)], pool="p", **fields)  # type: ignore[arg-type]


def test_ram_loaded_is_the_run_kvci_loads_from_ram() -> None:
    assert ram_loaded(state(local_tokens=32, ext_tokens=64, hit_tier=HitTier.RAM), 32) == [
        key(1), key(2)]
    assert ram_loaded(state(local_tokens=0, ext_tokens=64, hit_tier=HitTier.DISK), 32) == ()
    assert ram_loaded(state(local_tokens=64, ext_tokens=0), 32) == ()
