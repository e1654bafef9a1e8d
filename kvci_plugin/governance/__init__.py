"""Governance: verified authority, delegation ceilings, source labels and the deny-by-default
persistence eligibility gate (pydantic, PyJWT, sqlite3; no torch, no vLLM)."""

from kvci_plugin.governance.always_deny import AlwaysDenyEligibility
from kvci_plugin.governance.authority import EffectiveAuthority, derive_effective_authority
from kvci_plugin.governance.catalog import CatalogLabelResolver
from kvci_plugin.governance.classification import Classification
from kvci_plugin.governance.credential_config import CredentialAlgorithm, CredentialConfig
from kvci_plugin.governance.credential_error import CredentialError, CredentialErrorReason
from kvci_plugin.governance.credentials import DelegationCeiling, PolicyVersion, VerifiedSession
from kvci_plugin.governance.decision import (
    CheckRecord,
    CheckVerdict,
    EligibilityDecision,
    PersistenceDerivation,
)
from kvci_plugin.governance.derived_gate import DerivedAuthorityGate
from kvci_plugin.governance.eligibility import CHECK_ORDER, PersistenceEligibilityGate
from kvci_plugin.governance.erasure import FORGET_SCOPE, ForgetRefusedError, authorize_forget
from kvci_plugin.governance.issuer import CredentialIssuer
from kvci_plugin.governance.keys import (
    KeyFileError,
    load_signing_key,
    load_verification_key,
    write_ed25519_key_pair,
    write_hmac_key_file,
)
from kvci_plugin.governance.label_resolver import SourceLabelResolver, UnlabelledResolver
from kvci_plugin.governance.labels import (
    LABEL_AXES,
    ComposedLabel,
    SourceContribution,
    SourceLabels,
    compose_contributions,
    compose_labels,
)
from kvci_plugin.governance.request import PersistenceRequest, Trigger
from kvci_plugin.governance.revocation import RevocationList
from kvci_plugin.governance.seams import (
    get_persistence_eligibility_gate,
    get_source_label_resolver,
    set_persistence_eligibility_gate,
    set_source_label_resolver,
)
from kvci_plugin.governance.verifier import CredentialVerifier

__all__ = [
    "CHECK_ORDER",
    "FORGET_SCOPE",
    "LABEL_AXES",
    "AlwaysDenyEligibility",
    "CatalogLabelResolver",
    "CheckRecord",
    "CheckVerdict",
    "Classification",
    "ComposedLabel",
    "CredentialAlgorithm",
    "CredentialConfig",
    "CredentialError",
    "CredentialErrorReason",
    "CredentialIssuer",
    "CredentialVerifier",
    "DelegationCeiling",
    "DerivedAuthorityGate",
    "EffectiveAuthority",
    "EligibilityDecision",
    "ForgetRefusedError",
    "KeyFileError",
    "PersistenceDerivation",
    "PersistenceEligibilityGate",
    "PersistenceRequest",
    "PolicyVersion",
    "RevocationList",
    "SourceContribution",
    "SourceLabelResolver",
    "SourceLabels",
    "Trigger",
    "UnlabelledResolver",
    "VerifiedSession",
    "authorize_forget",
    "compose_contributions",
    "compose_labels",
    "derive_effective_authority",
    "get_persistence_eligibility_gate",
    "get_source_label_resolver",
    "load_signing_key",
    "load_verification_key",
    "set_persistence_eligibility_gate",
    "set_source_label_resolver",
    "write_ed25519_key_pair",
    "write_hmac_key_file",
]
