"""The KV cache group layout without an engine: vLLM's sliding-window rule, per-group keys, the
longest run every group serves, and the groups kvci refuses at start."""

from __future__ import annotations

import pytest
import torch
from engine import BLOCK_SIZE

from kvci_plugin.connector.groups import GroupLayout, KVGroup

WINDOW = 64


def test_the_layout_needs_what_vllm_keeps():
    """The sliding-window rule is vLLM's: blocks before the window of the next token are skipped."""
    layout = GroupLayout((KVGroup(("f",)), KVGroup(("s",), WINDOW)), BLOCK_SIZE)
    assert list(layout.needed(0, 0, 6)) == list(range(6))
    # 192 tokens: the next token (192) attends to 129..192, so blocks 0..3 are skipped.
    assert list(layout.needed(1, 0, 6)) == [4, 5]
    assert list(layout.needed(1, 5, 6)) == [5]
    keys = [bytes([i]) * 16 for i in range(8)]
    group_keys = layout.group_keys(keys)
    assert group_keys[0] == keys and len(set(group_keys[1]) | set(keys)) == 16
    held = set(group_keys[0][:8]) | set(group_keys[1][4:6])
    count = lambda ks: next((i for i, k in enumerate(ks) if k not in held), len(ks))  # noqa: E731
    assert layout.longest_run(group_keys, 0, 7, count) == 6  # 7 would need block 6 of the window
    assert layout.longest_run(group_keys, 0, 5, count) == 0  # 5 needs blocks 3, 4: 3 is gone


def _config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)])


def _attention(window: int | None = None, heads: int = 2):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if window is None:
        return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=32,
                                 dtype=torch.bfloat16)
    return SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=32,
                             dtype=torch.bfloat16, sliding_window=window)


def test_a_chunked_local_group_needs_the_current_chunk_only():
    """vLLM's ChunkedLocalAttentionManager skips every token before the next token's chunk."""
    chunked = KVGroup(("c",), chunk=128)  # 4 blocks of 32
    assert chunked.skipped_blocks(13 * BLOCK_SIZE, BLOCK_SIZE) == 12  # chunk 3 starts at block 12
    assert chunked.skipped_blocks(12 * BLOCK_SIZE, BLOCK_SIZE) == 12  # a new chunk: nothing read
    assert chunked.skipped_blocks(3 * BLOCK_SIZE, BLOCK_SIZE) == 0
    layout = GroupLayout((KVGroup(("f",)), chunked), BLOCK_SIZE)
    assert list(layout.needed(1, 0, 14)) == [12, 13] and list(layout.needed(1, 0, 12)) == []


def test_the_connector_reads_its_groups_and_refuses_a_state_space_one():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec

    from kvci_plugin.connector.connector import _group_layout, _slot_bytes

    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32,
                                        dtype=torch.bfloat16, attention_chunk_size=256)
    config = _config(_attention(WINDOW), _attention(), chunked)
    layout = _group_layout(config, BLOCK_SIZE)
    assert [(g.window, g.chunk) for g in layout.groups] == [
        (WINDOW, None),
        (None, None),
        (None, 256),
    ]
    assert layout.describe() == f"window{WINDOW}:layer.0;full:layer.1;chunk256:layer.2"
    assert _slot_bytes(config) == _attention().page_size_bytes
    mamba = MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="group 1 .* MambaSpec.*not supported"):
        _group_layout(_config(_attention(), mamba), BLOCK_SIZE)
    with pytest.raises(ValueError, match="pages differ in size"):
        _slot_bytes(_config(_attention(heads=2), _attention(heads=4)))


def test_window_boundaries_are_the_repeat_the_prompt_end_and_the_ladder():
    """Where a sliding group's window is staged during prefill (#47): the exact repeat's
    boundary, the prompt's last full block, power-of-two rungs from four windows, the
    interval's, the junctions given; none for a layout of full groups only."""
    layout = GroupLayout((KVGroup(("s",), WINDOW),), BLOCK_SIZE)  # 2 window blocks
    assert layout.window_need(0) == 2
    assert layout.boundaries(16 * BLOCK_SIZE + 5, ladder_from=1) == [8, 16]
    assert layout.boundaries(16 * BLOCK_SIZE, ladder_from=1) == [8, 15, 16]  # repeat, end
    assert layout.boundaries(64 * BLOCK_SIZE + 5, ladder_from=1) == [8, 16, 32, 64]
    assert layout.boundaries(64 * BLOCK_SIZE + 5, ladder_from=20 * BLOCK_SIZE) == [32, 64]
    assert layout.boundaries(16 * BLOCK_SIZE + 5) == [16]  # no ladder
    assert layout.boundaries(16 * BLOCK_SIZE + 5, interval=5 * BLOCK_SIZE,
                             junctions=[11, 40]) == [5, 10, 11, 15, 16]
    assert layout.boundaries(BLOCK_SIZE - 1, ladder_from=1) == []
    assert GroupLayout((KVGroup(("f",)),), BLOCK_SIZE).boundaries(1000, ladder_from=1) == []
    # gpt-oss-like: window 128, block 16: 8 window blocks, rungs from 32 blocks.
    gpt = GroupLayout((KVGroup(("f",)), KVGroup(("s",), 128)), 16)
    assert gpt.window_need(0) == 0 and gpt.window_need(1) == 8
    assert gpt.boundaries(8192, ladder_from=1) == [32, 64, 128, 256, 511, 512]
