"""Speculative decoding with a drafter of its own (EAGLE, MTP): what kvci does, said at start.

A drafter's KV at a block's last position is computed from the token after the block, so that
block's drafter KV is only right for requests that continue with the same token. vLLM handles
this in its own prefix cache either by dropping the last matched block ("EAGLE block drop") or,
from 0.34, by hashing each block together with the lookahead tokens after it — the latter only
when the KV connector says ``supports_lookahead_block_hashes``.

kvci says no (``KVCheckpointConnector.supports_lookahead_block_hashes``). Its page keys cover a
block's own tokens (the native prefix keys, not vLLM's ``block_hashes``), so the lookahead proof
would be vLLM's alone; with it on, vLLM also truncates ``Request.block_hashes`` by the lookahead,
which kvci's KV events publish. Supporting it end to end would mean keying every page with the
tokens after it — a hit would then need the next token to match, losing the hits on a shared
prefix that continues differently — and checkpointing one block less at every boundary. Declining
keeps vLLM 0.34 exactly where 0.32 and 0.33 are: vLLM drops the EAGLE block from its own hits,
and a kvci hit loads every layer's pages, the drafter's included, as they were stored. The
drafter's KV at a hit's last position may then come from another continuation, which can lower
the draft acceptance rate and never changes an output (the target model verifies every draft).
``note_at_start`` says so once, at start, when a drafter is configured.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def has_drafter(vllm_config: Any) -> bool:
    """Whether speculative decoding runs a drafter with KV of its own (EAGLE, MTP, a model)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    try:
        return bool(spec.use_eagle() or getattr(spec, "uses_draft_model", lambda: False)())
    except Exception:  # another vLLM's config: say it whenever speculative decoding is on
        return True


def note_at_start(vllm_config: Any) -> bool:
    """Log what kvci does under a drafter; whether there is one."""
    if not has_drafter(vllm_config):
        return False
    logger.warning(
        "kvci: speculative decoding with a drafter (EAGLE/MTP): kvci declines vLLM's lookahead "
        "block hashes (supports_lookahead_block_hashes is False), so vLLM keeps dropping the "
        "last block of its own prefix-cache hits; a kvci hit loads the drafter's KV as it was "
        "stored, which may lower draft acceptance after a shared prefix and never changes an "
        "output")
    return True
