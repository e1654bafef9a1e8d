from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvci_plugin import ops
from kvci_plugin.ops._native import kvci_ops

from .gil_probe import spins_while
from .reference_keys import MAX_TOKEN_ID, reference_prefix_keys

REPO_ROOT = Path(__file__).resolve().parents[2]

NAMESPACE = bytes(range(32))
SECRET = bytes(range(100, 132))

token_lists = st.lists(st.integers(0, MAX_TOKEN_ID), max_size=256)
namespaces = st.binary(min_size=1, max_size=48)
tenants = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
secrets_ = st.binary(min_size=16, max_size=48)


def native_hex(*args: object) -> list[str]:
    keys = ops.key_bytes(ops.prefix_block_keys(*args))
    if isinstance(args[0], list) and all(type(t) is int for t in args[0]):
        # The scheduler's path, straight from a list to the 16-byte keys, gives the same keys.
        assert ops.prefix_key_list(*args) == keys  # type: ignore[arg-type]
    return [key.hex() for key in keys]


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(MAX_TOKEN_ID + 1) for _ in range(n)]


# Fixed inputs -> keys produced by the pure-Python reference (itself checked against the SipHash
# vectors). A change here is a change of the key format: it needs a new KEY_FORMAT.
PINNED = [
    (
        (list(range(64)), 16, bytes(range(32)), "tenant-a", bytes(range(100, 132))),
        [
            "41b404216890637a0ca1aa50e59be9bd",
            "c0c65a39659ee6e5629d27e2cc66fffa",
            "f239bfb3fe29eb626933543a1f156040",
            "e5ffe678280530e08f9456d61313bd9d",
        ],
    ),
    (
        ([0, 1, 2**31 - 1, 7, 123456789] * 7, 5, b"\xff" * 32, "t\u00e9nant", b"k" * 16),
        [
            "920055530a119ba4a322b14a26078f9f",
            "8b5d7592b681615a937f672dbd257199",
            "a48821d5357fed789d8d23a2d98d3e9d",
            "0cca2f242bb2deef84b1be14d64dc4e8",
            "0cc0b36f4c00208c757f79157733396e",
            "b31843e4e9ec57d74ea94c984d32b3dd",
            "642a53aa459375048cf2858cee0b975d",
        ],
    ),
    (
        ([2**31 - 1, 0, 42], 1, b"ns", "x", bytes(16)),
        [
            "1945ac19bdcc8ae8777eb8af6c4eaf46",
            "99361f28af24dbba562102b4867cde9a",
            "0a10d7ee955e86ced3560c8c9728bca7",
        ],
    ),
]


def test_key_format_is_versioned() -> None:
    assert ops.KEY_FORMAT == "kvci-key-v1"


@pytest.mark.parametrize(("args", "expected"), PINNED)
def test_pinned_vectors(args: tuple, expected: list[str]) -> None:
    assert [k.hex() for k in reference_prefix_keys(*args)] == expected
    tokens, *rest = args
    assert native_hex(tokens, *rest) == expected
    assert native_hex(torch.tensor(tokens, dtype=torch.int32), *rest) == expected


@settings(max_examples=80, deadline=None)
@given(
    tokens=token_lists,
    block_size=st.integers(1, 40),
    namespace=namespaces,
    tenant=tenants,
    secret=secrets_,
)
def test_native_keys_equal_reference(
    tokens: list[int], block_size: int, namespace: bytes, tenant: str, secret: bytes
) -> None:
    expected = [
        k.hex() for k in reference_prefix_keys(tokens, block_size, namespace, tenant, secret)
    ]
    assert len(expected) == len(tokens) // block_size
    args = (block_size, namespace, tenant, secret)
    assert native_hex(tokens, *args) == expected
    assert native_hex(torch.tensor(tokens, dtype=torch.int64), *args) == expected
    assert native_hex(torch.tensor(tokens, dtype=torch.int32), *args) == expected


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
def test_many_blocks_equal_reference(block_size: int) -> None:
    # Enough blocks for the SIMD pipeline, then a scalar tail.
    tokens = random_tokens(block_size * 70 + block_size // 2, seed=block_size)
    expected = [k.hex() for k in reference_prefix_keys(tokens, block_size, NAMESPACE, "t", SECRET)]
    assert native_hex(tokens, block_size, NAMESPACE, "t", SECRET) == expected


def test_long_prompt_keys_are_prefix_consistent() -> None:
    # Each length leaves the SIMD pipeline at another block: a prefix's keys must not change.
    tokens = torch.tensor(random_tokens(40_000, seed=7), dtype=torch.int32)
    full = ops.prefix_block_keys(tokens, 16, NAMESPACE, "t", SECRET)
    assert full.shape == (2500, 2)
    for n_blocks in (1, 9, 700, 1251, 2499):
        prefix = ops.prefix_block_keys(tokens[: n_blocks * 16 + 5], 16, NAMESPACE, "t", SECRET)
        assert torch.equal(prefix, full[:n_blocks])
    head = reference_prefix_keys(tokens[:160].tolist(), 16, NAMESPACE, "t", SECRET)
    assert ops.key_bytes(full[:10]) == head


def test_partial_block_gets_no_key() -> None:
    tokens = random_tokens(50, seed=1)
    assert ops.prefix_block_keys(tokens[:15], 16, NAMESPACE, "t", SECRET).shape == (0, 2)
    keys = ops.prefix_block_keys(tokens, 16, NAMESPACE, "t", SECRET)
    assert keys.shape == (3, 2) and keys.dtype == torch.uint64
    assert torch.equal(keys, ops.prefix_block_keys(tokens[:48], 16, NAMESPACE, "t", SECRET))


def test_any_sequence_of_integers() -> None:
    tokens = random_tokens(40, seed=8)
    expected = native_hex(tokens, 8, NAMESPACE, "t", SECRET)
    assert native_hex(tuple(tokens), 8, NAMESPACE, "t", SECRET) == expected
    assert native_hex(np.array(tokens, dtype=np.int64).tolist(), 8, NAMESPACE, "t", SECRET) == (
        expected
    )
    assert native_hex([np.int64(t) for t in tokens], 8, NAMESPACE, "t", SECRET) == expected
    assert native_hex(range(0, 40), 8, NAMESPACE, "t", SECRET) == native_hex(
        list(range(40)), 8, NAMESPACE, "t", SECRET
    )


class ClearsItsList:
    """An integer whose __index__ empties the list holding it."""

    def __init__(self, owner: list[object], value: int) -> None:
        self.owner = owner
        self.value = value

    def __index__(self) -> int:
        self.owner.clear()
        return self.value


def test_a_list_changed_while_read_is_read_as_it_was() -> None:
    expected = native_hex([1, 2, 3, 7, *range(100, 112)], 4, NAMESPACE, "t", SECRET)
    for key_list in (False, True):
        tokens: list[object] = [1, 2, 3]
        tokens += [ClearsItsList(tokens, 7)] + list(range(100, 112))
        keys = (ops.prefix_key_list(tokens, 4, NAMESPACE, "t", SECRET) if key_list  # type: ignore[arg-type]
                else ops.key_bytes(ops.prefix_block_keys(tokens, 4, NAMESPACE, "t", SECRET)))  # type: ignore[arg-type]
        assert [k.hex() for k in keys] == expected
        assert tokens == []


def test_the_key_list_reads_any_integers_as_the_tensor_path_does() -> None:
    tokens = random_tokens(40, seed=8)
    expected = native_hex(tokens, 8, NAMESPACE, "t", SECRET)
    for same in (tuple(tokens), [np.int64(t) for t in tokens], [np.int32(t) for t in tokens]):
        assert [k.hex() for k in ops.prefix_key_list(same, 8, NAMESPACE, "t", SECRET)] == expected  # type: ignore[arg-type]
    assert ops.prefix_key_list(tokens[:7], 8, NAMESPACE, "t", SECRET) == []


@pytest.mark.parametrize("token_ids", [torch.arange(32), "0123", b"0123", 5, iter(range(32))])
def test_the_key_list_takes_a_sequence_of_int_only(token_ids: object) -> None:
    with pytest.raises(TypeError, match="token_ids must be a sequence of int"):
        ops.prefix_key_list(token_ids, 16, NAMESPACE, "t", SECRET)  # type: ignore[arg-type]


def test_non_contiguous_tensor() -> None:
    tokens = torch.tensor(random_tokens(200, seed=2), dtype=torch.int64)
    strided = tokens[::2]
    assert not strided.is_contiguous()
    assert native_hex(strided, 4, NAMESPACE, "t", SECRET) == native_hex(
        strided.tolist(), 4, NAMESPACE, "t", SECRET
    )


def test_keys_equal_in_a_separate_process() -> None:
    tokens = random_tokens(333, seed=3)
    script = textwrap.dedent(
        f"""
        from kvci_plugin import ops
        keys = ops.prefix_block_keys({tokens!r}, 16, {NAMESPACE!r}, "tenant", {SECRET!r})
        print(" ".join(k.hex() for k in ops.key_bytes(keys)))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == native_hex(tokens, 16, NAMESPACE, "tenant", SECRET)
    assert len(result.stdout.split()) == 20


def changed_positions(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    return [i for i in range(a.shape[0]) if not torch.equal(a[i], b[i])]


def test_every_input_changes_every_key() -> None:
    tokens = random_tokens(160, seed=4)
    base = ops.prefix_block_keys(tokens, 16, NAMESPACE, "tenant", SECRET)
    variants = [
        ops.prefix_block_keys(tokens, 16, NAMESPACE[:-1] + b"\x00", "tenant", SECRET),
        ops.prefix_block_keys(tokens, 16, NAMESPACE, "tenant2", SECRET),
        ops.prefix_block_keys(tokens, 16, NAMESPACE, "tenanT", SECRET),
        ops.prefix_block_keys(tokens, 16, NAMESPACE, "tenant", SECRET[:-1] + b"\x00"),
    ]
    for variant in variants:
        assert changed_positions(base, variant) == list(range(10))


@settings(max_examples=40, deadline=None)
@given(position=st.integers(0, 159), delta=st.integers(1, 1000))
def test_a_token_changes_its_block_and_every_later_key_only(position: int, delta: int) -> None:
    tokens = random_tokens(160, seed=5)
    changed = list(tokens)
    changed[position] = (changed[position] + delta) % (MAX_TOKEN_ID + 1)
    base = ops.prefix_block_keys(tokens, 16, NAMESPACE, "t", SECRET)
    other = ops.prefix_block_keys(changed, 16, NAMESPACE, "t", SECRET)
    assert changed_positions(base, other) == list(range(position // 16, 10))


def test_tenant_and_namespace_are_not_concatenated_ambiguously() -> None:
    tokens = random_tokens(32, seed=6)
    a = ops.prefix_block_keys(tokens, 16, b"ab", "c", SECRET)
    b = ops.prefix_block_keys(tokens, 16, b"a", "bc", SECRET)
    assert changed_positions(a, b) == [0, 1]


request_lists = st.lists(
    st.tuples(token_lists, st.sampled_from(["list", "int32", "int64"]), tenants), max_size=6
)


@settings(max_examples=60, deadline=None)
@given(requests=request_lists, block_size=st.integers(1, 20))
def test_batched_equals_single(requests: list[tuple[list[int], str, str]], block_size: int) -> None:
    def as_input(tokens: list[int], kind: str) -> list[int] | torch.Tensor:
        if kind == "list":
            return tokens
        return torch.tensor(tokens, dtype=torch.int32 if kind == "int32" else torch.int64)

    batch = ops.prefix_block_keys_batched(
        [as_input(tokens, kind) for tokens, kind, _ in requests],
        block_size,
        NAMESPACE,
        [tenant for _, _, tenant in requests],
        SECRET,
    )
    assert len(batch) == len(requests)
    for keys, (tokens, _, tenant) in zip(batch, requests, strict=True):
        single = ops.prefix_block_keys(tokens, block_size, NAMESPACE, tenant, SECRET)
        assert torch.equal(keys, single)


def test_batched_long_requests_split_across_threads() -> None:
    # Over 65,536 tokens per thread: the batch is split between threads.
    requests = [random_tokens(n, seed=n) for n in (70_000, 3, 50_000, 0, 45_001)]
    tenant_names = ["a", "b", "a", "c", "d"]
    batch = ops.prefix_block_keys_batched(requests, 16, NAMESPACE, tenant_names, SECRET)
    for keys, tokens, tenant in zip(batch, requests, tenant_names, strict=True):
        assert keys.shape == (len(tokens) // 16, 2)
        assert torch.equal(keys, ops.prefix_block_keys(tokens, 16, NAMESPACE, tenant, SECRET))


def test_the_op_releases_the_gil() -> None:
    tokens = torch.randint(0, MAX_TOKEN_ID, (8_000_000,), dtype=torch.int32)
    assert spins_while(lambda: ops.prefix_block_keys(tokens, 16, NAMESPACE, "t", SECRET)) > 1000


def valid_args() -> dict[str, object]:
    return {
        "token_ids": list(range(32)),
        "block_size": 16,
        "namespace": NAMESPACE,
        "tenant": "t",
        "secret": SECRET,
    }


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"token_ids": [1, 2.0, 3]}, TypeError, r"token_ids\[1\] must be an int, not float"),
        ({"token_ids": ["1"]}, TypeError, r"token_ids\[0\] must be an int, not str"),
        ({"token_ids": [None]}, TypeError, r"token_ids\[0\] must be an int, not NoneType"),
        ({"token_ids": "123"}, TypeError, "token_ids must be a tensor or a sequence"),
        ({"token_ids": 5}, TypeError, "token_ids must be a tensor or a sequence"),
        ({"token_ids": [1, -1]}, ValueError, r"token_ids\[1\] = -1 is outside"),
        ({"token_ids": [2**31]}, ValueError, r"token_ids\[0\] = 2147483648 is outside"),
        ({"token_ids": [2**63]}, ValueError, r"token_ids\[0\] = 9223372036854775808 is outside"),
        ({"token_ids": [5, -(2**70)]}, ValueError, r"token_ids\[1\] = -1180591620717411303424"),
        ({"token_ids": torch.ones(4)}, TypeError, "int32 or int64"),
        ({"token_ids": torch.ones(4, dtype=torch.bool)}, TypeError, "int32 or int64"),
        ({"token_ids": torch.ones(4, dtype=torch.int16)}, TypeError, "int32 or int64"),
        ({"token_ids": torch.ones(2, 16, dtype=torch.int64)}, ValueError, "must be 1-D"),
        (
            {"token_ids": torch.ones(32, dtype=torch.int64, device="meta")},
            ValueError,
            "token_ids must be on the CPU or a CUDA device, got device meta",
        ),
        ({"token_ids": torch.tensor([5, -7], dtype=torch.int32)}, ValueError, r"\[1\] = -7"),
        ({"block_size": 0}, ValueError, "block_size must be positive"),
        ({"block_size": -16}, ValueError, "block_size must be positive"),
        ({"block_size": 16.0}, TypeError, "block_size must be an int"),
        ({"block_size": True}, TypeError, "block_size must be an int"),
        ({"namespace": b""}, ValueError, "namespace must not be empty"),
        ({"namespace": "ns"}, TypeError, "namespace must be bytes"),
        ({"secret": b""}, ValueError, "secret must be at least 16 bytes"),
        ({"secret": b"x" * 15}, ValueError, "secret must be at least 16 bytes"),
        ({"secret": "x" * 32}, TypeError, "secret must be bytes"),
        ({"tenant": ""}, ValueError, "tenant must not be empty"),
        ({"tenant": b"t"}, TypeError, "tenant must be a str"),
        ({"tenant": "\ud800"}, ValueError, "surrogate"),
    ],
)
def test_bad_input_is_refused(change: dict[str, object], error: type, match: str) -> None:
    args = {**valid_args(), **change}
    with pytest.raises(error, match=match):
        ops.prefix_block_keys(**args)
    if isinstance(args["token_ids"], list) or "token_ids" not in change:
        with pytest.raises(error, match=match):  # the key list refuses it alike
            ops.prefix_key_list(**args)


def test_raw_op_checks_its_tensors() -> None:
    subkeys = torch.zeros(32, dtype=torch.uint8)
    tokens = torch.arange(32)
    with pytest.raises(ValueError, match="subkeys must hold 32 bytes"):
        kvci_ops.prefix_block_keys(tokens, 16, torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(TypeError, match="subkeys must be uint8"):
        kvci_ops.prefix_block_keys(tokens, 16, torch.zeros(32, dtype=torch.int32))
    with pytest.raises(TypeError, match="token_ids must be int32 or int64"):
        kvci_ops.prefix_block_keys(tokens.float(), 16, subkeys)
    with pytest.raises(ValueError, match="block_size must be positive"):
        kvci_ops.prefix_block_keys(tokens, 0, subkeys)
    with pytest.raises(ValueError, match=r"must hold 32 bytes per request \(2 requests\)"):
        kvci_ops.prefix_block_keys_batched([tokens, tokens], 16, subkeys)
    with pytest.raises(TypeError, match=r"token_ids\[1\] must be int32 or int64"):
        kvci_ops.prefix_block_keys_batched(
            [tokens, tokens.double()], 16, torch.zeros(64, dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match=r"token_ids\[0\]\[3\] = -2 is outside"):
        kvci_ops.prefix_block_keys_batched(
            [torch.tensor([1, 2, 3, -2])], 16, torch.zeros(32, dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match="block_size must be positive"):
        kvci_ops.prefix_block_keys_batched([tokens], -1, subkeys)


def test_batched_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="tenants has 1 entries but token_ids has 2"):
        ops.prefix_block_keys_batched([[1], [2]], 16, NAMESPACE, ["t"], SECRET)
    with pytest.raises(TypeError, match="tenants must be a sequence of str"):
        ops.prefix_block_keys_batched([[1]], 16, NAMESPACE, "t", SECRET)
    with pytest.raises(TypeError, match="one entry per request"):
        ops.prefix_block_keys_batched(torch.arange(4), 16, NAMESPACE, ["t"], SECRET)
    with pytest.raises(ValueError, match=r"token_ids\[1\] must be 1-D"):
        ops.prefix_block_keys_batched(
            [[1], torch.ones(2, 2, dtype=torch.int64)], 16, NAMESPACE, ["t", "u"], SECRET
        )
    with pytest.raises(ValueError, match=r"token_ids\[1\]\[2\] = -3 is outside"):
        ops.prefix_block_keys_batched([[1], [1, 2, -3]], 16, NAMESPACE, ["t", "u"], SECRET)
    with pytest.raises(ValueError, match="secret must be at least 16 bytes"):
        ops.prefix_block_keys_batched([], 16, NAMESPACE, [], b"short")
    assert ops.prefix_block_keys_batched([], 16, NAMESPACE, [], SECRET) == []


def test_key_bytes_refuses_other_tensors() -> None:
    with pytest.raises(ValueError, match=r"uint64 tensor \[n, 2\]"):
        ops.key_bytes(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="keys must be a tensor"):
        ops.key_bytes([[1, 2]])  # type: ignore[arg-type]
