"""The gate's monotonicity and absence properties, over generated labels (hypothesis)."""

from __future__ import annotations

from governance_support import TENANT, DictResolver, session_token
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from kvci_plugin.governance import (
    CHECK_ORDER,
    LABEL_AXES,
    Classification,
    CredentialIssuer,
    CredentialVerifier,
    DerivedAuthorityGate,
    EligibilityDecision,
    PersistenceRequest,
    SourceLabels,
)

# The default session_token() authority: clearance CONFIDENTIAL, markings {pii, finance},
# regions {eu, us}. The strategies straddle it so that both verdicts are common.

# Fully labelled, non-PUBLIC (so nothing is derived) and dominated by the default session in eu.
_permitted_labels = st.builds(
    SourceLabels,
    classification=st.sampled_from([Classification.INTERNAL, Classification.CONFIDENTIAL]),
    residency_regions=st.frozensets(st.sampled_from(["us", "apac"])).map(
        lambda regions: regions | {"eu"}
    ),
    retention_days=st.integers(1, 400),
    mandatory_markings=st.frozensets(st.sampled_from(["pii", "finance"])),
)


def _maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    # Undeclared one time in four: often enough to refuse, rarely enough to leave whole labels.
    return st.one_of(st.none(), strategy, strategy, strategy)


_any_labels = st.builds(
    SourceLabels,
    classification=_maybe(st.sampled_from(Classification)),
    residency_regions=_maybe(st.frozensets(st.sampled_from(["eu", "us"]))),
    retention_days=_maybe(st.integers(0, 60)),
    mandatory_markings=_maybe(st.frozensets(st.sampled_from(["pii", "finance", "hr"]), max_size=1)),
)
# Half the sources are ones the session may persist in eu, so permits are common enough for the
# monotonicity property to bite; the rest are anything, unlabelled included.
_source = st.one_of(_permitted_labels, _permitted_labels, _any_labels, st.none())
_region = st.sampled_from(["eu", "eu", "us", None])


def _evaluate(
    verifier: CredentialVerifier, token: str, labels: list[SourceLabels | None], region: str | None
) -> EligibilityDecision:
    ids = [f"src-{index}" for index in range(len(labels))]
    gate = DerivedAuthorityGate(
        verifier, DictResolver(dict(zip(ids, labels, strict=True))), durable_store_region=region
    )
    request = PersistenceRequest(
        checkpoint_id="ckpt",
        tenant=TENANT,
        trigger="system",
        session_token=token,
        source_ids=tuple(ids),
    )
    return gate.evaluate(request)


def _verdict(decision: EligibilityDecision) -> str:
    return "permitted" if decision.permitted else "refused"


@settings(max_examples=150, deadline=None)
@given(
    base=st.lists(_source, min_size=1, max_size=3),
    extra=_source,
    position=st.integers(0, 3),
    region=_region,
)
def test_adding_a_source_never_turns_a_refusal_into_a_permit(
    issuer: CredentialIssuer,
    plain_verifier: CredentialVerifier,
    base: list[SourceLabels | None],
    extra: SourceLabels | None,
    position: int,
    region: str | None,
) -> None:
    token = session_token(issuer)
    before = _evaluate(plain_verifier, token, base, region)
    more = [*base[:position], extra, *base[position:]]
    after = _evaluate(plain_verifier, token, more, region)
    note(f"before: {before.reason}\nafter: {after.reason}")
    event(f"before {_verdict(before)}, after {_verdict(after)}")
    assert before.permitted or not after.permitted
    if after.permitted:
        # A permit over more sources never keeps the copy longer than one over fewer.
        assert before.retention_expiry is None or (
            after.retention_expiry is not None
            and after.retention_expiry - after.evaluated_at
            <= before.retention_expiry - before.evaluated_at
        )


@settings(max_examples=150, deadline=None)
@given(sources=st.lists(_permitted_labels, min_size=1, max_size=4), data=st.data())
def test_removing_any_label_from_any_source_refuses_and_names_it(
    issuer: CredentialIssuer,
    plain_verifier: CredentialVerifier,
    sources: list[SourceLabels],
    data: st.DataObject,
) -> None:
    token = session_token(issuer)
    assert _evaluate(plain_verifier, token, list(sources), "eu").permitted

    index = data.draw(st.integers(0, len(sources) - 1), label="source")
    axis = data.draw(st.sampled_from([*LABEL_AXES, "all"]), label="axis")
    damaged: list[SourceLabels | None] = list(sources)
    damaged[index] = None if axis == "all" else sources[index].model_copy(update={axis: None})

    decision = _evaluate(plain_verifier, token, damaged, "eu")
    assert not decision.permitted
    assert decision.failed_check == "labels_present"
    record = decision.derivation.checks[CHECK_ORDER.index("labels_present")]
    assert record.name == "labels_present"
    assert record.sources == (f"src-{index}",)
    assert f"src-{index}" in decision.reason
    if axis == "all":
        assert record.labels == LABEL_AXES
    else:
        assert record.labels == (axis,)
        assert axis in decision.reason
