from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin.governance import (
    LABEL_AXES,
    CatalogLabelResolver,
    Classification,
    SourceContribution,
    SourceLabels,
    UnlabelledResolver,
    compose_labels,
)


def test_classification_is_ordered() -> None:
    ordered = [
        Classification.PUBLIC,
        Classification.INTERNAL,
        Classification.CONFIDENTIAL,
        Classification.RESTRICTED,
    ]
    assert sorted(reversed(ordered)) == ordered
    assert Classification.INTERNAL < Classification.CONFIDENTIAL <= Classification.CONFIDENTIAL
    assert max(ordered) is Classification.RESTRICTED
    with pytest.raises(ValueError, match="expected one of PUBLIC, INTERNAL"):
        Classification.parse("SECRET")


def test_composition_is_most_restrictive() -> None:
    composed = compose_labels(
        {
            "a": SourceLabels(
                classification="INTERNAL",
                residency_regions=["eu", "us"],
                retention_days=90,
                mandatory_markings=["pii"],
            ),
            "b": SourceLabels(
                classification="CONFIDENTIAL",
                residency_regions=["eu", "apac"],
                retention_days=30,
                mandatory_markings=["hr"],
            ),
        }
    )
    assert composed.classification is Classification.CONFIDENTIAL
    assert composed.residency_regions == {"eu"}
    assert composed.retention_days == 30
    assert composed.mandatory_markings == {"pii", "hr"}
    assert composed.derived_axes == ()


def test_public_derives_unrestricted_residency_and_no_retention_limit_and_says_so() -> None:
    composed = compose_labels({"doc": SourceLabels(classification="PUBLIC", mandatory_markings=[])})
    assert composed.residency_regions is None
    assert composed.retention_days is None
    assert composed.derived_axes == (
        "residency_regions: unrestricted (PUBLIC source 'doc')",
        "retention_days: no limit (PUBLIC source 'doc')",
    )


def test_public_derivation_never_overrides_a_declaration() -> None:
    contribution = SourceContribution.of(
        "doc",
        SourceLabels(
            classification="PUBLIC",
            residency_regions=["eu"],
            retention_days=7,
            mandatory_markings=[],
        ),
    )
    assert contribution.derived_axes == ()
    composed = compose_labels({"doc": contribution.labels})
    assert (composed.residency_regions, composed.retention_days) == ({"eu"}, 7)


def test_public_source_with_a_restricted_one_keeps_the_restriction() -> None:
    composed = compose_labels(
        {
            "open": SourceLabels(classification="PUBLIC", mandatory_markings=[]),
            "closed": SourceLabels(
                classification="INTERNAL",
                residency_regions=["us"],
                retention_days=5,
                mandatory_markings=[],
            ),
        }
    )
    assert (composed.residency_regions, composed.retention_days) == ({"us"}, 5)
    assert composed.classification is Classification.INTERNAL


@pytest.mark.parametrize("axis", LABEL_AXES)
def test_an_undeclared_axis_does_not_compose(axis: str) -> None:
    labels = SourceLabels(
        classification="INTERNAL", residency_regions=["eu"], retention_days=1, mandatory_markings=[]
    ).model_copy(update={axis: None})
    assert SourceContribution.of("s", labels).missing_labels == (axis,)
    with pytest.raises(ValueError, match=f"'s' lacks {axis}"):
        compose_labels({"s": labels})


def test_nothing_to_compose_and_unlabelled_sources_refuse() -> None:
    with pytest.raises(ValueError, match="no sources"):
        compose_labels({})
    assert SourceContribution.of("s", None).missing_labels == LABEL_AXES
    # A PUBLIC classification derives residency and retention only: markings stay required.
    assert SourceContribution.of("s", SourceLabels(classification="PUBLIC")).missing_labels == (
        "mandatory_markings",
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"retention_days": -1},
        {"retention_days": 1.5},
        {"retention_days": True},
        {"classification": "SECRET"},
        {"residency_regions": [" eu"]},
        {"residency": ["eu"]},
    ],
)
def test_invalid_labels_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SourceLabels.model_validate(bad)


_labels = st.builds(
    SourceLabels,
    classification=st.sampled_from(Classification),
    residency_regions=st.frozensets(st.sampled_from(["eu", "us", "apac"])),
    retention_days=st.integers(0, 400),
    mandatory_markings=st.frozensets(st.sampled_from(["pii", "hr", "finance"])),
)


@settings(max_examples=150, deadline=None)
@given(base=st.lists(_labels, min_size=1, max_size=4), extra=_labels)
def test_adding_a_source_never_relaxes_the_composed_label(
    base: list[SourceLabels], extra: SourceLabels
) -> None:
    before = compose_labels({f"s{i}": labels for i, labels in enumerate(base)})
    after = compose_labels({**{f"s{i}": labels for i, labels in enumerate(base)}, "extra": extra})
    assert after.classification >= before.classification
    assert (before.residency_regions is None) or (
        after.residency_regions is not None and after.residency_regions <= before.residency_regions
    )
    assert before.retention_days is None or (
        after.retention_days is not None and after.retention_days <= before.retention_days
    )
    assert after.mandatory_markings >= before.mandatory_markings


def test_unlabelled_resolver_answers_every_source_unlabelled() -> None:
    assert UnlabelledResolver().resolve(["a", "b"]) == {"a": None, "b": None}


def test_catalog_resolves_set_and_imported_labels(tmp_path: Path) -> None:
    catalog = CatalogLabelResolver(tmp_path / "labels.db")
    catalog.set_labels(
        "a",
        SourceLabels(
            classification="INTERNAL",
            residency_regions=["eu"],
            retention_days=3,
            mandatory_markings=[],
        ),
    )
    document = {"b": {"classification": "PUBLIC", "mandatory_markings": ["pii"]}}
    (tmp_path / "labels.json").write_text(json.dumps(document))
    assert catalog.import_json(tmp_path / "labels.json") == 1
    assert catalog.import_json({"c": {"classification": "RESTRICTED"}}) == 1

    resolved = CatalogLabelResolver(tmp_path / "labels.db").resolve(["a", "b", "c", "unknown"])
    assert list(resolved) == ["a", "b", "c", "unknown"]
    assert resolved["a"] == SourceLabels(
        classification="INTERNAL", residency_regions=["eu"], retention_days=3, mandatory_markings=[]
    )
    assert resolved["b"] == SourceLabels(classification="PUBLIC", mandatory_markings=["pii"])
    assert resolved["c"] == SourceLabels(classification="RESTRICTED")  # partial labels stay partial
    assert resolved["unknown"] is None
    assert catalog.remove("a") and not catalog.remove("a")
    assert catalog.resolve(["a"]) == {"a": None}


def test_catalog_import_is_all_or_nothing(tmp_path: Path) -> None:
    catalog = CatalogLabelResolver(tmp_path / "labels.db")
    with pytest.raises(ValueError, match="'bad'"):
        catalog.import_json(
            {"good": {"classification": "PUBLIC"}, "bad": {"classification": "SECRET"}}
        )
    assert catalog.resolve(["good"]) == {"good": None}
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(TypeError, match="object mapping source id"):
        catalog.import_json(tmp_path / "list.json")


def test_catalog_answers_many_sources_without_omitting_any(tmp_path: Path) -> None:
    catalog = CatalogLabelResolver(tmp_path / "labels.db")
    catalog.import_json(
        {f"s{i}": {"classification": "PUBLIC", "mandatory_markings": []} for i in range(0, 1500, 2)}
    )
    resolved = catalog.resolve([f"s{i}" for i in range(1500)])
    assert len(resolved) == 1500
    assert all(
        (labels is not None) == (int(source[1:]) % 2 == 0) for source, labels in resolved.items()
    )


def test_a_malformed_row_reads_as_unlabelled_not_omitted(tmp_path: Path) -> None:
    path = tmp_path / "labels.db"
    catalog = CatalogLabelResolver(path)
    catalog.import_json({"fine": {"classification": "PUBLIC", "mandatory_markings": []}})
    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO source_labels VALUES ('typo', 'CONFIDENTAIL', NULL, NULL, NULL, 0, NULL)"
        )
        conn.execute(
            "INSERT INTO source_labels VALUES ('broken', 'INTERNAL', '[eu', 30, '[]', 0, NULL)"
        )
        conn.execute(
            "INSERT INTO source_labels VALUES ('owners', 'PUBLIC', NULL, NULL, '[]', 0, '[x')"
        )
    conn.close()
    resolved = catalog.resolve(["fine", "typo", "broken", "owners"], "acme")
    assert resolved["fine"] is not None
    assert resolved == {"fine": resolved["fine"], "typo": None, "broken": None, "owners": None}


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_an_unreadable_catalog_answers_every_source_unlabelled(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "labels.db"
    catalog = CatalogLabelResolver(path)
    catalog.import_json({"a": {"classification": "PUBLIC", "mandatory_markings": []}})
    if damage == "corrupt":
        path.write_bytes(b"\0garbage" * 512)
    else:
        path.unlink()
    assert catalog.resolve(["a", "b"]) == {"a": None, "b": None}
    if damage == "delete":
        assert not path.exists()  # a read never recreates a missing catalog


def test_a_source_of_another_tenant_is_unlabelled_and_its_labels_never_told(tmp_path: Path) -> None:
    """The review's oracle: a persist reply echoed the labels of any source named. Labels are
    resolved within the caller's tenancy; a source that names no tenant is shared."""
    catalog = CatalogLabelResolver(tmp_path / "labels.db")
    catalog.import_json({
        "doc:acme-plan": {"classification": "CONFIDENTIAL", "residency_regions": ["eu"],
                          "retention_days": 30, "mandatory_markings": ["m-secret"],
                          "tenants": ["acme"]},
        "doc:handbook": {"classification": "PUBLIC", "mandatory_markings": []},
    })
    mine = catalog.resolve(["doc:acme-plan", "doc:handbook"], "acme")
    theirs = catalog.resolve(["doc:acme-plan", "doc:handbook"], "mallory")
    assert mine["doc:acme-plan"] is not None and mine["doc:handbook"] is not None
    assert theirs == {"doc:acme-plan": None, "doc:handbook": mine["doc:handbook"]}
    assert catalog.resolve(["doc:acme-plan"]) == {"doc:acme-plan": None}  # no tenant: no owner's
    with pytest.raises(ValueError, match="tenant name"):
        catalog.import_json({"bad": {"classification": "PUBLIC", "tenants": ["acme corp"]}})


def test_a_catalog_from_before_owners_is_read_with_every_source_shared(tmp_path: Path) -> None:
    path = tmp_path / "labels.db"
    with sqlite3.connect(path) as conn:  # the first release's table, without `tenants`
        conn.execute("CREATE TABLE source_labels (source_id TEXT PRIMARY KEY, classification TEXT,"
                     " residency_regions TEXT, retention_days INTEGER, mandatory_markings TEXT,"
                     " updated_at REAL NOT NULL)")
        conn.execute("INSERT INTO source_labels VALUES ('old', 'PUBLIC', NULL, NULL, '[]', 0)")
    conn.close()
    assert CatalogLabelResolver(path).resolve(["old"], "acme")["old"] is not None
