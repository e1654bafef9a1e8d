"""Code seams, not configuration: the gate and label resolver in force for this process.

Widening what may be written to disk takes code that someone writes and reviews; there is no
environment variable, flag or config key for it.
"""

from __future__ import annotations

import threading

from kvci_plugin.governance.always_deny import AlwaysDenyEligibility
from kvci_plugin.governance.eligibility import PersistenceEligibilityGate
from kvci_plugin.governance.label_resolver import SourceLabelResolver, UnlabelledResolver

_lock = threading.Lock()
_gate: PersistenceEligibilityGate = AlwaysDenyEligibility()
_resolver: SourceLabelResolver = UnlabelledResolver()


def set_persistence_eligibility_gate(
    gate: PersistenceEligibilityGate,
) -> PersistenceEligibilityGate:
    """Install `gate` for every later persistence decision; returns the gate it replaces."""
    global _gate
    if not isinstance(gate, PersistenceEligibilityGate) or not isinstance(gate.name, str):
        raise TypeError(
            f"gate must implement PersistenceEligibilityGate (name: str, evaluate), got {gate!r}"
        )
    with _lock:
        previous, _gate = _gate, gate
    return previous


def get_persistence_eligibility_gate() -> PersistenceEligibilityGate:
    return _gate


def set_source_label_resolver(resolver: SourceLabelResolver) -> SourceLabelResolver:
    """Install `resolver` for gates built without their own; returns the resolver it replaces."""
    global _resolver
    if not isinstance(resolver, SourceLabelResolver):
        raise TypeError(f"resolver must implement SourceLabelResolver (resolve), got {resolver!r}")
    with _lock:
        previous, _resolver = _resolver, resolver
    return previous


def get_source_label_resolver() -> SourceLabelResolver:
    return _resolver
