from __future__ import annotations

import enum
import hashlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin import ops
from kvci_plugin.tiering.keys import NAMESPACE_BYTES, namespace_fingerprint

BASE: dict[str, object] = {
    "model_id": "tiny",
    "model_config": {"b": 1, "a": [1.5, None, True, "x"]},
    "weights_fingerprint": "abc",
    "kv_cache_dtype": "bfloat16",
    "block_size": 32,
    "kv_layout": "LBHNC",
    "tp_rank": 0,
    "tp_size": 1,
}


def fingerprint(**change: object) -> bytes:
    return namespace_fingerprint(**{**BASE, **change})  # type: ignore[arg-type]


def test_pinned_encoding() -> None:
    # The canonical document, written out by hand: changing it needs a new NAMESPACE_FORMAT.
    document = (
        '{"block_size":32,"format":"kvci-namespace-v1","key_format":"kvci-key-v1",'
        '"kv_cache_dtype":"bfloat16","kv_layout":"LBHNC",'
        '"model_config":{"a":[1.5,null,true,"x"],"b":1},"model_id":"tiny",'
        '"tp_rank":0,"tp_size":1,"weights_fingerprint":"abc"}'
    )
    expected = "1f0eee303fab29a0ec22cce1f479bc3de39e2702620647f5e0f4e1704da67ced"
    assert hashlib.sha256(document.encode()).hexdigest() == expected
    assert fingerprint().hex() == expected
    assert len(fingerprint()) == NAMESPACE_BYTES


CHANGES = [
    {"model_id": "tiny2"},
    {"model_config": {"b": 2, "a": [1.5, None, True, "x"]}},
    {"model_config": {"b": 1, "a": [1.5, None, True, "x"], "c": None}},
    {"model_config": {"b": 1, "a": [None, 1.5, True, "x"]}},
    {"weights_fingerprint": "abd"},
    {"kv_cache_dtype": "float16"},
    {"block_size": 16},
    {"kv_layout": "NHD"},
    {"tp_rank": 1, "tp_size": 2},
    {"tp_size": 2},
]


@pytest.mark.parametrize("change", CHANGES)
def test_every_component_changes_the_namespace_and_every_key(change: dict[str, object]) -> None:
    assert fingerprint(**change) != fingerprint()
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(96)]
    secret = b"s" * 32
    before = ops.prefix_block_keys(tokens, 32, fingerprint(), "t", secret)
    after = ops.prefix_block_keys(tokens, 32, fingerprint(**change), "t", secret)
    assert all(not torch.equal(before[i], after[i]) for i in range(3))


def test_all_changes_are_distinct() -> None:
    prints = {fingerprint(**change) for change in CHANGES} | {fingerprint()}
    assert len(prints) == len(CHANGES) + 1


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


def reordered(value: object, rng: random.Random) -> object:
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: reordered(item, rng) for key, item in items}
    if isinstance(value, list):
        return [reordered(item, rng) for item in value]
    return value


@settings(max_examples=100, deadline=None)
@given(config=st.dictionaries(st.text(max_size=5), json_values, max_size=6), seed=st.integers())
def test_key_order_does_not_matter(config: dict[str, object], seed: int) -> None:
    shuffled = reordered(config, random.Random(seed))
    assert fingerprint(model_config=shuffled) == fingerprint(model_config=config)


@pytest.mark.parametrize(
    "values",
    [
        [1, 1.0, True, "1", [1], {"1": 1}, None, 0, False, 0.0, -0.0, "", []],
        [[1, 2], [2, 1], [[1], 2], [1, [2]]],
        [{"a": {"b": 1}}, {"a": {"b": "1"}}, {"a.b": 1}, {"a": [{"b": 1}]}],
    ],
)
def test_values_of_different_shape_or_type_differ(values: list[object]) -> None:
    prints = {fingerprint(model_config={"v": value}) for value in values}
    assert len(prints) == len(values)


class Colour(enum.IntEnum):
    RED = 1


def refer_to_itself() -> dict[str, object]:
    config: dict[str, object] = {"a": []}
    config["a"].append(config)  # type: ignore[attr-defined]
    return config


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"x": float("nan")}, ValueError, r"model_config\['x'\] is nan: non-finite"),
        ({"x": [float("inf")]}, ValueError, r"model_config\['x'\]\[0\] is inf"),
        ({"x": len}, TypeError, r"model_config\['x'\] is a builtin_function_or_method"),
        ({"x": lambda: 0}, TypeError, "is a function, which cannot be encoded"),
        ({"x": object()}, TypeError, "is a object, which cannot be encoded"),
        ({"x": b"raw"}, TypeError, "is a bytes"),
        ({"x": {1, 2}}, TypeError, "is a set"),
        ({"x": Colour.RED}, TypeError, "is a Colour"),
        ({"x": {1: "a"}}, TypeError, r"model_config\['x'\] has a key of type int"),
        (refer_to_itself(), ValueError, "contains itself"),
        ([("a", 1)], TypeError, "model_config must be a mapping"),
    ],
)
def test_unencodable_config_is_refused(config: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fingerprint(model_config=config)


def test_a_shared_value_is_not_a_cycle() -> None:
    shared = [1, 2]
    assert fingerprint(model_config={"a": shared, "b": shared}) == fingerprint(
        model_config={"a": [1, 2], "b": [1, 2]}
    )


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"model_id": ""}, ValueError, "model_id must not be empty"),
        ({"model_id": None}, TypeError, "model_id must be a str"),
        ({"weights_fingerprint": ""}, ValueError, "weights_fingerprint must not be empty"),
        ({"kv_cache_dtype": torch.bfloat16}, TypeError, "kv_cache_dtype must be a str"),
        ({"kv_layout": ""}, ValueError, "kv_layout must not be empty"),
        ({"block_size": 0}, ValueError, "block_size must be at least 1"),
        ({"block_size": True}, TypeError, "block_size must be an int"),
        ({"tp_rank": -1}, ValueError, "tp_rank must be at least 0"),
        ({"tp_size": 0}, ValueError, "tp_size must be at least 1"),
        ({"tp_rank": 2, "tp_size": 2}, ValueError, r"tp_rank must be below tp_size \(2\)"),
    ],
)
def test_bad_components_are_refused(change: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fingerprint(**change)
